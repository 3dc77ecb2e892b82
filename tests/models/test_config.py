"""Config validation (messages name the problem), presets, and the to_dict / from_dict round trip."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from models.config import (
    CONFIGS,
    PRESETS,
    BlockConfig,
    ConfigError,
    DecoderConfig,
    EncoderConfig,
    RopeScaling,
    Seq2SeqConfig,
)
from models.positions import relative_bucket

BAD_CONFIGS = {
    "heads-divide-width": (DecoderConfig, dict(d_model=30, n_heads=4),
                           "d_model (30) must be divisible by n_heads (4)"),
    "kv-heads-divide-heads": (DecoderConfig, dict(n_heads=4, n_kv_heads=3),
                              "n_heads (4) must be a multiple of n_kv_heads (3)"),
    "zero-kv-heads": (DecoderConfig, dict(n_kv_heads=0), "must be a multiple of n_kv_heads (0)"),
    "activation": (DecoderConfig, dict(activation="tanh"), "activation must be one of"),
    "norm": (EncoderConfig, dict(norm="batchnorm"), "norm must be one of"),
    "position": (Seq2SeqConfig, dict(position="alibi"), "position must be one of"),
    "pad-too-big": (DecoderConfig, dict(vocab_size=100, pad_token_id=100),
                    "pad_token_id 100 is outside the vocabulary (size 100)"),
    "pad-negative": (EncoderConfig, dict(pad_token_id=-1), "pad_token_id -1 is outside the vocabulary"),
    "rotary-odd-head-dim": (DecoderConfig, dict(d_model=12, n_heads=4, position="rotary"),
                            "rotary positions need an even head dim, got 3"),
    "rotary-encoder": (EncoderConfig, dict(position="rotary"), "rotary positions are only supported in decoders"),
    "rotary-seq2seq": (Seq2SeqConfig, dict(position="rotary"), "rotary positions are not supported"),
    "zero-layers": (DecoderConfig, dict(n_layers=0), "n_layers must be a positive integer, got 0"),
    "float-width": (DecoderConfig, dict(d_model=64.0), "d_model must be a positive integer"),
    "dropout": (DecoderConfig, dict(dropout=1.0), "dropout must be in [0, 1), got 1.0"),
    "norm-eps": (DecoderConfig, dict(norm_eps=0.0), "norm_eps must be positive"),
    "pooling": (EncoderConfig, dict(pooling="max"), "pooling must be 'mean' or 'cls', got 'max'"),
    "labels": (EncoderConfig, dict(labels=("a", "b", "a")), "duplicate labels"),
    "seq2seq-eos": (Seq2SeqConfig, dict(vocab_size=50, eos_token_id=50), "eos_token_id 50 is outside"),
    "seq2seq-start": (Seq2SeqConfig, dict(vocab_size=50, decoder_start_token_id=-1),
                      "decoder_start_token_id -1 is outside"),
    # relative_bucket would divide by zero (2 buckets) or take the log of a ratio <= 1 (max distance)
    "relative-two-buckets": (Seq2SeqConfig, dict(position="relative", relative_buckets=2, relative_max_distance=8),
                             "relative_buckets must be an integer >= 4, got 2"),
    "relative-float-buckets": (EncoderConfig, dict(position="relative", relative_buckets=8.0),
                               "relative_buckets must be an integer >= 4, got 8.0"),
    "relative-distance-within-exact": (Seq2SeqConfig, dict(position="relative", relative_buckets=8,
                                                           relative_max_distance=4),
                                       "relative_max_distance must be an integer > relative_buckets // 2 "
                                       "(8 // 2 = 4), got 4"),
    "bool-head-dim": (DecoderConfig, dict(d_head=True), "d_head must be a positive integer or None, got True"),
    "bool-layers": (DecoderConfig, dict(n_layers=True), "n_layers must be a positive integer, got True"),
    "dynamic-rope-head-dim-2": (DecoderConfig, dict(d_model=8, n_heads=4, position="rotary",
                                                    rope_scaling=RopeScaling("dynamic", 2.0, 16)),
                                "rope_scaling.type 'dynamic' needs head_dim > 2, got 2"),
    "freq-factors-count": (DecoderConfig, dict(d_model=16, n_heads=2, position="rotary",
                                               rope_scaling=RopeScaling("frequencies", 1.0, freq_factors=(1.0, 2.0))),
                           "needs one factor per rotary frequency (4), got 2"),
    "rope-scaling-dict": (DecoderConfig, dict(position="rotary", rope_scaling={"type": "linear", "factor": 2.0}),
                          "rope_scaling must be a RopeScaling or None, got {'type': 'linear', 'factor': 2.0}"),
    # only the causal stack reads the window: an encoder (or seq2seq's encoder) would ignore it
    "encoder-window": (EncoderConfig, dict(sliding_window=4), "sliding_window is only supported in decoders, got 4"),
    "seq2seq-window": (Seq2SeqConfig, dict(sliding_window=4), "sliding_window is only supported in decoders, got 4"),
    # tuples, as every tuple field: from_dict converts JSON's lists, direct construction does not
    "prefixes-as-lists": (Seq2SeqConfig, dict(translation_prefixes=[["en", "de", "x: "]]),
                          "translation_prefixes must be (source, target, prefix) string triples, got [["),
}

BAD_ROPE_SCALINGS = {
    "factor-string": (dict(type="linear", factor="2"), "factor must be a positive number, got '2'"),
    "factor-zero": (dict(type="linear", factor=0.0), "factor must be a positive number, got 0.0"),
    "frequencies-negative": (dict(type="frequencies", factor=1.0, freq_factors=(1.0, -2.0)),
                             "needs a tuple of positive freq_factors, got (1.0, -2.0)"),
    "yarn-bool-context": (dict(type="yarn", factor=4.0, original_max_positions=True),
                          "type 'yarn' needs original_max_positions, got True"),
    "llama3-ramp": (dict(type="llama3", factor=8.0, original_max_positions=64, low_freq_factor=4.0,
                         high_freq_factor=1.0),
                    "needs high_freq_factor > low_freq_factor, got high_freq_factor=1.0, low_freq_factor=4.0"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_names_the_problem(case: str) -> None:
    cls, fields, message = BAD_CONFIGS[case]
    with pytest.raises(ConfigError) as info:
        cls(**fields)
    assert message in str(info.value)
    assert str(info.value).startswith(cls.__name__)  # and names the config class
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("case", sorted(BAD_ROPE_SCALINGS))
def test_bad_rope_scaling_shows_the_value(case: str) -> None:
    fields, message = BAD_ROPE_SCALINGS[case]
    with pytest.raises(ConfigError) as info:
        RopeScaling(**fields)
    assert message in str(info.value) and str(info.value).startswith("RopeScaling: ")


@pytest.mark.parametrize(("buckets", "max_distance"), [(4, 3), (5, 3), (8, 5), (32, 128)])
def test_smallest_valid_relative_buckets_stay_in_the_table(buckets: int, max_distance: int) -> None:
    """The validation's bounds are tight: at them, every distance maps into the bias table."""
    Seq2SeqConfig(position="relative", relative_buckets=buckets, relative_max_distance=max_distance)
    relative = torch.arange(-3 * max_distance, 3 * max_distance + 1)  # (R,)
    for bidirectional in (True, False):
        got = relative_bucket(relative, bidirectional, buckets, max_distance)  # (R,)
        assert int(got.min()) >= 0 and int(got.max()) < buckets, (bidirectional, got.tolist())


