"""Multi-turn chats over two generator replicas: prefix-aware routing against power of two, one run.

    python -m loadtests.fleet.affinity            # = make bench-fleet
    python -m loadtests.fleet.affinity --chats 8 --turns 4 --tenants 4    # quicker

A local Ray + Serve (on this machine's CPUs) serves the shipped generator (deploy/serve_config.yaml's
model and engine settings) on `--replicas` replicas of one CPU and one torch thread each; for each
routing policy the app is deployed afresh (empty prefix caches) and `--chats` conversations run at
once, `--turns` turns each: a tenant's system prompt of about `--system-tokens` tokens (each tenant
its own), then the growing history (greedy answers of `--answer-tokens`; past the model's context, the
oldest turns dropped, as chat apps do: counted under the table). Each request streams; the
table has the prefix hit rate (cached prompt tokens / prompt tokens from /metrics), time to first
token p50 / p95, the routing decisions, and the whole run's time. Requests are the same for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOPICS = ["billing", "shipping", "returns", "accounts", "warranty", "security", "payments", "hardware"]


def system_prompt(tenant: int, tokens: int) -> str:
    """About `tokens` tokens of a tenant's own instructions (~4 characters a token)."""
    topic = TOPICS[tenant % len(TOPICS)]
    rule = (f"You are the {topic} assistant of tenant {tenant}. Answer questions about {topic} briefly, "
            f"politely and only with facts from the {topic} handbook; never invent order numbers. ")
    return (rule * (tokens * 4 // len(rule) + 1))[:tokens * 4]


def app_args(policy: str, replicas: int, autoscaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The shipped generator's settings on one-CPU replicas routed by `policy`: `replicas` of them, or
    with `autoscaling` the shipped autoscaling config with those keys changed."""
    config = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    args = config["applications"][0]["args"]
    gen = args["deployments"]["generator"]
    shipped = gen.pop("autoscaling_config")
    gen.update(num_cpus=1, torch_threads=1, routing={"policy": policy})
    if autoscaling is None:
        gen["num_replicas"] = replicas
    else:
        gen["autoscaling_config"] = {**shipped, **autoscaling}
    return {**args, "deployments": {"generator": gen}, "log_json": False}


QUESTION_TOKENS = 32  # a turn's question with its template tokens, at most (the window's margin)


@dataclass
class Window:
    """A chat's history kept within the model's context, as chat apps keep theirs: the system prompt,
    then the newest turns; the oldest question and answer go first. `costs` holds each kept turn's
    tokens (its question's margin plus its answer's count); `prompt` the last request's prompt tokens."""

    context: int  # the model's prompt + output tokens per request (/tokenize's max_model_len)
    answer_tokens: int
    costs: list[int] = field(default_factory=list)
    prompt: int = 0
    dropped: int = 0

    def answered(self, prompt_tokens: int, answer_tokens: int) -> None:
        self.prompt = prompt_tokens
        self.costs.append(QUESTION_TOKENS + answer_tokens)

    def trim(self, history: list[dict[str, str]]) -> None:
        """Drop the oldest turns of `history` (system, user, assistant, ..., the new user message) until
        the next request's prompt and answer fit."""
        need = self.prompt + (self.costs[-1] if self.costs else 0) + self.answer_tokens
        while self.costs and need > self.context and len(history) > 3:
            del history[1:3]
            need -= self.costs.pop(0)
            self.dropped += 1


async def chat(client: httpx.AsyncClient, system: str, chat_id: int, turns: int, window: Window,
               ttfts: list[float]) -> None:
    history = [{"role": "system", "content": system}]
    for turn in range(turns):
        history.append({"role": "user", "content": f"Chat {chat_id}, question {turn}: what should I do next?"})
        window.trim(history)
        started, first, text, usage = time.perf_counter(), None, [], None
        async with client.stream("POST", "/v1/chat/completions", json={
                "messages": history, "max_tokens": window.answer_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code}: {(await r.aread())!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                delta = chunk["choices"]
                if delta and delta[0]["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(delta[0]["delta"]["content"])
        ttfts.append((first or time.perf_counter()) - started)
        history.append({"role": "assistant", "content": "".join(text)})
        if usage is None:
            raise RuntimeError("the stream ended without its usage chunk")
        window.answered(usage["prompt_tokens"], usage["completion_tokens"])


def counters(url: str) -> dict[str, float]:
    """Prompt and cached prompt tokens (in all, and per replica: `prompt@<replica>`) and routing
    decisions (`routed_<decision>`) so far, from /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        m = re.match(r"transformer_serve_(generation_prompt_tokens_total|generation_prompt_cached_tokens_total|"
                     r"routing_decisions_total)\{(.*)\} (\S+)$", line)
        if not m:
            continue
        value = float(m.group(3))
        decision, replica = re.search(r'decision="(\w+)"', m.group(2)), re.search(r'replica="(\w*)"', m.group(2))
        if decision:
            out[f"routed_{decision.group(1)}"] = out.get(f"routed_{decision.group(1)}", 0.0) + value
            continue
        kind = "cached" if "cached" in m.group(1) else "prompt"
        out[kind] = out.get(kind, 0.0) + value
        if replica:
            out[f"{kind}@{replica.group(1)}"] = out.get(f"{kind}@{replica.group(1)}", 0.0) + value
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_chats(url: str, args: argparse.Namespace, context: int) -> tuple[list[float], float, int]:
    """Every chat at once: times to first token, the run's seconds, and the turns dropped to fit."""
    ttfts: list[float] = []
    windows = [Window(context, args.answer_tokens) for _ in range(args.chats)]
    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(chat(client, system_prompt(i % args.tenants, args.system_tokens), i, args.turns,
                                    windows[i], ttfts) for i in range(args.chats)))
    return ttfts, time.perf_counter() - started, sum(w.dropped for w in windows)


def measure(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    from service.testing.cluster import deploy, local_cluster, wait_for

    with local_cluster(num_cpus=args.replicas + 1) as url:
        deploy(app_args(policy, args.replicas), name="fleet")
        wait_for(url, "/readyz", 200, timeout_s=600)
        context = httpx.post(f"{url}/tokenize", json={"prompt": "a"}, timeout=60).json()["max_model_len"]
        before = counters(url)
        ttfts, seconds, dropped = asyncio.run(run_chats(url, args, context))
        after = counters(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    replicas = sorted(k.removeprefix("prompt@") for k in delta if k.startswith("prompt@") and delta[k])
    return {"policy": policy, "hit_rate": delta.get("cached", 0.0) / max(delta.get("prompt", 0.0), 1),
            "ttft_p50": percentile(ttfts, 0.5), "ttft_p95": percentile(ttfts, 0.95), "seconds": seconds,
            "requests": len(ttfts), "dropped": dropped,
            "routed": {k.removeprefix("routed_"): int(v) for k, v in delta.items() if k.startswith("routed_") and v},
            "replicas": [(delta[f"prompt@{r}"] / max(delta.get("prompt", 0.0), 1),
                          delta.get(f"cached@{r}", 0.0) / delta[f"prompt@{r}"]) for r in replicas]}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| routing | prefix hit rate | per replica: share of prompt tokens, hit rate | TTFT p50 / p95 (s) "
             "| run (s) | requests | decisions |", "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        decided = ", ".join(f"{k} {v}" for k, v in sorted(r["routed"].items())) or "-"
        per = "; ".join(f"{share:.2f}, {hit:.2f}" for share, hit in r["replicas"])
        lines.append(f"| {r['policy']} | {r['hit_rate']:.2f} | {per} | {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} | "
                     f"{r['seconds']:.1f} | {r['requests']} | {decided} |")
    dropped = {r["policy"]: r["dropped"] for r in rows if r.get("dropped")}
    if dropped:
        lines.append("\nOldest turns dropped to fit the context: "
                     + ", ".join(f"{policy} {n}" for policy, n in dropped.items()))
    if len(rows) == 2 and rows[0]["ttft_p50"] > 0:
        lines.append(f"\nTTFT p50 power_of_two / prefix: {rows[1]['ttft_p50'] / rows[0]['ttft_p50']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtests.fleet.affinity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--chats", type=int, default=16)
    p.add_argument("--tenants", type=int, default=8, help="distinct system prompts (chats share them in turn)")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=400)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--policies", default="prefix,power_of_two")
    args = p.parse_args(argv)
    rows = [measure(policy, args) for policy in args.policies.split(",")]
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
