"""What choosing a step's tokens costs (models.decoding.choose), by batch size and sampling parameters.

    python -m loadtests.experiments.sampling_cost                  # the shipped generator's own logits
    python -m loadtests.experiments.sampling_cost --synthetic      # random logits of SmolLM2's vocabulary (no weights)

Logits: one row per (prompt, step) of greedy continuations of a few chat prompts on the shipped
generator (as deploy/serve_config.yaml deploys it), or random rows at `--spread` (a language model's
logits are peaked: a spread of about 6 puts most nuclei inside 128 tokens, 1 is flat). For each
batch size and each parameter set (greedy; temperature 0.8; + top_p 0.95; + top_k 40) prints the
median milliseconds of `choose` over `--repeat` calls, and the share of rows whose top_p nucleus fits
the candidates models.decoding searches before sorting a whole vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import time

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
           "Tell me a story about a dragon.", "How do I bake bread?", "Explain gravity to a child.",
           "Name a colour.", "What is 12 times 7?"]


def model_logits(rows: int) -> object:
    """`rows` logits rows (rows, V) float32 of the shipped generator: greedy continuations of PROMPTS."""
    import torch

    from models import zoo
    from models.catalog import DEFAULT_SPECS, load_model

    lm = load_model(DEFAULT_SPECS["generator"], zoo.default_cache_dir())
    tok, out = lm.tokenizer, []
    with torch.inference_mode():
        for step in range(-(-rows // len(PROMPTS))):
            for text in PROMPTS:
                ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
                for _ in range(step):  # a different depth of the same answer per round
                    ids.append(int(lm.model(torch.tensor([ids]))[0, -1].argmax()))
                out.append(lm.model(torch.tensor([ids]))[0, -1].float())
    return torch.stack(out[:rows])  # (rows, V)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32", help="batch sizes")
    parser.add_argument("--synthetic", action="store_true", help="random logits instead of the model's")
    parser.add_argument("--spread", type=float, default=6.0, help="synthetic logits' standard deviation")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    import torch

    from models import decoding
    from models.decoding import BatchParams, RowSampler, SamplingParams, choose

    torch.set_num_threads(args.threads)
    sizes = [int(x) for x in args.rows.split(",")]
    if args.synthetic:
        logits = torch.randn(max(sizes), args.vocab, generator=torch.Generator().manual_seed(0)) * args.spread
    else:
        logits = model_logits(max(sizes))
    kinds = {"greedy": {}, "temperature 0.8": {"temperature": 0.8},
             "+ top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
             "+ top_k 40": {"temperature": 0.8, "top_p": 0.95, "top_k": 40}}
    probs = (logits / 0.8).softmax(-1).sort(-1, descending=True).values.cumsum(-1)  # (R, V)
    inside = float(((probs < 0.95).sum(-1) + 1 <= decoding.NUCLEUS_CANDIDATES).float().mean())
    print(f"logits: {'synthetic, spread ' + str(args.spread) if args.synthetic else 'the shipped generator'}, "
          f"V = {logits.size(-1)}; nuclei (T 0.8, top_p 0.95) inside {decoding.NUCLEUS_CANDIDATES} tokens: "
          f"{inside:.0%}\n")
    print("| rows | " + " | ".join(kinds) + " |")
    print("|---:|" + "---:|" * len(kinds))
    for b in sizes:
        cells = []
        for extra in kinds.values():
            params = [SamplingParams(seed=i, **extra) for i in range(b)]
            batch, samplers = BatchParams.build(params), [RowSampler(p) for p in params]
            choose(logits[:b], batch, samplers)
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                choose(logits[:b], batch, samplers)
                times.append(time.perf_counter() - t0)
            cells.append(f"{1e3 * statistics.median(times):.2f} ms")
        print(f"| {b} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
