"""Generation parity with `transformers`: tiny random HF models, imported into ours, decode the same tokens.

Dimension legend: B batch rows (prompts / sources of different lengths), T padded length, V vocabulary.

Decoder-only (GPT-2, Llama with GQA): our `models.generate.generate` (right-padded prefill, KV cache,
rows at their own positions) against `generate(do_sample=False)` of HF with left padding and an
attention mask, token for token over 20 new tokens. Marian: our `translate_ids` (greedy and beam
search, beam size per request) against HF `generate(num_beams=n)`, with every setting that differs
between HF's Marian defaults and ours made explicit on the HF side.

Random tiny models tend to repeat one token or end at once; the weights below are spread (and, for
Marian, the output head untied and eos nudged) so outputs are varied, and each test asserts that.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers as hf
from torch import Tensor

from models.beam_search import BeamParams, BeamSearch, translate_ids
from models.checkpoints import gpt2, llama, marian
from models.decoder import DecoderLM
from models.decoding import SamplingParams
from models.generate import generate
from models.seq2seq import Seq2Seq

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one thread is fastest


VOCAB, PAD, EOS = 100, 0, 1
N_NEW = 20
PROMPTS = [[5, 9, 13, 40, 41], [7], [20, 21, 22, 23, 24, 25, 26, 27], [60, 61, 3]]
SOURCES = [[5, 9, 13, 40, 41, EOS], [7, EOS], [20, 21, 22, 23, 24, 25, 26, 27, 28, EOS], [60, 61, 3, EOS],
           [88, 12, 12, 45, 6, 71, 33, EOS]]
MT_NEW = 12


def left_pad(prompts: list[list[int]]) -> tuple[Tensor, Tensor]:
    """ids (B, T) left-padded with PAD, attention mask (B, T) long."""
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), PAD)  # (B, T)
    mask = torch.zeros(len(prompts), t, dtype=torch.long)  # (B, T)
    for i, p in enumerate(prompts):
        ids[i, t - len(p):] = torch.tensor(p)
        mask[i, t - len(p):] = 1
    return ids, mask


def right_pad(seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), PAD)  # (B, T)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)  # (B, T)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def until(tokens: list[int], stop: int | None) -> list[int]:
    return tokens[:tokens.index(stop)] if stop is not None and stop in tokens else tokens


@torch.no_grad()
def spread(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """Add noise to every parameter so logits are far from uniform (no near-ties) and outputs vary."""
    for p in model.parameters():
        p.add_(torch.randn_like(p) * scale)
    return model.eval()


def assert_varied(outputs: list[list[int]], min_distinct: int) -> None:
    """The test is only worth something if the models say different, non-repetitive things."""
    assert len({tuple(o) for o in outputs}) == len(outputs), outputs
    assert all(len(set(o)) >= min_distinct for o in outputs), outputs


# --- decoder-only: greedy ---------------------------------------------------------------------------


def hf_greedy(ref: torch.nn.Module, prompts: list[list[int]], eos: int | None) -> list[list[int]]:
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=N_NEW,
                           pad_token_id=PAD, eos_token_id=eos, repetition_penalty=1.0)
    return [until(row, eos) for row in out[:, ids.size(1):].tolist()]


def ours_greedy(model: DecoderLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[str]]:
    out = generate(model, prompts, SamplingParams(max_new_tokens=N_NEW))
    return [g.tokens for g in out], [g.finish_reason for g in out]


@pytest.fixture(scope="module")
def gpt2_pair() -> tuple[Any, hf.GPT2LMHeadModel, DecoderLM]:
    torch.manual_seed(1)
    config = hf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=None,
                           eos_token_id=None, pad_token_id=PAD, attn_implementation="eager")
    ref = spread(hf.GPT2LMHeadModel(config), 0.5)
    return config, ref, gpt2.from_hf(config.to_dict(), ref.state_dict())


@pytest.fixture(scope="module")
def llama_pair() -> tuple[Any, hf.LlamaForCausalLM, DecoderLM]:
    torch.manual_seed(1)
    config = hf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            bos_token_id=None, eos_token_id=None, pad_token_id=PAD, attn_implementation="eager")
    ref = spread(hf.LlamaForCausalLM(config), 0.3)
    return config, ref, llama.from_hf(config.to_dict(), ref.state_dict())


@pytest.mark.parametrize("pair", ["gpt2_pair", "llama_pair"])
def test_greedy_generation_matches_transformers(pair: str, request: pytest.FixtureRequest) -> None:
    _, ref, ours = request.getfixturevalue(pair)
    assert ours.cfg.eos_token_ids == ()  # eos disabled on both sides: always N_NEW tokens
    theirs = hf_greedy(ref, PROMPTS, eos=None)
    mine, reasons = ours_greedy(ours, PROMPTS)
    assert mine == theirs
    assert reasons == ["length"] * len(PROMPTS) and all(len(t) == N_NEW for t in mine)
    assert_varied(mine, min_distinct=6)


def test_greedy_stops_at_eos_like_transformers(llama_pair) -> None:
    """With an eos that some rows produce and others do not, both stop the same rows at the same step."""
    config, ref, _ = llama_pair
    free = hf_greedy(ref, PROMPTS, eos=None)
    eos = free[0][6]  # a token row 0 produces mid-way
    stops = [eos in row for row in free]
    assert not all(stops), "pick an eos that some row never produces"
    ours = llama.from_hf({**config.to_dict(), "eos_token_id": eos}, ref.state_dict())
    theirs = hf_greedy(ref, PROMPTS, eos=eos)
    mine, reasons = ours_greedy(ours, PROMPTS)
    assert mine == theirs == [until(row, eos) for row in free]
    assert reasons == ["stop" if s else "length" for s in stops]


# --- Marian: greedy and beam search -----------------------------------------------------------------

# MarianMTModel's generation defaults differ from our translate_ids (e.g. forced_eos_token_id defaults
# to 0, i.e. pad); every setting that shapes the search is spelled out here to match ours:
# eos forced at the length limit, pad banned, no length-penalty tweaks, early_stopping=False heuristic.
HF_BEAM_SETTINGS = dict(do_sample=False, max_new_tokens=MT_NEW, early_stopping=False, length_penalty=1.0,
                        forced_eos_token_id=EOS, bad_words_ids=[[PAD]], eos_token_id=EOS, pad_token_id=PAD,
                        decoder_start_token_id=PAD, num_return_sequences=1, no_repeat_ngram_size=0,
                        repetition_penalty=1.0, min_length=0)


@pytest.fixture(scope="module")
def marian_pair() -> tuple[hf.MarianMTModel, Seq2Seq]:
    """A random Marian whose translations vary: spread weights, an untied output head (a tied head
    on random weights mostly copies the last token), sinusoidal positions untouched."""
    torch.manual_seed(11)
    config = hf.MarianConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        activation_function="swish", scale_embedding=True, tie_word_embeddings=False, pad_token_id=PAD,
        eos_token_id=EOS, decoder_start_token_id=PAD, forced_eos_token_id=EOS, attn_implementation="eager")
    ref = hf.MarianMTModel(config)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "embed_positions" in name:
                continue
            if p.dim() == 2:
                p.normal_(std=0.3 if ("shared" in name or "embed_tokens" in name or "lm_head" in name) else 0.15)
            elif "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
        # untied, transformers 5 keeps separate encoder/decoder embed_tokens: make them the one
        # token matrix (`shared`) that our Seq2Seq and the importer expect
        ref.model.encoder.embed_tokens.weight.copy_(ref.model.shared.weight)
        ref.model.decoder.embed_tokens.weight.copy_(ref.model.shared.weight)
        ref.final_logits_bias.normal_(std=0.5)
        ref.final_logits_bias[0, EOS] += 3.5  # hypotheses end before the limit: early stopping matters
    ours = marian.from_hf(config.to_dict(), ref.state_dict())
    assert ours.lm_head is not None
    return ref.eval(), ours


def hf_translate(ref: hf.MarianMTModel, sources: list[list[int]], beams: int) -> list[list[int]]:
    """HF outputs without the start token and from eos on (our translate_ids' format)."""
    ids, mask = right_pad(sources)
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, num_beams=beams, **HF_BEAM_SETTINGS)
    return [until(row[1:], EOS) for row in out.tolist()]


