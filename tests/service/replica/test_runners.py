"""Model runners without Ray: tokenization limits, batch results equal to solo model calls, translation params."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from torch import nn

from models.beam_search import BeamParams, translate_ids
from models.catalog import LoadedModel, ModelSpec, load_model
from models.text import TextTokenizer
from models.tiny import EOS
from service.errors import InvalidItem, InvalidRequest
from service.messages import TranslateOptions
from service.replica import device
from service.replica.batcher import STOPPED
from service.replica.config import BatchLimits
from service.replica.device import resolve_device
from service.replica.encoder import EncodeItem, EncoderRunner
from service.replica.tokenize import tokenize, tokenize_pairs
from service.replica.translator import TranslateItem, TranslatorRunner

TEXTS = ["a", "hello world", "a considerably longer sentence with many more bytes in it", "mid length"]


def _load(family: str, tasks: tuple[str, ...], **extra: object) -> LoadedModel:
    spec = ModelSpec(name=f"tiny-{family}", tasks=tasks, source=f"tiny:{family}", max_input_tokens=64, **extra)
    return load_model(spec, Path("/nonexistent-cache"))


@pytest.fixture(scope="module")
def encoder() -> EncoderRunner:
    return EncoderRunner(_load("encoder", ("classify", "embed")), "encoder", BatchLimits(max_wait_ms=10))


@pytest.fixture(scope="module")
def translator() -> TranslatorRunner:
    loaded = _load("seq2seq", ("translate",), languages=("en", "es"), defaults={"beam_size": 3, "max_new_tokens": 6})
    return TranslatorRunner(loaded, "translator", BatchLimits(max_wait_ms=10))


def test_tokenize_names_the_bad_text_and_truncates_keeping_special_tokens(translator: TranslatorRunner) -> None:
    tok = translator.loaded.tokenizer
    with pytest.raises(InvalidItem) as too_long:
        tokenize(tok, ["ok", "x" * 40], limit=32, truncate=False)
    assert too_long.value.index == 1 and "41 tokens" in too_long.value.message
    with pytest.raises(InvalidItem) as broken:
        tokenize(tok, ["ok", "bad \ud800"], limit=32, truncate=False)
    assert broken.value.index == 1 and "could not be tokenized" in broken.value.message
    (cut,) = tokenize(tok, ["x" * 40], limit=32, truncate=True)
    assert len(cut) == 32 and cut[-1] == EOS and cut[:-1] == tok.encode("x" * 31)[:-1]


def test_encoder_batch_equals_each_text_alone(encoder: EncoderRunner) -> None:
    model = encoder.loaded.model
    ids = tokenize(encoder.loaded.tokenizer, TEXTS, 64, truncate=False)
    batch = encoder.run_batch([EncodeItem(x, "classify" if i % 2 == 0 else "embed") for i, x in enumerate(ids)])
    with torch.inference_mode():
        for i, x in enumerate(ids):
            alone = torch.tensor([x])
            emb = model.embed(alone)[0]
            if i % 2 == 0:
                probs = model.classify(alone)[0].softmax(-1)
                assert batch[i].scores == pytest.approx(dict(zip(model.cfg.labels, probs.tolist(), strict=True)),
                                                        abs=1e-5)
                assert batch[i].label == model.cfg.labels[int(probs.argmax())]
            else:
                torch.testing.assert_close(torch.tensor(batch[i]), emb, atol=1e-5, rtol=0)


def test_encoder_requests_through_the_batcher(encoder: EncoderRunner) -> None:
    async def main() -> tuple[list, object]:
        return await asyncio.gather(encoder.classify(TEXTS, False, 5.0), encoder.embed(TEXTS[:2], False, 5.0))

    results, embeddings = asyncio.run(main())
    assert len(results) == len(TEXTS) and len(embeddings.vectors) == 2
    assert embeddings.prompt_tokens == sum(len(t.encode()) for t in TEXTS[:2])


def test_a_long_text_is_tokenized_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts over INLINE_TOKENIZE_CHARS in all are tokenized on the process's one text thread, so a long
    one never stalls the replica's other requests (and many take turns there); short ones on the loop
    (a thread hop costs more than them)."""
    import threading

    from service.replica.runner import INLINE_TOKENIZE_CHARS

    # its own runner: a batcher belongs to the event loop it first ran on
    encoder = EncoderRunner(_load("encoder", ("classify", "embed")), "encoder", BatchLimits(max_wait_ms=10))

    tok = encoder.loaded.tokenizer
    threads: list[threading.Thread] = []
    real = tok.encode

    def encode(text: str, *args: object, **kwargs: object) -> list[int]:
        threads.append(threading.current_thread())
        return real(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode)

    async def main() -> threading.Thread:
        await encoder.embed(["short text"], True, 5.0)
        await encoder.embed(["x" * (INLINE_TOKENIZE_CHARS + 1)], True, 5.0)
        await encoder.classify(["y" * 3000, "z" * 3000], True, 5.0)  # long in all
        return threading.current_thread()

    loop_thread = asyncio.run(main())
    assert len(threads) >= 4  # (a truncated text may be encoded more than once)
    assert threads[0] is loop_thread and all(t is not loop_thread for t in threads[1:])
    assert all(t.name.startswith("texts") for t in threads[1:]) and len({t.ident for t in threads[1:]}) == 1


