"""The speculative-decoding benchmark's inputs and arithmetic (loadtests/models/speculative.py): the
prompt files in the repository, and its figures (decode tok/s, outputs equal to plain)."""

from __future__ import annotations

from loadtests.models.speculative import WORKLOADS, figures, load_workloads


def test_each_workload_has_eight_chat_prompts() -> None:
    loaded = load_workloads(list(WORKLOADS), 8)
    for name, prompts in loaded.items():
        assert len(prompts) == 8, name
        for p in prompts:
            assert p["messages"] and p["messages"][-1]["role"] == "user" and p["messages"][-1]["content"]
    assert {p["task"] for p in loaded["grounded"]} == {"rewrite", "extract", "summarise"}
    assert min(len(p["messages"][-1]["content"]) for p in loaded["grounded"]) > 1000  # a passage of ~300 tokens


def test_figures_count_decode_time_after_the_first_token_and_equal_outputs() -> None:
    plain = [{"tokens": [1, 2, 3, 4, 5], "wall_s": 1.0, "ttft_s": 0.2}, {"tokens": [7, 8], "wall_s": 0.5, "ttft_s": 0.1}]
    fast = [{"tokens": [1, 2, 3, 4, 5], "wall_s": 0.6, "ttft_s": 0.2}, {"tokens": [7, 9], "wall_s": 0.3, "ttft_s": 0.1}]
    f = figures(fast, plain)
    assert f["tokens"] == 7 and f["same"] == 1 and f["n"] == 2
    assert abs(f["decode_tok_s"] - 5 / 0.6) < 1e-9  # (4 + 1) tokens after the first in (0.4 + 0.2) s
    assert abs(f["tok_s"] - 7 / 0.9) < 1e-9
    assert figures(plain, None)["same"] is None


def test_a_drafting_modes_opted_out_requests_give_its_ratio_in_the_table() -> None:
    """Ours in a drafting mode: its requests opted out of drafting in the same process are summarised
    beside it (decode tok/s, outputs equal to the drafting run's) and give the ratio the table quotes."""
    from loadtests.models.speculative import markdown, summarise

    runs = [{"tokens": [1, 2, 3, 4, 5], "wall_s": 0.6, "ttft_s": 0.2}]
    out = [{"tokens": [1, 2, 3, 4, 5], "wall_s": 1.0, "ttft_s": 0.2}]
    plain = [{"tokens": [1, 2, 3, 4, 5], "wall_s": 0.9, "ttft_s": 0.1}]
    result = {"date": "now", "machine": {}, "workloads": ["grounded"], "max_new_tokens": 8, "threads": 2,
              "ngram_k": 8, "draft_k": 8, "modes": ["q4_1", "q4_1 + ngram"], "skipped": ["llama.cpp"],
              "ours": {"q4_1": {"runs": {"grounded": plain}},
                       "q4_1 + ngram": {"runs": {"grounded": runs}, "opted_out": {"grounded": out},
                                        "counts": {"grounded": {"steps": 3, "spec_accepted": 2,
                                                                "spec_drafted": 3}}}},
              "llama.cpp": {}}
    f = summarise(result)["ours"]["grounded"]["q4_1 + ngram"]
    assert f["opted_out"]["same"] == 1 and abs(f["opted_out"]["decode_tok_s"] - 4 / 0.8) < 1e-9
    row = next(line for line in markdown(result).splitlines() if line.startswith("| grounded | q4_1 + ngram"))
    assert "| 5.0 (1/1) | 2.00x |" in row  # 4 / 0.4 s against 4 / 0.8 s
