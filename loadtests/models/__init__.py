"""Micro-benchmarks of our models alone, in one process (no service, no HTTP):

    bench.py      ours vs transformers on the same weights (make bench)
    quant.py      fp32 vs the quantized modes on the default models (make bench-quant)
    kernels.py    the projection kernels side by side on SmolLM2's shapes
    attention.py  decode attention, the paged kernel against the dense cache
"""
