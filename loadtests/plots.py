"""PNG plots of a results.json (matplotlib, Agg backend): per task, throughput and p95 latency against
concurrency per system, and the latency distribution (ECDF) of each system at the comparison level."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .report import compare_level


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def throughput_plot(runs: Sequence[dict[str, Any]], task: str, path: Path) -> None:
    plt = _pyplot()
    metric, label = (
        ("output_tokens_per_s", "output tokens/s") if task == "generate" else ("throughput_rps", "requests/s")
    )
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(10, 4))
    any_latency = False
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = sorted((r for r in runs if r["system"] == system), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in mine]
        p95 = [_num(r["latency_ms"]["p95"]) for r in mine]
        any_latency = any_latency or any(v > 0 for v in p95)
        ax_t.plot(xs, [_num(r.get(metric)) for r in mine], marker="o", label=system)
        ax_l.plot(xs, p95, marker="o", label=system)
    levels = sorted({r["concurrency"] for r in runs})
    for ax, ylabel in ((ax_t, label), (ax_l, "p95 latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    if any_latency:
        ax_l.set_yscale("log")
    ax_t.legend()
    fig.suptitle(f"{task}: throughput and p95 latency vs concurrency (closed loop)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_plot(runs: Sequence[dict[str, Any]], task: str, level: int, path: Path) -> None:
    """ECDF of request latency (and, for generation, of time to first token) per system."""
    plt = _pyplot()
    keys = [("latencies_ms", "latency (ms)")] + (
        [("ttfts_ms", "time to first token (ms)")] if task == "generate" else []
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, (key, xlabel) in zip(axes[0], keys, strict=True):
        if any(r.get(key) for r in runs):
            ax.set_xscale("log")
        for r in runs:
            xs = sorted(r.get(key) or [])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["system"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{task}: distribution at {level} clients")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(results: dict[str, Any], out: Path) -> list[str]:
    """The PNG file names written into `out`."""
    written = []
    compare_at = results["meta"]["settings"]["compare_at"]
    for task in results["meta"]["settings"]["tasks"]:
        closed = [r for r in results["runs"] if r["task"] == task and r["mode"] == "closed"]
        if not closed:
            continue
        name = f"throughput_{task}.png"
        throughput_plot(closed, task, out / name)
        written.append(name)
        level = compare_level(sorted({r["concurrency"] for r in closed}), compare_at)
        name = f"latency_{task}.png"
        latency_plot([r for r in closed if r["concurrency"] == level], task, level, out / name)
        written.append(name)
    return written
