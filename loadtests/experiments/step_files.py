"""Which of this repository's Python files one decode step of a generation engine runs, and its plan.

    python -m loadtests.experiments.step_files            # the shipped generator (q4_1 blocks)
    python -m loadtests.experiments.step_files --tiny     # the tiny decoder, fused and in q4_1 blocks

Loads the model, starts two requests on an engine, steps it until both decode, then records (with a
profile hook) every file of the repository whose code runs during one more step: the engine's
scheduling, the executor and the backend its plan chose, the cache, sampling, detokenization.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def step_files(tiny: bool) -> tuple[list[str], str]:
    """(the repository's files one decode step runs, sorted; the engine's plan in one line)."""
    import dataclasses

    from models import zoo
    from models.catalog import DEFAULT_SPECS, ModelSpec, load_model
    from models.decoding import SamplingParams
    from service.engine.config import EngineConfig
    from service.engine.core import GenerationEngine

    if tiny:
        spec = ModelSpec(name="tiny", tasks=("generate",), source="tiny:decoder", quantize="q4_1")
    else:  # as shipped but eager: compiling changes the prompts' backend, not the decode step's
        spec = dataclasses.replace(DEFAULT_SPECS["generator"], quantize="q4_1", compile=False)
    lm = load_model(spec, zoo.default_cache_dir())
    engine = GenerationEngine(lm.executor, lm.tokenizer, EngineConfig(max_running=8, kv_cache_mib=64,
                                                                      prefix_cache_mib=0))
    ids = lm.tokenizer.encode("What is the capital of France?")
    for _ in range(2):
        engine.submit(ids, SamplingParams(max_new_tokens=50, ignore_eos=True))
    for _ in range(3):  # admission, prefill, decode steps
        engine.step()
    seen: set[str] = set()

    def hook(frame, event, arg) -> None:  # noqa: ANN001
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(ROOT) and ".venv" not in path.parts:
            seen.add(str(path.relative_to(ROOT)))

    sys.setprofile(hook)
    threading.setprofile(hook)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    engine.shutdown()
    return sorted(seen), engine.plan.summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    files, plan = step_files(args.tiny)
    print(f"plan: {plan}")
    print(f"{len(files)} Python files ({sum(f.startswith('models/') for f in files)} in models/):")
    for f in files:
        print(f"  {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
