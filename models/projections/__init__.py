"""Projections: every weight format a Linear is served in, their quantizers, and the swap that puts them in.

    base.py            stack_linears, tied_embedding, RepackedLinear (a float layer in a kernel's layout),
                       swap_linears (the one function that replaces a model's projections)
    fuse.py            q/k/v and gate/up as one projection each (same results)
    dense.py           float32 on CPU: MKL, oneDNN packed, or our panels, chosen per shape by timing at load
                       (or all on our bfloat16 panels where a spec asks for them)
    panels.py          our CPU kernels' layouts: float32 and bfloat16 panels, GGUF's Q8_0 / Q4_1 blocks, their quantizers
    quant.py           quantize(model, mode): int8 (SmoothQuant, exact int32 sums), q8_0 / q4_1 blocks
    int4_tiles.py      Q4_1 codes on PyTorch's int4 tile kernel (CUDA)
    calibration.py     the sample text int8's smoothing is calibrated on
    prompt_weights.py  float32, bfloat16 or block weights for prompts, by timing at load
"""
