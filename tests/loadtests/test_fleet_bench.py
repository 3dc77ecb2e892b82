"""make bench-fleet's pieces that need no cluster: the workload, the app it deploys, the table."""

from __future__ import annotations

from loadtests.fleet import affinity
from service.settings import Settings


def test_each_tenant_has_its_own_system_prompt_of_about_the_asked_tokens() -> None:
    a, b = affinity.system_prompt(0, 400), affinity.system_prompt(1, 400)
    assert a != b and len(a) == len(b) == 1600 and affinity.system_prompt(0, 400) == a


def test_the_app_is_the_shipped_generator_on_fixed_replicas_with_the_policy_asked() -> None:
    for policy in ("prefix", "power_of_two"):
        s = Settings.build(affinity.app_args(policy, 2), env={})
        (name, gen), = s.deployments.items()
        assert name == "generator" and gen.num_replicas == 2 and gen.autoscaling_config is None
        assert gen.routing_policy().policy == policy and gen.threads() == 1
        assert gen.model is not None and gen.model.quantize == "q4_1"  # the shipped model settings


def test_a_chat_past_the_context_drops_its_oldest_turns_first() -> None:
    window = affinity.Window(context=200, answer_tokens=20)
    history = [{"role": "system", "content": "s"}]
    for turn in range(6):  # each request's prompt: 60 system tokens and 40 a kept turn
        history.append({"role": "user", "content": f"q{turn}"})
        window.trim(history)
        kept = (len(history) - 2) // 2
        assert 60 + 40 * kept + window.answer_tokens <= window.context or kept == 0
        history.append({"role": "assistant", "content": f"a{turn}"})
        window.answered(60 + 40 * kept + 8, 20)  # its prompt (the new question 8 tokens), its answer
    assert [m["content"] for m in history] == ["s", "q3", "a3", "q4", "a4", "q5", "a5"]
    assert window.dropped == 3 and len(window.costs) == 3
    roomy = affinity.Window(context=10_000, answer_tokens=20)
    short = [{"role": "system", "content": "s"}, {"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"},
             {"role": "user", "content": "q1"}]
    roomy.answered(100, 20)
    roomy.trim(short)
    assert len(short) == 4 and roomy.dropped == 0


def test_the_table_compares_the_two_policies() -> None:
    row = {"hit_rate": 0.8, "ttft_p50": 0.3, "ttft_p95": 1.0, "seconds": 20.0, "requests": 128,
           "replicas": [(0.5, 0.8), (0.5, 0.8)]}
    text = affinity.table([{**row, "policy": "prefix", "routed": {"prefix": 112, "new": 16}},
                           {**row, "policy": "power_of_two", "ttft_p50": 0.45, "routed": {}}])
    assert "| prefix | 0.80 | 0.50, 0.80; 0.50, 0.80 | 0.30 / 1.00 |" in text
    assert "new 16, prefix 112" in text and "1.50x" in text and "dropped" not in text
    text = affinity.table([{**row, "policy": "prefix", "routed": {}, "dropped": 5}])
    assert "Oldest turns dropped to fit the context: prefix 5" in text


def test_the_scaling_run_deploys_the_shipped_autoscaling_and_counts_what_failed() -> None:
    import argparse

    from loadtests.fleet import scaling

    args = argparse.Namespace(low=4, high=48, downscale_delay=30.0)
    gen = Settings.build(scaling.app(args, 0), env={}).deployments["generator"]
    assert gen.autoscaling_config is not None and gen.autoscaling_config["downscale_delay_s"] == 30.0
    assert gen.autoscaling_config["policy"]["policy_function"] == "service.fleet.autoscaling:LoadPolicy"
    assert scaling.app(args, 1)["retry_after_s"] != scaling.app(args, 0)["retry_after_s"]  # a new version
    outcomes = [scaling.Outcome("step", 200, 64, True), scaling.Outcome("step", 504, 0, False),
                scaling.Outcome("step", 200, 10, False)]
    report = {"outcomes": outcomes, "seconds": {"step": 2.0}, "asked_s": 16.0, "running_s": 60.0,
              "update_s": 100.0, "down_s": None}
    text = scaling.table(report, args)
    assert "| step | 48 | 3 | 1 | 1 | 1 | 37.0 |" in text
    assert "asked for after 16.0 s" in text and "one replica again never" in text
