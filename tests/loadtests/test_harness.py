"""The benchmark harness's pure parts: workload shapes, generation-API discovery, stream parsing,
statistics windows, the docs markers and our service's narrowed Serve config. No servers here."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from loadtests import workload
from loadtests.loadgen import RunOutcome, Sample
from loadtests.protocol import DONE, discover_generate, parse_stream_line
from loadtests.report import BEGIN, END, compare_level, update_docs
from loadtests.summary import percentile, stats_delta, stats_for_task, summarize
from loadtests.systems.ours import serve_config


def test_percentile_matches_numpy() -> None:
    xs = sorted(random.Random(0).random() for _ in range(101))
    for q in (0, 50, 95, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_workload_is_seeded_and_skewed() -> None:
    sentences = workload.load_sentences()
    a = workload.sample_texts(sentences, 400, random.Random(1))
    assert a == workload.sample_texts(sentences, 400, random.Random(1))
    words = sorted(len(t.split()) for t in a)
    assert words[len(words) // 2] < words[int(0.97 * len(words))] / 3  # a long tail of multi-sentence texts


def test_generation_items_respect_token_ranges() -> None:
    items = workload.sample_generation(workload.load_sentences(), 200, random.Random(2))
    assert all(1 <= it.prompt_tokens <= 200 and 16 <= it.max_tokens <= 128 for it in items)
    assert min(it.prompt_tokens for it in items) < 30 < max(it.prompt_tokens for it in items)
    assert all(it.prompt_tokens == workload.words_as_tokens(it.prompt) for it in items)


def test_poisson_arrivals_increase_within_horizon() -> None:
    times = workload.poisson_arrivals(20.0, 50.0, random.Random(3))
    assert all(0 < a < b < 50.0 for a, b in zip(times, times[1:], strict=False))
    assert 800 < len(times) < 1200  # 20/s for 50 s


def _doc(props: dict[str, object], path: str = "/v1/completions", required: tuple[str, ...] = ()) -> dict:
    schema = {"properties": props, "required": list(required)}
    body = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Req"}}}}
    return {"paths": {path: {"post": {"requestBody": body}}}, "components": {"schemas": {"Req": schema}}}


def test_discover_openai_completions_with_ignore_eos() -> None:
    props = dict.fromkeys(
        ("prompt", "max_tokens", "stream", "ignore_eos", "temperature", "stream_options"), {}
    )
    api, note = discover_generate(_doc(props))
    assert api is not None and "/v1/completions" in note
    spec = api.request("hi", 20, stream=True, exact=True)
    assert spec.body == {
        "prompt": "hi",
        "max_tokens": 20,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert spec.stream and spec.exact_length and spec.asked_tokens == 20
    plain = api.request("hi", 20, stream=False, exact=False)
    assert plain.body == {"prompt": "hi", "max_tokens": 20, "temperature": 0.0} and not plain.exact_length


def test_discover_falls_back_and_reports_missing_routes() -> None:
    api, _ = discover_generate(
        _doc(dict.fromkeys(("prompt", "max_new_tokens", "min_new_tokens"), {}), path="/v1/generate")
    )
    assert api is not None and not api.can_stream
    assert api.request("x", 7, stream=True, exact=True).body == {
        "prompt": "x",
        "max_new_tokens": 7,
        "min_new_tokens": 7,
    }
    needs_model = _doc(dict.fromkeys(("prompt", "max_tokens", "model"), {}), required=("model",))
    assert discover_generate(needs_model)[0] is None
    assert discover_generate(needs_model, "m")[0].extra == {"model": "m"}
    assert discover_generate({"paths": {}})[0] is None


def test_parse_stream_line() -> None:
    assert parse_stream_line('data: {"choices": [{"text": "a"}]}') == {"choices": [{"text": "a"}]}
    assert parse_stream_line("data: [DONE]") is DONE
    assert parse_stream_line('{"text": "b"}') == {"text": "b"}  # JSON lines
    assert parse_stream_line("") is None and parse_stream_line(": keep-alive") is None


def test_summary_windows() -> None:
    samples = [
        Sample(0.5, 1.5, True),  # started in warm-up, finished in the window: throughput only
        Sample(1.2, 1.4, True),
        Sample(1.3, 2.6, True),  # finished during the drain: latency only
        Sample(1.4, 1.5, False, 503, "503: busy"),
    ]
    s = summarize(RunOutcome(samples, (1.0, 2.0), unfinished=2, wall_s=3.0), generation=False)
    assert s["completed"] == 2 and s["throughput_rps"] == pytest.approx(2.0)
    assert s["latency_ms"]["n"] == 2 and s["latency_ms"]["max"] == pytest.approx(1300.0)
    assert s["errors"] == 1 and s["error_kinds"] == {"503": 1} and s["unfinished"] == 2


def test_generation_tokens_count_when_they_reach_the_client() -> None:
    samples = [
        Sample(0.2, 1.5, True, 200, tokens=8),  # sent whole, finished in the window: all 8 count
        Sample(0.5, 2.5, True, 200, tokens=10),  # sent whole, finished in the drain: none count
        # streamed over 4 pieces, two of them inside the window: half of its 40 tokens count
        Sample(0.1, 2.8, True, 200, ttft=0.4, tokens=40, piece_times=(0.5, 1.2, 1.9, 2.8)),
        Sample(1.1, 1.3, False, 503, "503: busy", tokens=None),
    ]
    s = summarize(RunOutcome(samples, (1.0, 2.0), unfinished=0, wall_s=3.0), generation=True)
    assert s["output_tokens_per_s"] == pytest.approx(8 + 20)
    assert s["ttft_ms"]["n"] == 0  # no successful request started inside the window


def test_stats_delta_derives_batching() -> None:
    payload = {
        "data": [
            {
                "tasks": ["classify", "embed"],
                "stats": {
                    "batches": 10,
                    "items": 40,
                    "real_tokens": 90,
                    "computed_tokens": 100,
                    "largest_batch": 8,
                },
            },
            {"tasks": ["translate"], "stats": {"batches": 99}},
        ]
    }
    after = stats_for_task(payload, "classify")
    d = stats_delta({"batches": 5, "items": 10, "real_tokens": 40, "computed_tokens": 50}, after)
    assert d["mean_batch_size"] == pytest.approx(6.0) and d["padding_efficiency"] == pytest.approx(1.0)
    assert d["gauges"] == {"largest_batch": 8}


def test_stats_delta_keeps_the_generators_states_as_gauges() -> None:
    """The engine's block pool and cache sizes are states: a run that frees blocks must not show a
    negative count of them (seen as kv_blocks_free -287 in a bench run)."""
    before = {"generated_tokens": 100, "steps": 10, "kv_blocks": 2000, "kv_blocks_free": 1900,
              "cache_bytes": 5, "prefix_cache_bytes": 7}
    after = {"generated_tokens": 400, "steps": 20, "kv_blocks": 2000, "kv_blocks_free": 1600,
             "cache_bytes": 5, "prefix_cache_bytes": 9}
    d = stats_delta(before, after)
    assert d["counters"] == {"generated_tokens": 300, "steps": 10}
    assert d["gauges"] == {"kv_blocks": 2000, "kv_blocks_free": 1600, "cache_bytes": 5, "prefix_cache_bytes": 9}
    assert d["tokens_per_decode_step"] == pytest.approx(30.0)


def test_compare_level_prefers_the_wanted_one() -> None:
    assert compare_level([1, 8, 32, 64], 32) == 32
    assert compare_level([1, 8, 64], 32) == 8  # the nearest measured level
    assert compare_level([16, 48], 32) == 48  # a tie goes to the higher load


def test_update_docs_replaces_only_its_block(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    update_docs(docs, f"{BEGIN}\nfirst\n{END}\n")
    assert docs.read_text().startswith("# Benchmarks")
    docs.write_text(docs.read_text() + "\n## models\nthe lead's numbers\n")
    update_docs(docs, f"{BEGIN}\nsecond\n{END}\n")
    text = docs.read_text()
    assert (
        text.count(BEGIN) == 1 and "second" in text and "first" not in text and "the lead's numbers" in text
    )


def test_ours_config_keeps_shipped_settings_and_narrows() -> None:
    shipped = {
        "http_options": {"host": "0.0.0.0", "port": 8000},
        "applications": [
            {
                "import_path": "service.app:build_app",
                "args": {
                    "request_timeout_s": 30,
                    "deployments": {
                        "encoder": {"num_cpus": 1, "batching": {"max_batch_size": 32},
                                    "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
                        "translator": {"num_cpus": 1},
                    },
                },
            }
        ],
    }
    config = serve_config(["classify"], "tiny", 9999, 3, "cpu", 120.0, shipped)
    args = config["applications"][0]["args"]
    assert list(args["deployments"]) == ["encoder"]
    enc = args["deployments"]["encoder"]
    assert enc["batching"] == {"max_batch_size": 32} and enc["torch_threads"] == 3
    assert enc["num_replicas"] == 1 and "autoscaling_config" not in enc  # the same threads as the others
    assert enc["model"]["source"] == "tiny:encoder" and args["device"] == "cpu"
    assert args["request_timeout_s"] == 120.0 and config["http_options"] == {
        "host": "127.0.0.1",
        "port": 9999,
    }
    assert "dtype" not in args  # auto: the shipped config's own dtypes
    shipped["applications"][0]["args"]["deployments"]["encoder"]["dtype"] = "auto-bf16"
    kept = serve_config(["classify"], "default", 1, 1, "cpu", 1.0, shipped)["applications"][0]["args"]
    assert kept["deployments"]["encoder"]["dtype"] == "auto-bf16" and "dtype" not in kept
    forced = serve_config(["classify"], "default", 1, 1, "cpu", 1.0, shipped, dtype="float32")["applications"][0]
    assert forced["args"]["dtype"] == "float32" and "dtype" not in forced["args"]["deployments"]["encoder"]
    shared = serve_config(["classify", "translate"], "default", 1, 1, "auto", 1.0, shipped, gpus=1)
    assert [d["num_gpus"] for d in shared["applications"][0]["args"]["deployments"].values()] == [0.5, 0.5]
    assert (
        "model"
        not in serve_config(["classify"], "default", 1, 1, "auto", 1.0, shipped)["applications"][0]["args"][
            "deployments"
        ]["encoder"]
    )


def test_embed_requests_are_one_sentence_each_and_leave_the_other_tasks_as_they_were(tmp_path: Path) -> None:
    import dataclasses

    from loadtests.loadgen import Timing
    from loadtests.plan import Plan, build_workloads

    plan = Plan(("classify", "embed", "translate"), ("ours",), (1,), (), Timing(1, 1, 1), "tiny", 1, "cpu", 1, 7,
                "auto", 60, 60, 0, 5)
    work = build_workloads(plan, tmp_path)
    assert len(work.embed) == len(work.classify) > 0
    assert {(r.path, tuple(r.body)) for r in work.embed} == {("/v1/embeddings", ("input", "truncate"))}
    sentences = set(workload.load_sentences())
    assert all(r.body["input"] in sentences for r in work.embed)  # one sentence per request
    again = build_workloads(dataclasses.replace(plan, tasks=("classify", "translate")), tmp_path)
    assert again.classify == work.classify and again.translate == work.translate  # the same seeded requests
