"""The projection kernels side by side on SmolLM2's shapes: `python -m loadtests.models.kernels`.

All 121 projections of one SmolLM2-135M decode step (30 layers of fused q/k/v 960x576, o 576x576,
gate/up 3072x576, down 576x1536, and the 49152x576 head), random weights, swept in model order as a
forward pass runs them, at 1 / 8 / 32 / 64 / 128 rows: torch's F.linear (MKL), oneDNN prepacked, our
float32 panels, our Q8_0 / Q4_1 blocks (models/projections/panels.py) with 16-bit and ("+a8") 8-bit
activations, and in bfloat16 (where the CPU has AVX512-BF16 or AMX): oneDNN prepacked (what torch runs
for a bfloat16 model; its rows depend on the batch) and our bfloat16 panels (they do not).
The kernels take turns sweep by sweep; medians of the sweeps; the float weights' GB/s is what one
row reads (540 MB of float32) over the time. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from models.kernels import native
from models.machine import machine_info
from models.projections.dense import PackedLinear, onednn_available
from models.projections.panels import Bf16PanelLinear, BlockLinear, PanelLinear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


class OneDnnBf16(torch.nn.Module):
    """oneDNN's bfloat16 linear on prepacked weights, float32 in and out (the conversions timed too)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.bfloat16().contiguous(), 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.bfloat16(), self.packed, None, "none", [], "").float()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sweeps", type=int, default=5)
    p.add_argument("--rows", default="1,8,32,64,128")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    kernels = {"F.linear (MKL)": [lambda x, w=w: F.linear(x, w) for w in weights]}
    if onednn_available():
        kernels["oneDNN packed"] = [PackedLinear(w, None) for w in weights]
    if native.available():
        kernels["ours f32"] = [PanelLinear(w, None) for w in weights]
        for fmt in ("q8_0", "q4_1"):  # 16-bit activations (the default), then 8-bit (block_activation_bits)
            kernels[f"ours {fmt}"] = [BlockLinear(fmt, w, None) for w in weights]
            kernels[f"ours {fmt}+a8"] = [BlockLinear(fmt, w, None, activation_bits=8) for w in weights]
    if onednn_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        kernels["oneDNN bf16"] = [OneDnnBf16(w) for w in weights]
    if native.has_bf16():
        kernels["ours bf16"] = [Bf16PanelLinear(w, None) for w in weights]
    nbytes = sum(w.numel() * 4 for w in weights)
    m = machine_info()
    print(f"CPU: {m.get('cpu_model')} ({', '.join(m.get('cpu_flags', []))}); torch {torch.__version__}, "
          f"{args.threads} threads\n")
    print("| rows | " + " | ".join(f"{k} ms" for k in kernels) + " | f32 GB/s: MKL / oneDNN / ours |")
    print("|---:|" + "---:|" * (len(kernels) + 1))
    with torch.inference_mode():
        for rows in map(int, args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in (576, 1536)}
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for sweep in range(args.sweeps + 1):  # the kernels take turns, so a slow spell hits them all
                for name, fns in kernels.items():
                    start = time.perf_counter()
                    for (_, k), fn in zip(SHAPES, fns, strict=True):
                        fn(xs[k])
                    if sweep:  # the first warms up
                        times[name].append(time.perf_counter() - start)
            ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
            rates = " / ".join(f"{nbytes / ms[k] / 1e6:.1f}" for k in ("F.linear (MKL)", "oneDNN packed", "ours f32")
                               if k in ms)
            print(f"| {rows} | " + " | ".join(f"{v:.1f}" for v in ms.values()) + f" | {rates} |", flush=True)


if __name__ == "__main__":
    main()