def test_replace_validates_too() -> None:
    with pytest.raises(ConfigError, match="divisible by n_heads"):
        PRESETS["tiny-gpt"].replace(n_heads=3)


def test_configs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        PRESETS["tiny-gpt"].d_model = 32  # type: ignore[misc]


def test_derived_sizes() -> None:
    llama = PRESETS["tiny-llama"]
    assert (llama.kv_heads, llama.head_dim) == (2, 4)
    gpt = PRESETS["tiny-gpt"]
    assert gpt.kv_heads == gpt.n_heads  # None means plain multi-head
    s2s = Seq2SeqConfig(n_layers=3)
    assert s2s.n_decoder_layers == 3 and s2s.replace(decoder_layers=1).n_decoder_layers == 1


def test_presets_cover_every_family() -> None:
    assert {cfg.family for cfg in PRESETS.values()} == set(CONFIGS)
    for name, cfg in PRESETS.items():
        assert isinstance(cfg, CONFIGS[cfg.family]), name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_dict_round_trip(name: str) -> None:
    cfg = PRESETS[name]
    data = cfg.to_dict()
    assert data["family"] == cfg.family
    again = BlockConfig.from_dict(data)
    assert type(again) is type(cfg) and again == cfg
    assert CONFIGS[cfg.family].from_dict(data) == cfg  # from the family's own class too
    assert data == cfg.to_dict()  # from_dict does not consume its argument


