"""Where a replica runs its model: "auto" device and dtype resolved in the replica's own process
(the settings name them; only the replica knows which GPU and which CPU it got)."""

from __future__ import annotations

import torch


def resolve_device(device: str, dtype: str) -> tuple[str, torch.dtype]:
    """"auto" -> cuda + bfloat16 when this process sees a GPU, else cpu + float32. dtype
    "auto-bf16" is "auto", but bfloat16 also on a CPU that multiplies it natively: our bfloat16
    panels run (AVX512-BF16: models/projections/panels.py) or it has AMX-BF16 tiles (oneDNN's).
    Any other dtype is a torch dtype name (service/settings.py lists those accepted)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype in ("auto", "auto-bf16"):
        native = device.startswith("cuda") or (dtype == "auto-bf16" and device == "cpu" and cpu_multiplies_bf16())
        dtype = "bfloat16" if native else "float32"
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return device, resolved


def cpu_multiplies_bf16() -> bool:
    """Whether bfloat16 projections are faster than float32 ones here: our bfloat16 panels run, or
    the CPU has AMX-BF16 (without either, torch emulates bfloat16 products more slowly than float32)."""
    from models.kernels import native

    return native.has_bf16() or cpu_has_amx_bf16()


def cpu_has_amx_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has AMX-BF16 tiles (Intel Sapphire Rapids and later), where oneDNN's bfloat16
    matrix products of many rows beat float32 ones (docs/benchmarks-history.md, "Where the serving
    targets stand"). Without them bfloat16 is emulated and slower than float32. Linux only; False
    elsewhere."""
    try:
        with open(cpuinfo) as f:
            return any(line.startswith("flags") and "amx_bf16" in line.split() for line in f)
    except OSError:
        return False
