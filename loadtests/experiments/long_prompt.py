"""What a long prompt costs the streams a server is already decoding, over HTTP, for ours and its peers.

    python -m loadtests.experiments.long_prompt --systems ours,vllm_cpu --streams 16 --prompt-tokens 2000 --every 3

For each system (started on 127.0.0.1 as bench-serve starts it: loadtests.systems, `--threads` per
model, the same generation route discovery), `--streams` clients each keep one streamed greedy
completion running (a short prompt, `--stream-tokens` tokens with EOS ignored; the next as soon as one
ends). For `--seconds` they decode alone (baseline); then, for `--seconds` more, a prompt of
`--prompt-tokens` tokens (English text, counted with the generator's tokenizer) asking for one token
arrives every `--every` seconds. Prints, per system, the streams' inter-token gaps (between streamed
pieces) p50 / p95 / max in both phases, the rise of p95, and the long prompts' time to first token.
In-process, without HTTP, loadtests.experiments.prefill_stall measures our engine alone per prefill_chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

from .. import workload
from ..loadgen import Sample, http_client, send
from ..protocol import GenerateAPI, discover_generate
from .engine_models import percentile
from .prefill_stall import inter_token

log = logging.getLogger("loadtests.experiments.long_prompt")
ROOT = Path(__file__).resolve().parents[2]


def gaps(streams: list[list[float]], start: float, stop: float) -> list[float]:
    """Gaps between consecutive pieces of each stream whose later piece arrived in [start, stop)."""
    return [gap for times in streams for gap in inter_token(tuple(times), start, stop)]


def long_text(tokens: int, count, rng: random.Random) -> str:  # noqa: ANN001
    sentences = workload.load_sentences()
    text = ""
    while count(text) < tokens:
        text += " " + workload.sample_texts(sentences, 1, rng)[0]
    return workload.fit_prompt(text.strip(), tokens, count)


async def measure(url: str, api: GenerateAPI, args: argparse.Namespace, prompts: list[str],
                  long_prompts: list[str]) -> dict[str, Any]:
    streams: list[list[float]] = []  # each stream request's piece arrival times
    failed: list[int] = []
    longs: list[Sample] = []
    stop = 2 * args.seconds + args.settle
    async with http_client(url, args.streams + 16, 600.0) as client:
        t0 = time.perf_counter()

        async def stream_client(k: int) -> None:
            while time.perf_counter() - t0 < stop:
                spec = api.request(prompts[k % len(prompts)], args.stream_tokens, stream=True, exact=True)
                times: list[float] = []  # kept as they arrive: a stream cut off at the end still counts
                streams.append(times)
                if not (await send(client, spec, t0, pieces=times)).ok:
                    failed.append(k)

        clients = [asyncio.create_task(stream_client(k)) for k in range(args.streams)]
        await asyncio.sleep(args.settle + args.seconds)  # the streams' own prefills, then the baseline
        load_start = time.perf_counter() - t0
        pending = []
        for i, prompt in enumerate(long_prompts):
            at = load_start + i * args.every
            if at >= load_start + args.seconds:
                break
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            spec = api.request(prompt, 1, stream=True, exact=True)
            pending.append(asyncio.create_task(send(client, spec, t0)))
        await asyncio.sleep(max(0.0, load_start + args.seconds - (time.perf_counter() - t0)))
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        longs = list(await asyncio.gather(*pending))
    base = gaps(streams, args.settle, load_start)
    loaded = gaps(streams, load_start, load_start + args.seconds)
    row: dict[str, Any] = {"streams_failed": len(failed),
                           "long_prompts": len(longs), "long_failed": sum(not s.ok for s in longs)}
    for name, values in (("alone", base), ("long", loaded)):
        row[name] = {q: 1e3 * percentile(values, q / 100) for q in (50, 95)} | {"max": 1e3 * max(values, default=0.0),
                                                                         "n": len(values)}
    row["p95_rise"] = row["long"][95] / row["alone"][95] - 1 if row["alone"][95] else float("nan")
    ttfts = [s.ttft for s in longs if s.ok and s.ttft is not None]
    row["long_ttft_p50_s"] = percentile(ttfts, 0.5)
    return row


def run_system(name: str, args: argparse.Namespace, prompts: list[str], long_prompts: list[str]) -> dict[str, Any]:
    from ..systems.launchers import SYSTEMS, LaunchConfig
    from ..systems.process import ServerProcess, free_port

    port = free_port()
    cfg = LaunchConfig(("generate",), "default", port, args.threads, "cpu", args.out, None, 600.0)
    launch = SYSTEMS[name](cfg)
    if "generate" not in launch.tasks:
        return {"skipped": launch.skipped.get("generate", "does not generate")}
    with ServerProcess(name, launch.argv, port, args.out / f"{name}.log", launch.env, args.threads) as proc:
        startup = proc.wait_ready(args.ready_timeout, path=launch.ready_path)
        log.info("%s: ready in %.0f s", name, startup)
        api = asyncio.run(_api(proc.url, launch.openapi))
        row = asyncio.run(measure(proc.url, api, args, prompts, long_prompts))
    log.info("%s: %s", name, row)
    return row


async def _api(url: str, openapi: dict[str, Any] | None) -> GenerateAPI:
    async with http_client(url, 4, 60.0) as client:
        doc = openapi or (await client.get("/openapi.json")).json()
        models = (await client.get("/v1/models")).json()
    served = [m.get("id") for m in models.get("data", [])] or [None]
    generate = (models.get("tasks") or {}).get("generate") or served
    api, note = discover_generate(doc, generate[0])
    if api is None:
        raise RuntimeError(note)
    log.info("generate: %s", note)
    return api


def table(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [f"{args.streams} streams; a {args.prompt_tokens}-token prompt every {args.every:g} s for {args.seconds:g} s "
             f"after {args.seconds:g} s alone; {args.threads} thread(s) per model", "",
             "| system | gap p50 / p95 / max alone (ms) | with long prompts (ms) | p95 rise | long prompt TTFT p50 (s) "
             "| long prompts (failed) | stream requests failed |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | | |")
            continue
        a, b = r["alone"], r["long"]
        lines.append(f"| {name} | {a[50]:.0f} / {a[95]:.0f} / {a['max']:.0f} | {b[50]:.0f} / {b[95]:.0f} / {b['max']:.0f} "
                     f"| {100 * r['p95_rise']:+.0f}% | {r['long_ttft_p50_s']:.2f} | {r['long_prompts']} "
                     f"({r['long_failed']}) | {r['streams_failed']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="ours,vllm_cpu")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=256, help="tokens each streamed request asks for")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--every", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=20.0, help="each phase: alone, then with long prompts")
    p.add_argument("--settle", type=float, default=8.0, help="seconds before the baseline (the streams' prefills)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / ".bench" / "long_prompt")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    from models import zoo

    from ..systems.modelsets import model_set, token_counter

    count = token_counter(model_set("default")["generate"], zoo.default_cache_dir()) or workload.words_as_tokens
    rng = random.Random(args.seed)
    sentences = workload.load_sentences()
    prompts = [workload.fit_prompt(workload.sample_texts(sentences, 1, rng)[0] + " " + sentences[i], 32, count)
               for i in range(args.streams)]
    long_prompts = [long_text(args.prompt_tokens, count, rng) for _ in range(int(args.seconds / args.every) + 1)]
    rows = {name: run_system(name, args, prompts, long_prompts) for name in args.systems.split(",")}
    text = table(rows, args)
    (args.out / "long_prompt.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