@pytest.fixture(scope="module")
def hf_marian(marian_pair) -> Callable[[int], list[list[int]]]:
    """HF translations of SOURCES by beam size, each computed once."""
    ref, _ = marian_pair
    done: dict[int, list[list[int]]] = {}

    def get(beams: int) -> list[list[int]]:
        if beams not in done:
            done[beams] = hf_translate(ref, SOURCES, beams)
        return done[beams]

    return get


@pytest.mark.parametrize("beams", [1, 4])
def test_marian_search_matches_transformers(marian_pair, hf_marian, beams: int) -> None:
    _, ours = marian_pair
    mine = translate_ids(ours, SOURCES, BeamParams(beam_size=beams, max_new_tokens=MT_NEW), banned_ids=(PAD,))
    assert mine == hf_marian(beams)
    assert_varied(mine, min_distinct=2)
    lengths = [len(m) for m in mine]
    assert min(lengths) < MT_NEW - 1 and max(lengths) == MT_NEW - 1  # some end on eos, some at the limit


def test_marian_beam_sizes_per_request_match_transformers(marian_pair, hf_marian) -> None:
    """One batch with a different beam size per source equals HF run once per beam size."""
    _, ours = marian_pair
    sizes = [4, 1, 2, 4, 1]
    params = [BeamParams(beam_size=n, max_new_tokens=MT_NEW) for n in sizes]
    mine = translate_ids(ours, SOURCES, params, banned_ids=(PAD,))
    assert mine == [hf_marian(n)[i] for i, n in enumerate(sizes)]
    assert hf_marian(1) != hf_marian(4)  # beam search really searches here