def test_round_trip_keeps_non_default_fields() -> None:
    cfg = EncoderConfig(labels=("neg", "pos"), pooling="cls", n_kv_heads=2, pad_token_id=3)
    assert BlockConfig.from_dict(cfg.to_dict()) == cfg


# configs whose tuples nest (prefix triples, a RopeScaling's freq_factors): JSON gives them back as lists
NESTED_TUPLES = {
    **PRESETS,
    "t5-prefixes": PRESETS["tiny-t5"].replace(translation_prefixes=(("en", "de", "translate English to German: "),
                                                                    ("en", "fr", "translate English to French: "))),
    "llama-frequencies": PRESETS["tiny-llama"].replace(
        rope_scaling=RopeScaling("frequencies", 1.0, freq_factors=(1.0, 4.0))),
    "encoder-labels": EncoderConfig(labels=("neg", "pos"), head_pooling="cls", head_dense="tanh"),
}


@pytest.mark.parametrize("name", sorted(NESTED_TUPLES))
def test_json_round_trip(name: str) -> None:
    cfg = NESTED_TUPLES[name]
    again = BlockConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and hash(again) == hash(cfg)  # tuples all the way down: still hashable


@pytest.mark.parametrize(("rope", "named"), [
    ({"type": "linear", "factor": 2.0, "alpha": 1.0}, r"unknown fields \['rope_scaling\.alpha'\]"),
    ({"factor": 2.0}, r"missing fields \['rope_scaling\.type'\]"),
    ({}, r"missing fields \['rope_scaling\.type', 'rope_scaling\.factor'\]"),
])
def test_a_bad_rope_scaling_dict_names_its_field(rope: dict, named: str) -> None:
    data = {**PRESETS["tiny-llama"].to_dict(), "rope_scaling": rope}
    with pytest.raises(ConfigError, match=f"^DecoderConfig: {named}"):
        BlockConfig.from_dict(data)


def test_a_rope_scaling_dict_loads_as_its_dataclass() -> None:
    data = {**PRESETS["tiny-llama"].to_dict(), "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                "original_max_positions": 16}}
    assert BlockConfig.from_dict(data).rope_scaling == RopeScaling("yarn", 4.0, 16)


def test_unknown_field_is_named() -> None:
    data = {**PRESETS["tiny-gpt"].to_dict(), "n_experts": 8, "alibi": True}
    with pytest.raises(ConfigError, match=r"DecoderConfig: unknown fields \['alibi', 'n_experts'\]"):
        BlockConfig.from_dict(data)


def test_field_of_another_family_is_unknown() -> None:
    data = {**PRESETS["tiny-gpt"].to_dict(), "pooling": "mean"}  # an encoder-only field
    with pytest.raises(ConfigError, match=r"unknown fields \['pooling'\]"):
        BlockConfig.from_dict(data)


def test_unknown_family_is_named() -> None:
    data = {**PRESETS["tiny-gpt"].to_dict(), "family": "mamba"}
    with pytest.raises(ConfigError, match=r"unknown model family 'mamba'; known: \['decoder', 'encoder', "):
        BlockConfig.from_dict(data)


def test_invalid_values_fail_on_load_too() -> None:
    data = {**PRESETS["tiny-llama"].to_dict(), "n_kv_heads": 3}
    with pytest.raises(ConfigError, match="multiple of n_kv_heads"):
        BlockConfig.from_dict(data)
