"""What machine a measurement ran on, recorded with every benchmark figure (the CPU model changes
between sessions, and with it which kernels are fast)."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any

# the instruction-set flags that decide our fast paths (bf16 and int8 matrix units)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def machine_info() -> dict[str, Any]:
    """CPU model and flags, usable CPUs, memory, GPU (None without one)."""
    info: dict[str, Any] = {"nproc": os.cpu_count(), "platform": platform.platform()}
    if hasattr(os, "sched_getaffinity"):
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        text = cpuinfo.read_text()
        models = re.findall(r"^model name\s*:\s*(.+)$", text, re.M)
        info["cpu_model"] = models[0].strip() if models else platform.processor()
        family = re.search(r"^cpu family\s*:\s*(\d+)$", text, re.M)
        model = re.search(r"^model\s*:\s*(\d+)$", text, re.M)
        if family and model:  # a VM often names only the vendor ("AMD EPYC"): the generation is in these
            info["cpu_model"] += f" (family {family.group(1)}, model {model.group(1)})"
        flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        info["cpu_flags"] = [f for f in CPU_FLAGS if flags and f in flags.group(1).split()]
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        kb = re.search(r"^MemTotal:\s*(\d+)", meminfo.read_text(), re.M)
        info["ram_gib"] = round(int(kb.group(1)) / 2**20, 1) if kb else None
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        info["gpu"] = None
    return info