def test_a_cancelled_source_leaves_the_search_and_the_others_are_unchanged(marian_pair, hf_marian) -> None:
    """cancelled(i) drops source i's beams from the next step on: its result is None, its rows stop being
    decoded, and every other source's result is what it is without it (and what transformers gives)."""
    _, ours = marian_pair
    asked: list[int] = []

    def cancelled(i: int) -> bool:
        asked.append(i)
        return i == 1 and asked.count(1) >= 3  # source 1 is cancelled at its third step

    params = BeamParams(beam_size=4, max_new_tokens=MT_NEW)
    mine = translate_ids(ours, SOURCES, params, banned_ids=(PAD,), cancelled=cancelled)
    expected = hf_marian(4)
    assert mine[1] is None
    assert [m for i, m in enumerate(mine) if i != 1] == [e for i, e in enumerate(expected) if i != 1]
    assert asked.count(1) == 3  # never asked again: its rows left the batch
    assert max(asked.count(i) for i in range(len(SOURCES)) if i != 1) > 3


def test_sources_joining_a_running_search_match_transformers(marian_pair, hf_marian) -> None:
    """Continuous batching for the encoder-decoder: sources added to a BeamSearch at different steps,
    with different beam sizes, each get what transformers gives them alone; their rows go to the next
    sources once they end, and a search never takes more beams than it has rows."""
    _, ours = marian_pair
    sizes = [4, 1, 2, 4, 1]
    search = BeamSearch(ours, rows=8, max_new_tokens=MT_NEW, banned_ids=(PAD,))
    results: dict[int, list[int] | None] = {}
    waiting = list(range(len(SOURCES)))
    joined_late = 0
    while waiting or search:
        while waiting and sizes[waiting[0]] <= search.free:
            i = waiting.pop(0)
            joined_late += bool(search)
            search.add([SOURCES[i]], [BeamParams(sizes[i], MT_NEW)], keys=[i])
        for event in search.step():
            if event.done:
                results[event.key] = event.ids
        assert search.busy_rows <= 8
    assert joined_late >= 2  # some sources really joined a search in progress
    assert [results[i] for i in range(len(SOURCES))] == [hf_marian(n)[i] for i, n in enumerate(sizes)]
    with pytest.raises(ValueError, match="free rows"):
        BeamSearch(ours, rows=2, max_new_tokens=MT_NEW).add([SOURCES[0]], [BeamParams(4, MT_NEW)], keys=[0])


def test_a_greedy_source_streams_its_tokens(marian_pair, hf_marian) -> None:
    """A beam-1 source reports every token as it is chosen; they add up to its result."""
    _, ours = marian_pair
    search = BeamSearch(ours, rows=4, max_new_tokens=MT_NEW, banned_ids=(PAD,))
    search.add(SOURCES[:2], [BeamParams(1, MT_NEW), BeamParams(3, MT_NEW)], keys=["greedy", "beam"])
    streamed, done = [], {}
    while search:
        for event in search.step():
            assert event.key == "greedy" or event.token is None
            if event.token is not None:
                streamed.append(event.token)
            if event.done:
                done[event.key] = event.ids
    assert done["greedy"] == hf_marian(1)[0] and streamed[:len(done["greedy"])] == done["greedy"]
    assert done["beam"] == hf_marian(3)[1]
