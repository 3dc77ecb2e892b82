"""The Llama family beyond plain Llama: Qwen2, Qwen3, Mistral and Llama 3.x RoPE scalings, against `transformers`.

Dimension legend: B batch rows (3, of different lengths), T padded length, V vocabulary.

Each variant is a tiny random HF model, every parameter perturbed away from its init (so a q/k norm
or a bias mapped to the wrong place cannot hide), imported into ours: logits on a padded batch
(left and right) within 1e-4, and greedy tokens equal to HF `generate` for 20 steps.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as hf

from models.cache.dense import KVCache
from models.checkpoints import llama
from models.checkpoints.registry import import_hf
from models.config import RopeScaling
from models.decoding import SamplingParams
from models.generate import generate
from models.positions import RotaryPositions

from .test_generation_parity import PROMPTS, hf_greedy, spread
from .test_parity import _decoder_parity, perturb

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB, PAD = 100, 0
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=None,
            eos_token_id=None, pad_token_id=PAD, attn_implementation="eager")
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 500.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}

# name -> (HF config class, HF model class, config changes, what our config must say)
VARIANTS: dict[str, tuple[type, type, dict[str, Any], dict[str, Any]]] = {
    "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM, dict(tie_word_embeddings=True),
              dict(attn_bias=True, out_bias=False, sliding_window=None)),
    "qwen3-head-dim": (hf.Qwen3Config, hf.Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=False),
                       dict(qk_norm=True, head_dim=16, attn_bias=False)),
    "qwen3-biases": (hf.Qwen3Config, hf.Qwen3ForCausalLM, dict(head_dim=8, attention_bias=True),
                     dict(qk_norm=True, attn_bias=True, out_bias=True)),
    "mistral-window-3": (hf.MistralConfig, hf.MistralForCausalLM, dict(sliding_window=3),
                         dict(sliding_window=3)),
    "llama3-rope": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(rope_parameters=LLAMA3),
                    dict(rope_scaling=RopeScaling("llama3", 8.0, 16, 1.0, 4.0))),
    "yarn-rope": (hf.LlamaConfig, hf.LlamaForCausalLM, dict(rope_parameters=YARN),
                  dict(rope_scaling=RopeScaling("yarn", 4.0, 16))),
    "linear-rope": (hf.LlamaConfig, hf.LlamaForCausalLM,
                    dict(rope_parameters={"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0}),
                    dict(rope_scaling=RopeScaling("linear", 3.0))),
}


def pair(name: str, scale: float = 0.1) -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    config_cls, model_cls, changes, _ = VARIANTS[name]
    torch.manual_seed(0)
    config = config_cls(**{**BASE, **changes})
    ref = perturb(model_cls(config)) if scale == 0.1 else spread(model_cls(config), scale)
    return config, ref, import_hf(config.to_dict(), ref.state_dict())


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_match_transformers(name: str, side: str) -> None:
    _, ref, ours = pair(name)
    for field, want in VARIANTS[name][3].items():
        assert getattr(ours.cfg, field) == want, field
    _decoder_parity(ref, ours, side)


@pytest.mark.parametrize("name", ["qwen2", "qwen3-head-dim", "mistral-window-3", "llama3-rope", "yarn-rope"])
def test_greedy_generation_matches_transformers(name: str) -> None:
    """20 cached steps, rows at their own positions; with a window of 3 most keys fall out of it."""
    _, ref, ours = pair(name, scale=0.3)
    theirs = hf_greedy(ref, PROMPTS, eos=None)
    mine = [g.tokens for g in generate(ours, PROMPTS, SamplingParams(max_new_tokens=20))]
    assert mine == theirs
    assert len({tuple(t) for t in mine}) == len(PROMPTS)  # varied outputs: the comparison means something


def test_sliding_window_changes_the_output() -> None:
    """The window is really applied: the same weights without it give other logits past the window."""
    _, ref, ours = pair("mistral-window-3")
    unwindowed = llama.from_hf({**ref.config.to_dict(), "sliding_window": None}, ref.state_dict())
    ids = torch.randint(3, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))  # (1, T)
    with torch.no_grad():
        a, b = ours(ids), unwindowed(ids)  # (1, T, V) each
    torch.testing.assert_close(a[:, :3], b[:, :3])  # the first 3 queries see at most 3 keys either way
    assert (a[:, 3:] - b[:, 3:]).abs().max() > 1e-3


def test_a_windowed_cache_keeps_w_slots_and_matches_transformers_past_the_window() -> None:
    """Mistral, window 3: a right-padded prefill of three prompts (7, 2 and 5 tokens) into a cache
    whose rows hold 3 slots (a ring), then 10 one-token steps and a 3-token step: every step's
    logits equal transformers' full forward over each row alone, within 1e-4."""
    _, ref, ours = pair("mistral-window-3")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g) for n in (7, 2, 5)]
    follow = torch.randint(3, VOCAB, (3, 13), generator=g)  # (B, 13): 10 single steps, then 3 at once
    cache = KVCache.for_model(ours.cfg, rows=3, max_len=32)
    assert cache.ring and cache.slots == 3 and cache.k[0].size(2) == 3
    lengths = torch.tensor([len(p) for p in prompts])  # (B,)
    ids = torch.zeros(3, 7, dtype=torch.long)  # (B, T) right-padded
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    with torch.no_grad():
        got = [ours(ids, cache=cache.view(), last=lengths - 1)]  # (B, 1, V)
        cache.advance(lengths)
        for i in range(10):
            got.append(ours(follow[:, i:i + 1], cache=cache.view()))  # (B, 1, V)
            cache.advance(1)
        got.append(ours(follow[:, 10:], cache=cache.view()))  # (B, 3, V)
        got_t = torch.cat(got, dim=1)  # (B, 14, V)
        for row, p in enumerate(prompts):
            alone = torch.cat([p, follow[row]])[None]  # (1, n + 13)
            want = ref(alone).logits[0, len(p) - 1:]  # (14, V)
            torch.testing.assert_close(got_t[row], want, atol=1e-4, rtol=1e-4)


