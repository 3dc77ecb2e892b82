"""What the in-process engine benchmarks (prefill_stall, prefix_reuse) share: the generator they load
(as deploy/serve_config.yaml deploys it, or the tiny decoder for smoke runs) and their statistics."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny", action="store_true", help="the tiny random decoder (a smoke run)")
    parser.add_argument("--quantize", default="shipped",
                        help="the generator's weights: shipped (deploy/serve_config.yaml's), none (float: the GGUF "
                             "dequantized, prompts on the same weights), or a ModelSpec.quantize value")


def shipped_generator() -> tuple[Any, str, Path]:
    """The generator's ModelSpec, dtype and weights directory as deploy/serve_config.yaml deploys it."""
    import yaml

    from service.settings import Settings

    (app,) = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())["applications"]
    settings = Settings.build(app["args"], {})
    dep = settings.deployments["generator"]
    return dep.model, settings.device_for(dep)[1], settings.cache_path()


def shipped_generator_engine(**changes: Any) -> dict[str, Any]:
    """The generator's engine settings in deploy/serve_config.yaml (EngineConfig's fields), with `changes`."""
    import dataclasses

    import yaml

    from service.settings import Settings

    (app,) = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())["applications"]
    engine = Settings.build(app["args"], {}).deployments["generator"].engine
    return {**dataclasses.asdict(engine), **changes}


def load_generator(args: argparse.Namespace, prompt_weights: str | None = None) -> tuple[Any, Any, str, Any]:
    """(model, tokenizer, label, prompt model or None) with torch set to args.threads: the shipped
    generator (its prompt_weights unless given), or the tiny one."""
    import dataclasses

    import torch

    from models.catalog import load_model
    from models.tiny import tiny_model

    torch.set_num_threads(args.threads)
    if args.tiny:
        model, tok = tiny_model("decoder")
        return model, tok, "tiny decoder", None
    spec, dtype, cache_dir = shipped_generator()
    if args.quantize != "shipped":
        quantize = None if args.quantize == "none" else args.quantize
        spec = dataclasses.replace(spec, quantize=quantize, prompt_weights="same" if quantize is None else spec.prompt_weights)
    if prompt_weights is not None:
        spec = dataclasses.replace(spec, prompt_weights=prompt_weights)
    loaded = load_model(spec, cache_dir, dtype=None if dtype == "auto" else getattr(torch, dtype))
    label = f"{spec.name} ({spec.quantize or dtype}, compiled {spec.compile}, prompts on {spec.prompt_weights} weights)"
    return loaded.model, loaded.tokenizer, label, loaded.prompt_model