def test_many_short_chat_messages_are_rendered_off_the_event_loop() -> None:
    """2048 empty messages are few characters but real template work: counted by render_chars (each
    message's share of the template), they go to the text thread, not the replica's event loop."""
    from service.messages import ChatMessage, GenerationRequest
    from service.replica.runner import INLINE_TOKENIZE_CHARS

    many = GenerationRequest("m", messages=tuple(ChatMessage("user", "") for _ in range(2048)))
    one = GenerationRequest("o", messages=(ChatMessage("user", "hi"),))
    assert many.prompt_chars == 0 and many.render_chars > INLINE_TOKENIZE_CHARS >= one.render_chars


def test_translator_params_defaults_and_limits(translator: TranslatorRunner) -> None:
    assert translator.params(TranslateOptions()) == BeamParams(3, 6)
    assert translator.params(TranslateOptions(beam_size=1, max_new_tokens=2)) == BeamParams(1, 2)
    with pytest.raises(InvalidRequest) as e:
        translator.params(TranslateOptions(max_new_tokens=10_000))
    assert e.value.param == "max_new_tokens"
    assert translator.banned == [0]  # pad (= decoder start) is never generated


def test_translator_mixed_params_in_one_batch_equal_solo(translator: TranslatorRunner) -> None:
    tok, model = translator.loaded.tokenizer, translator.loaded.model
    items = [TranslateItem(tok.encode(t), BeamParams(b, n)) for t, b, n in zip(TEXTS, [1, 4, 2, 3], [5, 3, 8, 6],
                                                                               strict=True)]
    batch = translator.run_batch(items)
    for item, out in zip(items, batch, strict=True):
        assert out == tok.decode(translate_ids(model, [item.ids], item.params, banned_ids=[0])[0])


def test_info_reports_the_loaded_model(encoder: EncoderRunner) -> None:
    info = encoder.info()
    assert info.name == "tiny-encoder" and info.device == "cpu" and info.dtype == "float32"
    assert info.labels == ("negative", "neutral", "positive") and info.max_input_tokens == 64
    assert "padding_efficiency" in info.stats


def test_resolve_device() -> None:
    assert resolve_device("cpu", "auto") == ("cpu", torch.float32)
    assert resolve_device("cuda:1", "auto") == ("cuda:1", torch.bfloat16)
    assert resolve_device("cpu", "bfloat16") == ("cpu", torch.bfloat16)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto", "float32") == (expected, torch.float32)


