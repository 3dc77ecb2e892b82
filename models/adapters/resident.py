"""The adapters a model holds at once: `ResidentAdapters`, N slots of LoRA factors beside its projections.

Built once per loaded model (and its prompt twin, which shares the slots' storage): every block's
attention and feed-forward projections become LoraLinear (fused ones keep their parts: q/k/v, gate/up),
so any adapter of that model loads without rebuilding anything, and a projection's cost for rows
without an adapter is nothing. `load` writes an adapter into a free slot, or the least recently used
one no running request holds; `acquire` / `release` count the requests on a slot so that it is never
overwritten under them. Thread-safe: the engine's thread acquires while another loads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .heads import AdapterHead, adapter_head
from .lora import LoraLinear
from .peft import AdapterError, LoraAdapter


class AdaptersFull(AdapterError):
    """Every slot holds an adapter that running requests use."""


@dataclass(frozen=True)
class Held:
    """A request's hold on an adapter's slot (ResidentAdapters.acquire): release it once."""

    slot: int
    key: str  # this load of the adapter (its name and a load count): what its cached keys are stored under
    name: str


def _projections(model: nn.Module) -> dict[tuple[int, str], tuple[str, nn.Module, tuple[int, ...], int]]:
    """(layer, our logical name) -> (module path, module, part bounds, part) for every block projection."""
    out = {}
    stack = model.stack  # DecoderLM, EncoderModel
    for i, block in enumerate(stack.blocks):
        attn, ff = block.self_attn, block.ff
        pre = f"stack.blocks.{i}"
        if attn.qkv is not None:
            q = attn.n_heads * attn.head_dim
            kv = attn.n_kv_heads * attn.head_dim
            bounds = (0, q, q + kv, q + 2 * kv)
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                out[i, name] = (f"{pre}.self_attn.qkv", attn.qkv, bounds, part)
        else:
            for name in ("q_proj", "k_proj", "v_proj"):
                m = getattr(attn, name)
                out[i, name] = (f"{pre}.self_attn.{name}", m, (0, m.out_features), 0)
        out[i, "o_proj"] = (f"{pre}.self_attn.o_proj", attn.o_proj, (0, attn.o_proj.out_features), 0)
        if ff.gate_up is not None:
            f = ff.gate_up.out_features // 2
            out[i, "gate"] = (f"{pre}.ff.gate_up", ff.gate_up, (0, f, 2 * f), 0)
            out[i, "up"] = (f"{pre}.ff.gate_up", ff.gate_up, (0, f, 2 * f), 1)
        else:
            for name in ("gate", "up"):
                m = getattr(ff, name)
                if m is not None:
                    out[i, name] = (f"{pre}.ff.{name}", m, (0, m.out_features), 0)
        out[i, "down"] = (f"{pre}.ff.down", ff.down, (0, ff.down.out_features), 0)
    return out


def _attach(model: nn.Module, capacity: int, rank: int, shared: dict[str, LoraLinear] | None,
            dtype: torch.dtype, kernel: bool) -> tuple[dict[str, LoraLinear], dict[tuple[int, str], tuple[LoraLinear, int]]]:
    """Wrap `model`'s block projections in place; returns (path -> LoraLinear, (layer, name) -> (it, part))."""
    wrapped: dict[str, LoraLinear] = {}
    where: dict[tuple[int, str], tuple[LoraLinear, int]] = {}
    for key, (path, module, bounds, part) in _projections(model).items():
        if path not in wrapped:
            if isinstance(module, LoraLinear):
                raise ValueError(f"{path} already carries adapters")
            lin = LoraLinear(module, bounds, capacity, rank, shared=None if shared is None else shared[path],
                             dtype=dtype, kernel=kernel)
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, lin)
            wrapped[path] = lin
        where[key] = (wrapped[path], part)
    return wrapped, where


