"""transformers models on our weights, for the baseline systems (plain and serve_batch).

Each wrapper takes a batch of inputs (the plain server passes one) and pads it to the longest, as
the transformers documentation does; it returns one output per input and the batch's cost in real
and padded tokens (for the batching counters). Where the weights come from (the files ours serves):

  classify   BertModel.from_pretrained(<zoo/hf folder>) + mean pooling (+ L2 norm, as the encoder's
             config says) + the head's head.safetensors as an nn.Linear; tiny:encoder via export.to_hf_bert
  translate  MarianMTModel from our Seq2Seq via models.checkpoints.marian.to_hf_marian; generate(num_beams)
  generate   LlamaForCausalLM from models.reference.transformers_from_gguf (gguf: sources);
             tiny:decoder via export.to_hf_llama; generate() on left-padded prompts

Token ids come from the model's own tokenizer (the same `tokenizers` file ours uses), cut to the
same input limit, so every system computes on identical ids. Each builder runs one input through
both the transformers model and ours and reports the largest absolute difference (`parity`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.catalog import LoadedModel, ModelSpec, load_model, resolve_dir
from models.text import TextTokenizer
from service.replica.batcher import BatchStats
from service.replica.device import resolve_device  # the service's "auto": the same device and dtype here

log = logging.getLogger(__name__)
PARITY_TEXTS = ("The service answered quickly.", "A second, slightly longer sentence to check padding.")


@dataclass
class BatchCost:
    real_tokens: int  # input tokens of the rows (generation: prompt + new tokens)
    computed_tokens: int  # rows x longest (what the padded batch computes)


class Counters(BatchStats):
    """The service's batching counters (/v1/models `stats`), fed from a baseline's padded batches."""

    def add(self, items: int, cost: BatchCost) -> None:
        self.record(items, cost.real_tokens, cost.computed_tokens)


def encode(tokenizer: TextTokenizer, text: str, limit: int) -> list[int]:
    """Token ids with the model's special tokens, cut to `limit` keeping them (the service's truncate)."""
    ids = tokenizer.encode(text)
    if len(ids) <= limit:
        return ids
    n_special = len(tokenizer.encode(""))
    enc = tokenizer.tok.encode(text, add_special_tokens=False)
    enc.truncate(max(limit - n_special, 0))
    return tokenizer.tok.post_process(enc).ids


def pad(seqs: Sequence[Sequence[int]], pad_id: int, left: bool, device: str) -> tuple[Tensor, Tensor]:
    """Token lists -> ids (B, T) and attention mask (B, T) (1 on real tokens), padded to the longest."""
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(seqs), t), dtype=torch.long)  # (B, T)
    for i, s in enumerate(seqs):
        cols = slice(t - len(s), t) if left else slice(0, len(s))
        ids[i, cols] = torch.as_tensor(list(s), dtype=torch.long)
        mask[i, cols] = 1
    return ids.to(device), mask.to(device)


def _cost(seqs: Sequence[Sequence[int]]) -> BatchCost:
    return BatchCost(sum(len(s) for s in seqs), len(seqs) * max(len(s) for s in seqs))


@dataclass
class Classifier:
    encoder: nn.Module  # transformers BertModel
    head: nn.Linear
    tokenizer: TextTokenizer
    labels: tuple[str, ...]
    limit: int
    pad_id: int
    normalize: bool
    device: str

    @torch.inference_mode()
    def probs(self, texts: Sequence[str]) -> tuple[Tensor, BatchCost]:
        seqs = [encode(self.tokenizer, t, self.limit) for t in texts]
        ids, mask = pad(seqs, self.pad_id, left=False, device=self.device)  # (B, T) each
        hidden = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, C)
        w = mask.to(hidden.dtype)[..., None]  # (B, T, 1)
        pooled = (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)  # (B, C)
        if self.normalize:
            pooled = F.normalize(pooled, dim=-1)
        return self.head(pooled).float().softmax(-1).cpu(), _cost(seqs)  # (B, n_labels)

    def __call__(self, texts: Sequence[str]) -> tuple[list[dict[str, Any]], BatchCost]:
        probs, cost = self.probs(texts)
        out = []
        for row in probs.tolist():
            best = max(range(len(row)), key=row.__getitem__)
            out.append(
                {
                    "label": self.labels[best],
                    "score": row[best],
                    "scores": dict(zip(self.labels, row, strict=True)),
                }
            )
        return out, cost


@dataclass
class Translator:
    model: nn.Module  # transformers MarianMTModel
    tokenizer: TextTokenizer
    limit: int
    pad_id: int
    banned: list[int]
    device: str

    @torch.inference_mode()
    def __call__(
        self, texts: Sequence[str], beam_size: int, max_new_tokens: int
    ) -> tuple[list[str], BatchCost]:
        seqs = [encode(self.tokenizer, t, self.limit) for t in texts]
        ids, mask = pad(seqs, self.pad_id, left=False, device=self.device)  # (B, S) each
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            num_beams=beam_size,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            suppress_tokens=self.banned or None,
        )  # (B, T')
        return self.tokenizer.decode_batch(out.cpu().tolist()), _cost(seqs)


@dataclass
class Generated:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


@dataclass
class Generator:
    model: nn.Module  # transformers LlamaForCausalLM
    tokenizer: TextTokenizer
    limit: int  # prompt + new tokens
    pad_id: int
    eos_ids: list[int]
    device: str

    def check(self, prompt: str, max_new_tokens: int) -> list[int]:
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError("the prompt has no tokens")
        if len(ids) + max_new_tokens > self.limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({max_new_tokens}) is over {self.limit}"
            )
        return ids

    @torch.inference_mode()
    def __call__(
        self, prompts: Sequence[str], max_new: Sequence[int], ignore_eos: bool, temperature: float
    ) -> tuple[list[Generated], BatchCost]:
        """Static batching: one left-padded generate() for the batch, run to the longest request."""
        seqs = [self.check(p, n) for p, n in zip(prompts, max_new, strict=True)]
        ids, mask = pad(seqs, self.pad_id, left=True, device=self.device)  # (B, T) each
        n = max(max_new)
        sampling: dict[str, Any] = (
            {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        )
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n if ignore_eos else None,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_ids,
            top_k=None,
            top_p=None,
            **sampling,
        )  # (B, T + n')
        results = []
        for i, row in enumerate(out[:, ids.size(1) :].cpu().tolist()):
            toks, reason = row[: max_new[i]], "length"
            if not ignore_eos:
                stop = next((j for j, t in enumerate(toks) if t in self.eos_ids), None)
                if stop is not None:
                    toks, reason = toks[:stop], "stop"
            results.append(Generated(self.tokenizer.decode(toks), len(seqs[i]), len(toks), reason))
        real = sum(len(s) + r.completion_tokens for s, r in zip(seqs, results, strict=True))
        return results, BatchCost(real, len(seqs) * (ids.size(1) + out.size(1) - ids.size(1)))


@dataclass
class Built:
    task: str
    model: Classifier | Translator | Generator
    info: dict[str, Any] = field(default_factory=dict)


def _finish(task: str, model: Any, spec: ModelSpec, started: float, parity: float) -> Built:
    if parity > 1e-3:
        log.warning("%s: transformers and ours differ by %.2e on the parity input", spec.name, parity)
    log.info(
        "%s (%s): loaded in %.1f s; parity with ours %.2e",
        spec.name,
        task,
        time.perf_counter() - started,
        parity,
    )
    return Built(
        task,
        model,
        {
            "name": spec.name,
            "source": spec.source,
            "parity_max_abs_diff": parity,
            "load_seconds": time.perf_counter() - started,
            "device": model.device,
            "dtype": str(model.dtype).removeprefix("torch."),
        },
    )


def build_classifier(spec: ModelSpec, cache_dir: Path, device: str, dtype: str = "auto") -> Built:
    from safetensors.torch import load_file

    started = time.perf_counter()
    ours = load_model(spec, cache_dir)
    if spec.source.split(":", 1)[0] in ("zoo", "hf"):
        from transformers import BertModel

        encoder = BertModel.from_pretrained(
            str(resolve_dir(spec.source, cache_dir)), add_pooling_layer=False, dtype=torch.float32
        ).eval()
    else:
        from .export import to_hf_bert

        encoder = to_hf_bert(ours.model)
    if spec.head is not None:
        weights = load_file(resolve_dir(spec.head, cache_dir) / "head.safetensors")
        head = nn.Linear(weights["weight"].shape[1], weights["weight"].shape[0])
        head.load_state_dict(weights)
    else:
        head = ours.model.head
    cfg = ours.model.cfg
    model = Classifier(
        encoder,
        head.eval(),
        ours.tokenizer,
        ours.labels,
        ours.max_input_tokens,
        cfg.pad_token_id or 0,
        cfg.normalize_embeddings,
        "cpu",
    )
    parity = _classifier_parity(model, ours)
    return _finish("classify", _to(model, device, dtype), spec, started, parity)


def _classifier_parity(model: Classifier, ours: LoadedModel) -> float:
    theirs, _ = model.probs(PARITY_TEXTS)
    seqs = [encode(ours.tokenizer, t, ours.max_input_tokens) for t in PARITY_TEXTS]
    ids, mask = pad(seqs, model.pad_id, left=False, device="cpu")  # (B, T) each
    with torch.inference_mode():
        mine = ours.model.head(ours.model.embed(ids, mask.bool())).softmax(-1)  # (B, n_labels)
    return float((mine - theirs).abs().max())


def build_translator(spec: ModelSpec, cache_dir: Path, device: str, dtype: str = "auto") -> Built:
    from transformers import MarianConfig, MarianMTModel

    from models.checkpoints.marian import to_hf_marian

    started = time.perf_counter()
    ours = load_model(spec, cache_dir)
    config, state = to_hf_marian(ours.model)
    hf = MarianMTModel(MarianConfig(**config))
    hf.load_state_dict(state, strict=True)
    cfg = ours.model.cfg
    banned = sorted(
        {t for t in (cfg.pad_token_id, cfg.decoder_start_token_id) if t is not None} - {cfg.eos_token_id}
    )
    model = Translator(hf.eval(), ours.tokenizer, ours.max_input_tokens, cfg.pad_token_id, banned, "cpu")
    src = torch.tensor([encode(ours.tokenizer, PARITY_TEXTS[0], ours.max_input_tokens)])  # (1, S)
    tgt = torch.cat([torch.tensor([[cfg.decoder_start_token_id]]), src[:, :3]], dim=1)  # (1, 4)
    with torch.inference_mode():
        mine = ours.model(src, torch.ones_like(src, dtype=torch.bool), tgt)  # (1, 4, V)
        theirs = hf(
            input_ids=src, attention_mask=torch.ones_like(src), decoder_input_ids=tgt
        ).logits  # (1, 4, V)
    return _finish("translate", _to(model, device, dtype), spec, started, float((mine - theirs).abs().max()))


def build_generator(spec: ModelSpec, cache_dir: Path, device: str, dtype: str = "auto") -> Built:
    started = time.perf_counter()
    ours = load_model(spec, cache_dir)
    scheme, _, rest = spec.source.partition(":")
    if scheme == "gguf":
        from models import zoo
        from models.reference import transformers_from_gguf

        if rest.startswith("zoo:"):
            name = rest[len("zoo:") :]
            ((file, _),) = zoo.ZOO[name].files.items()
            folder = zoo.resolve(name, cache_dir)
        else:
            path = Path(rest).expanduser()
            folder, file = path.parent, path.name
        hf = transformers_from_gguf(folder, file)
    else:
        from .export import to_hf_llama

        hf = to_hf_llama(ours.model)
    cfg = ours.model.cfg
    eos = list(cfg.eos_token_ids)
    pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else eos[0]
    limit = min(spec.max_input_tokens or cfg.max_positions, cfg.max_positions)
    model = Generator(hf, ours.tokenizer, limit, pad_id, eos, "cpu")
    ids = torch.tensor([ours.tokenizer.encode(PARITY_TEXTS[1])])  # (1, T)
    with torch.inference_mode():
        mine = ours.model(ids)[:, -1]  # (1, V)
        theirs = hf(input_ids=ids).logits[:, -1]  # (1, V)
    return _finish("generate", _to(model, device, dtype), spec, started, float((mine - theirs).abs().max()))


BUILDERS: dict[str, Callable[[ModelSpec, Path, str, str], Built]] = {
    "classify": build_classifier,
    "translate": build_translator,
    "generate": build_generator,
}


def build_all(
    specs: dict[str, ModelSpec], tasks: Sequence[str], cache_dir: Path, device: str, dtype: str = "auto"
) -> dict[str, Built]:
    """task -> the transformers model serving it (loaded one after the other, ours freed after
    parity, which is checked in float32 on the CPU), then moved to `device` in `dtype`."""
    return {task: BUILDERS[task](specs[task], cache_dir, device, dtype) for task in tasks}


def _to(model: Any, device: str, dtype_name: str) -> Any:
    dev, dtype = resolve_device(device, dtype_name)
    for name in ("encoder", "head", "model"):
        if hasattr(model, name):
            setattr(model, name, getattr(model, name).to(device=dev, dtype=dtype))
    model.device, model.dtype = dev, dtype
    return model