def test_dynamic_ntk_matches_transformers_row_by_row() -> None:
    """Past the trained context (4 here), dynamic NTK grows the base with the length: each row alone as HF.

    HF derives one base from the longest row of a batch; ours from each row's own length, so a row's
    logits do not depend on what it is batched with (checked on the batch below)."""
    torch.manual_seed(0)
    config = hf.LlamaConfig(**{**BASE, "max_position_embeddings": 4,
                               "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 100.0}})
    ref = perturb(hf.LlamaForCausalLM(config))
    ours = llama.from_hf(config.to_dict(), ref.state_dict())
    assert ours.cfg.max_positions == 8 and ours.cfg.rope_scaling == RopeScaling("dynamic", 2.0, 4)
    rows = [torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 3, 5)]
    with torch.no_grad():
        for ids in rows:
            torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
        batch = torch.full((3, 7), PAD)
        keep = torch.zeros(3, 7, dtype=torch.bool)
        for i, ids in enumerate(rows):
            batch[i, :ids.size(1)], keep[i, :ids.size(1)] = ids[0], True
        together = ours(batch, keep)  # (B, T, V)
        for i, ids in enumerate(rows):
            torch.testing.assert_close(together[i, :ids.size(1)], ours(ids)[0], atol=1e-5, rtol=1e-5)


def test_rotary_inverse_frequencies_match_transformers() -> None:
    """Our frequencies (and YaRN's cos/sin factor) against HF's rotary embedding for each scaling."""
    for params in (LLAMA3, YARN, {"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0}):
        config = hf.LlamaConfig(**{**BASE, "rope_parameters": params})
        ours = llama.config_from_hf(config.to_dict())
        rope = RotaryPositions(ours.head_dim, ours.rope_theta, ours.rope_scaling)
        positions = torch.arange(40)[None, :]  # (1, T)
        cos, sin = rope(positions, torch.float32)  # (1, 1, T, D)
        ref = hf.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        ref_cos, ref_sin = ref(torch.zeros(1, 40, 8), positions)  # (1, T, D)
        torch.testing.assert_close(cos[:, 0], ref_cos, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(sin[:, 0], ref_sin, atol=1e-6, rtol=1e-5)


def test_configs_with_rope_scaling_round_trip_through_our_format() -> None:
    """Our checkpoint format (and the GGUF conversion cache) stores configs as JSON."""
    import json

    from models.config import BlockConfig, DecoderConfig

    for scaling in (RopeScaling("yarn", 4.0, 16, attention_factor=1.2), RopeScaling("dynamic", 2.0, 32),
                    RopeScaling("frequencies", 1.0, freq_factors=(1.0, 2.5, 8.0, 8.0))):
        cfg = DecoderConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=1, position="rotary",
                            rope_scaling=scaling, sliding_window=5, qk_norm=True, d_head=8, attn_out_bias=False)
        assert BlockConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize(("changes", "window"), [
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), 8),  # every layer windowed
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), None),  # no layer reaches it
    (dict(use_sliding_window=False, sliding_window=8), None),
    (dict(sliding_window=8), None),  # Qwen2Config's default: use_sliding_window False
], ids=["all-layers", "max-window-layers", "off", "default-off"])
def test_qwen_window_from_a_transformers_4_config(changes: dict, window: int | None) -> None:
    """Files written by transformers 4 have no layer_types: derive them as transformers 5 does."""
    config = {**hf.Qwen2Config(**{**BASE, **changes}).to_dict(), **changes}
    config.pop("layer_types")
    assert llama.config_from_hf(config).sliding_window == window
    theirs = hf.Qwen2Config(**{**BASE, **changes}).layer_types  # transformers 5's own derivation
    assert (window is not None) == ("sliding_attention" in theirs)


def test_every_rope_scaling_type_has_an_implementation() -> None:
    from typing import get_args

    from models.config import RopeType
    from models.positions import SCALINGS

    assert set(SCALINGS) == set(get_args(RopeType))