class ResidentAdapters:
    """`capacity` slots of adapters up to rank `rank` on `models` (a model and its twins: the same
    architecture, other weights), wrapped in place at construction; factors held in `dtype` (float32;
    bfloat16 or int8 with per-rank scales: a half or a quarter of the bytes each step reads, rounded once
    when an adapter loads); `kernel`: the torch
    forward's updates through our CPU kernel (models/kernels/lora.cpp: a CPU model whose kernels load),
    else torch's batched products."""

    def __init__(self, models: Sequence[nn.Module], capacity: int, rank: int, dtype: torch.dtype = torch.float32,
                 kernel: bool = False) -> None:
        if capacity < 1 or rank < 1:
            raise ValueError(f"adapters need at least one slot and rank 1, got {capacity} slots of rank {rank}")
        self.capacity, self.rank, self.dtype, self.kernel = capacity, rank, dtype, kernel
        self._model = models[0]
        first, self._where = _attach(models[0], capacity, rank, None, dtype, kernel)
        for twin in models[1:]:
            _attach(twin, capacity, rank, first, dtype, kernel)
        self._modules = list(first.values())
        self._slots: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self._keys: dict[str, str] = {}  # name -> this load's key
        self._loads = 0
        self._users = [0] * capacity  # running requests per slot
        self._heads: list[AdapterHead | None] = [None] * capacity  # a classification adapter's own head
        self._lock = threading.Lock()

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._slots)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._slots

    def _free_slot(self) -> int:
        used = set(self._slots.values())
        for s in range(self.capacity):
            if s not in used:
                return s
        for name, s in self._slots.items():  # least recently used first
            if self._users[s] == 0:
                del self._slots[name]
                return s
        raise AdaptersFull(f"all {self.capacity} adapter slots hold adapters that running requests use")

    def _check(self, adapter: LoraAdapter) -> AdapterHead | None:
        """The adapter's own head (None: it has none); AdapterError when the model cannot serve it."""
        head = adapter_head(adapter, self._model)
        if adapter.rank > self.rank:
            raise AdapterError(f"adapter {adapter.name!r} has rank {adapter.rank}; this model serves ranks up to "
                               f"{self.rank} (max_lora_rank)")
        for f in adapter.factors:
            if (f.target.layer, f.target.name) not in self._where:
                raise AdapterError(f"adapter {adapter.name!r} adapts layer {f.target.layer}'s {f.target.name}, which "
                                   f"this model does not have")
            lin, part = self._where[f.target.layer, f.target.name]
            width = lin.bounds[part + 1] - lin.bounds[part]
            if f.a.size(1) != lin.in_features or f.b.size(0) != width:
                raise AdapterError(f"adapter {adapter.name!r}: {f.target.path} takes {lin.in_features} inputs to "
                                   f"{width} outputs; its factors are {tuple(f.a.shape)} and {tuple(f.b.shape)}")
        return head

    def load(self, adapter: LoraAdapter, hold: bool = False) -> int:
        """Put `adapter` in a slot (replacing one of the same name no request holds); returns the slot,
        held for a request (as acquire) with `hold`."""
        head = self._check(adapter)
        with self._lock:
            if adapter.name in self._slots:
                slot = self._slots[adapter.name]
                if self._users[slot]:
                    raise AdapterError(f"adapter {adapter.name!r} is in use; unload it first")
                del self._slots[adapter.name]
            else:
                slot = self._free_slot()
            for lin in self._modules:
                lin.clear(slot)
            for f in adapter.factors:
                lin, part = self._where[f.target.layer, f.target.name]
                lin.put(slot, part, f.a, f.b, f.scale)
            self._heads[slot] = head
            self._slots[adapter.name] = slot
            self._loads += 1
            self._keys[adapter.name] = f"{adapter.name}#{self._loads}"
            if hold:
                self._users[slot] += 1
            return slot

    def unload(self, name: str) -> None:
        """Free `name`'s slot; KeyError when it is not loaded, AdapterError while requests use it."""
        with self._lock:
            slot = self._slots[name]
            if self._users[slot]:
                raise AdapterError(f"adapter {name!r} is in use by {self._users[slot]} running requests")
            del self._slots[name]
            for lin in self._modules:
                lin.clear(slot)
            self._heads[slot] = None

    def head(self, slot: int) -> AdapterHead | None:
        """The classification head of the adapter in `slot` (held by the caller's request), None when it
        labels with the base model's."""
        return self._heads[slot]

    def acquire(self, name: str) -> Held:
        """The slot of `name`, held for a request until `release`; KeyError when it is not loaded."""
        with self._lock:
            slot = self._slots[name]
            self._slots.move_to_end(name)
            self._users[slot] += 1
            return Held(slot, self._keys[name], name)

    def load_held(self, adapter: LoraAdapter) -> Held:
        """load(adapter, hold=True), as a Held."""
        slot = self.load(adapter, hold=True)
        with self._lock:
            return Held(slot, self._keys[adapter.name], adapter.name)

    def release(self, slot: int) -> None:
        with self._lock:
            if self._users[slot] <= 0:
                raise ValueError(f"adapter slot {slot} is not held")
            self._users[slot] -= 1
