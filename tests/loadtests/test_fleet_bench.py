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


def test_the_table_compares_the_two_policies() -> None:
    row = {"hit_rate": 0.8, "ttft_p50": 0.3, "ttft_p95": 1.0, "seconds": 20.0, "requests": 128,
           "replicas": [(0.5, 0.8), (0.5, 0.8)]}
    text = affinity.table([{**row, "policy": "prefix", "routed": {"prefix": 112, "new": 16}},
                           {**row, "policy": "power_of_two", "ttft_p50": 0.45, "routed": {}}])
    assert "| prefix | 0.80 | 0.50, 0.80; 0.50, 0.80 | 0.30 / 1.00 |" in text
    assert "new 16, prefix 112" in text and "1.50x" in text
