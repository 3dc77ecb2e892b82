"""Fused projections (models/projections/fuse.py): the same outputs as the separate ones, for every family, with
and without the KV cache; load_model fuses unless the spec says not to."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from models.cache.dense import KVCache
from models.catalog import ModelSpec, load_model
from models.config import BlockConfig
from models.projections.base import RepackedLinear
from models.projections.dense import AtenLinear
from models.projections.fuse import fuse_projections
from models.projections.quant import Int8Linear
from models.tiny import tiny_model
from tests.models.test_invariants import DECODERS, ENCODERS, LENGTHS, MODELS, SEQ2SEQS, close, padded, real

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# the invariance configs: q/k norm and head dim (Qwen3), q/k/v biases, windows, YaRN, T5's relative bias
INVARIANT_CONFIGS = {**ENCODERS, **DECODERS, **SEQ2SEQS}


def _linears(model: nn.Module) -> set[str]:
    """Names of the projections, whatever kernel the load chose for each (the "auto" dense kernel is
    measured per shape, so a projection may come back as a packed, panel or aten Linear)."""
    kinds = nn.Linear | Int8Linear | RepackedLinear | AtenLinear
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, kinds)}


@pytest.mark.parametrize("family", ["encoder", "decoder", "seq2seq"])
def test_fused_projections_give_the_same_outputs(family: str) -> None:
    torch.manual_seed(0)
    plain, _ = tiny_model(family)
    fused, _ = tiny_model(family)
    fuse_projections(fused)
    assert "qkv" in _linears(fused) and not {"q_proj", "k_proj"} & {
        n.rsplit(".", 1)[-1] for n, m in fused.named_modules() if ".self_attn." in n + "."}
    ids = torch.randint(3, 200, (3, 9))
    keep = torch.arange(9)[None, :] < torch.tensor([[9], [4], [1]])  # (3, 9) padded rows
    with torch.inference_mode():
        if family == "encoder":
            assert torch.allclose(fused.embed(ids, keep), plain.embed(ids, keep), atol=1e-6)
        elif family == "decoder":
            assert torch.allclose(fused(ids, keep), plain(ids, keep), atol=1e-6)
            cache = KVCache.for_model(fused.cfg, 1, 16)
            steps = []
            for t in range(9):
                steps.append(fused(ids[:1, t:t + 1], cache=cache.view())[:, 0])
                cache.advance(1)
            assert torch.allclose(torch.stack(steps, 1), plain(ids[:1]), atol=1e-5)
        else:
            tgt = torch.randint(3, 200, (3, 5))
            assert torch.allclose(fused(ids, keep, tgt), plain(ids, keep, tgt), atol=1e-6)
            assert "q_proj" in _linears(fused)  # cross-attention keeps its own q (k/v come from the source)


@torch.no_grad()
def _plain_and_fused(cfg: BlockConfig) -> tuple[nn.Module, nn.Module]:
    """A model of cfg's family with every parameter moved off its init (identity norms and zero biases
    would hide a dropped q/k norm or bias in the fused path), and a fused copy of it; eval mode."""
    torch.manual_seed(0)
    plain = MODELS[cfg.family](cfg)
    for p in plain.parameters():
        p.add_(torch.randn_like(p) * 0.1)
    plain.eval()
    return plain, fuse_projections(copy.deepcopy(plain))


@pytest.mark.parametrize("name", sorted(INVARIANT_CONFIGS))
@torch.inference_mode()
def test_fused_projections_match_on_every_invariant_config(name: str) -> None:
    cfg = INVARIANT_CONFIGS[name]
    plain, fused = _plain_and_fused(cfg)
    assert "qkv" in _linears(fused)
    ids, keep = padded(cfg, LENGTHS, "right", seed=1)  # (B, T), (B, T)
    if cfg.family == "encoder":
        close(fused(ids, keep), plain(ids, keep))  # (B, T, C)
        close(fused.embed(ids, keep), plain.embed(ids, keep))  # (B, C)
    elif cfg.family == "decoder":
        close(fused(ids, keep), plain(ids, keep))  # (B, T, V)
        row = real(ids, keep, 0)  # (1, n)
        cache = KVCache.for_model(cfg, 1, 16)
        steps = []
        for t in range(row.size(1)):
            steps.append(fused(row[:, t:t + 1], cache=cache.view())[:, 0])  # (1, V)
            cache.advance(1)
        close(torch.stack(steps, 1), plain(row))  # (1, n, V)
    else:
        tgt, tgt_keep = padded(cfg, (4, 2, 3), "right", seed=2)  # (B, T'), (B, T')
        close(fused(ids, keep, tgt, tgt_keep), plain(ids, keep, tgt, tgt_keep))  # (B, T', V)


def test_load_model_fuses_unless_told_not_to_and_quantizes_the_fused_projections() -> None:
    spec = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder")
    assert {"qkv", "gate_up"} <= _linears(load_model(spec, Path("/nonexistent")).model)
    unfused = ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", fuse=False)
    assert not {"qkv", "gate_up"} & _linears(load_model(unfused, Path("/nonexistent")).model)
    quantized = load_model(ModelSpec(name="g", tasks=("generate",), source="tiny:decoder", quantize="int8"),
                           Path("/nonexistent")).model
    block = quantized.stack.blocks[0]
    assert isinstance(block.self_attn.qkv, Int8Linear) and isinstance(block.ff.gate_up, Int8Linear)


def test_exports_and_checkpoints_see_the_unfused_layout(tmp_path: Path) -> None:
    from models.checkpoints.format import CheckpointError, save_checkpoint
    from models.projections.fuse import unfused_state_dict

    plain, _ = tiny_model("decoder")
    fused, _ = tiny_model("decoder")
    fuse_projections(fused)
    state = unfused_state_dict(fused)
    assert set(state) == set(plain.state_dict())
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    with pytest.raises(CheckpointError, match="before fuse_projections"):
        save_checkpoint(fused, tmp_path / "fused")


def test_a_quantized_encoder_keeps_its_projections_unfused() -> None:
    spec = ModelSpec(name="e", tasks=("embed",), source="tiny:encoder", quantize="int8")
    names = _linears(load_model(spec, Path("/nonexistent")).model)
    assert "qkv" not in names and "q_proj" in names
    # aten: no packing, whose choice per shape is measured (a packed projection is no nn.Linear)
    assert "qkv" in _linears(load_model(ModelSpec(name="e", tasks=("embed",), source="tiny:encoder",
                                                  dense_kernel="aten"), Path("/nonexistent")).model)