def test_auto_bf16_is_bfloat16_on_cuda_and_on_cpus_that_multiply_it(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """auto-bf16: bfloat16 where our bfloat16 panels run (AVX512-BF16) or the CPU has AMX-BF16."""
    from models.kernels import native

    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n\nprocessor\t: 1\n")
    avx = tmp_path / "avx"
    avx.write_text("flags\t\t: fpu avx2 avx512_bf16\n")  # no AMX: the panels decide
    assert device.cpu_has_amx_bf16(str(amx)) and not device.cpu_has_amx_bf16(str(avx))
    assert not device.cpu_has_amx_bf16(str(tmp_path / "missing"))
    assert resolve_device("cuda", "auto-bf16") == ("cuda", torch.bfloat16)
    for has_amx, panels, dtype in ((True, False, torch.bfloat16), (False, True, torch.bfloat16),
                                   (False, False, torch.float32)):
        monkeypatch.setattr(device, "cpu_has_amx_bf16", lambda has=has_amx: has)
        monkeypatch.setattr(native, "has_bf16", lambda has=panels: has)
        assert resolve_device("cpu", "auto-bf16") == ("cpu", dtype)
        assert resolve_device("cpu", "auto") == ("cpu", torch.float32)  # plain auto never picks bfloat16 on cpu


def test_a_classify_model_needs_a_head() -> None:
    loaded = _load("encoder", ("classify",))
    loaded.labels = ()
    with pytest.raises(ValueError, match="no classification head"):
        EncoderRunner(loaded, "encoder", BatchLimits())


def test_an_embedding_only_encoder_warms_up_without_a_head() -> None:
    loaded = _load("encoder", ("embed",))
    loaded.labels = ()
    loaded.model.head = None
    runner = EncoderRunner(loaded, "encoder", BatchLimits())
    runner.warm_up()
    assert runner.batcher.stats.batches == 0  # warm-up runs the model directly, not through the queue


def _pair_tokenizer() -> TextTokenizer:
    """One token per letter a..p after [PAD] [UNK] [CLS] [SEP]; pairs as BERT's: [CLS] A [SEP] B [SEP]."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *"abcdefghijklmnop"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return TextTokenizer(tok)


def test_pairs_are_truncated_as_the_tokenizers_library_does() -> None:
    tok = _pair_tokenizer()
    reference = Tokenizer.from_str(tok.tok.to_str())
    words = list("abcdefghijklmnop")
    for a, b, limit in [(n, m, k) for n in range(1, 10) for m in range(1, 10) for k in (5, 6, 9, 12, 30)]:
        query, text = " ".join(words[:a]), " ".join(words[-b:])
        reference.enable_truncation(limit, strategy="longest_first")
        want = reference.encode(query, text)
        (got,) = tokenize_pairs(tok, query, [text], limit, truncate=True)
        assert (got.ids, got.types) == (want.ids, want.type_ids), (a, b, limit)


def test_pairs_over_the_limit_name_the_query_or_the_text() -> None:
    tok = _pair_tokenizer()
    (pair,) = tokenize_pairs(tok, "a b", ["c d e"], 8, truncate=False)
    assert pair.ids == [2, 4, 5, 3, 6, 7, 8, 3] and pair.types == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(InvalidItem) as text:
        tokenize_pairs(tok, "a b", ["c", "c d e f"], 8, truncate=False)
    assert text.value.index == 1 and "9 tokens" in text.value.message
    with pytest.raises(InvalidRequest) as query:
        tokenize_pairs(tok, "a b c d e", ["c"], 8, truncate=False)  # 5 + 3 special: no room for a text
    assert query.value.param == "query"


def test_a_rerank_model_needs_a_one_output_head() -> None:
    with pytest.raises(ValueError, match="rerank, which needs a classification head with one output"):
        EncoderRunner(_load("encoder", ("rerank",)), "encoder", BatchLimits())  # tiny:encoder has 3 labels


def _reranker(head_scores: str = "sigmoid") -> LoadedModel:
    """tiny:encoder with a one-output head (a cross-encoder's relevance logit) and a pair tokenizer."""
    loaded = _load("encoder", ("rerank",))
    model = loaded.model
    model.cfg = model.cfg.replace(labels=("relevance",), head_scores=head_scores)
    torch.manual_seed(0)
    model.head = nn.Linear(model.cfg.d_model, 1)
    loaded.labels, loaded.tokenizer = ("relevance",), _pair_tokenizer()
    return loaded


def test_rerank_scores_by_the_heads_own_score_function() -> None:
    loaded = _reranker()
    loaded.model.scores = lambda logits, head=None: logits.tanh()  # a scoring only the model knows: rerank must use it
    runner = EncoderRunner(loaded, "reranker", BatchLimits(max_wait_ms=10))
    texts = ["c d e", "f", "a b c d"]

    async def main() -> tuple[list[float], list[float]]:  # scored and raw pairs share batches
        return await asyncio.gather(runner.rerank("a b", texts, False, False, 5.0),
                                    runner.rerank("a b", texts, False, True, 5.0))

    scores, raw = asyncio.run(main())
    pairs = tokenize_pairs(loaded.tokenizer, "a b", texts, 64, truncate=False)
    with torch.inference_mode():
        want = [loaded.model.classify(torch.tensor([p.ids]))[0, 0].item() for p in pairs]
    assert raw == pytest.approx(want, abs=1e-5)
    assert scores == pytest.approx([math.tanh(z) for z in want], abs=1e-5)


def test_a_rerank_head_scored_by_softmax_is_refused() -> None:
    with pytest.raises(ValueError, match="scores by softmax, which is 1 for every pair"):
        EncoderRunner(_reranker("softmax"), "reranker", BatchLimits())


def test_a_multi_label_head_scores_each_label_by_its_sigmoid() -> None:
    loaded = _load("encoder", ("classify",))
    loaded.model.cfg = loaded.model.cfg.replace(head_scores="sigmoid")  # as problem_type multi_label gives
    runner = EncoderRunner(loaded, "encoder", BatchLimits())
    ids = tokenize(loaded.tokenizer, TEXTS[:2], 64, truncate=False)
    results = runner.run_batch([EncodeItem(x, "classify") for x in ids])
    with torch.inference_mode():
        for x, result in zip(ids, results, strict=True):
            probs = loaded.model.classify(torch.tensor([x]))[0].sigmoid()
            assert list(result.scores.values()) == pytest.approx(probs.tolist(), abs=1e-5)
            assert result.score == max(result.scores.values()) and sum(result.scores.values()) != pytest.approx(1.0)


def test_translator_stops_an_input_no_longer_wanted(translator: TranslatorRunner,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """run_batch asks the batcher whether each input is still wanted at every step; one that is not
    (client gone, deadline passed) is STOPPED and the others are translated as alone."""
    tok, model = translator.loaded.tokenizer, translator.loaded.model
    items = [TranslateItem(tok.encode(t), BeamParams(2, 6)) for t in TEXTS[:3]]
    monkeypatch.setattr(translator.batcher, "still_wanted", lambda payload: payload is not items[1])
    out = translator.run_batch(items)
    assert out[1] is STOPPED
    for i in (0, 2):
        assert out[i] == tok.decode(translate_ids(model, [items[i].ids], items[i].params, banned_ids=[0])[0])


def test_the_engine_runner_equals_solo_and_streams_and_keeps_its_deadline(translator: TranslatorRunner) -> None:
    """The translation engine's runner (the default scheduler): mixed requests get translate_ids' results
    alone; a stream's pieces join to the same text; past its deadline a request is a DeadlineExceeded
    and its rows are freed."""
    from service.engine.config import TranslationConfig
    from service.errors import DeadlineExceeded
    from service.messages import TextDelta, TranslateOptions, TranslationDone
    from service.replica.translator import TranslatorEngineRunner

    runner = TranslatorEngineRunner(translator.loaded, "translator", TranslationConfig(max_rows=8))
    runner.warm_up()
    runner.start()
    tok = translator.loaded.tokenizer
    try:
        async def main() -> tuple[list[list[str]], list[tuple[int, object]]]:
            outs = await asyncio.gather(*(runner.translate([t], TranslateOptions(b, n), 5.0)
                                          for t, b, n in zip(TEXTS, [1, 4, 2, 3], [5, 3, 8, 6], strict=True)))
            streamed = [item async for item in runner.translate_stream(TEXTS[:2], TranslateOptions(1, 8), 5.0)]
            return outs, streamed

        outs, streamed = asyncio.run(main())
        for (out,), t, b, n in zip(outs, TEXTS, [1, 4, 2, 3], [5, 3, 8, 6], strict=True):
            assert out == tok.decode(translate_ids(translator.loaded.model, [tok.encode(t)], BeamParams(b, n),
                                                   banned_ids=[0])[0])
        for i in range(2):
            text = "".join(e.text for k, e in streamed if k == i and isinstance(e, TextDelta))
            done = [e for k, e in streamed if k == i and isinstance(e, TranslationDone)]
            assert len(done) == 1 and done[0].text == text
        runner.engine._after_step = lambda: time.sleep(0.01)  # slow steps: 60 of them outlast the deadline
        with pytest.raises(DeadlineExceeded):
            asyncio.run(runner.translate(["a long sentence to translate"] * 2, TranslateOptions(4, 60), 0.1))
        deadline_s = time.monotonic() + 5
        while runner.engine.stats().running and time.monotonic() < deadline_s:
            time.sleep(0.01)
        assert runner.engine.stats().running == 0 and runner.engine.stats().finished.get("cancelled", 0) >= 1
    finally:
        runner.close()


def test_the_batching_runner_streams_whole_translations(translator: TranslatorRunner) -> None:
    from service.messages import TextDelta, TranslateOptions, TranslationDone

    async def main() -> tuple[list[tuple[int, object]], list[str]]:  # one loop: the batcher belongs to it
        items = [item async for item in translator.translate_stream(TEXTS[:2], TranslateOptions(2, 5), 5.0)]
        return items, await translator.translate(TEXTS[:2], TranslateOptions(2, 5), 5.0)

    items, texts = asyncio.run(main())
    assert items == [(0, TextDelta(texts[0])), (0, TranslationDone(texts[0])),
                     (1, TextDelta(texts[1])), (1, TranslationDone(texts[1]))]
