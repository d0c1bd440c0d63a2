"""The precision of the products: ``dtype`` auto, float32 or bfloat16.

``auto`` (the default) runs bf16 autocast where the device has fast bf16 products (a CUDA GPU
of compute capability 8.0 or later; a CPU with AVX-512 BF16 or AMX) and fp32 elsewhere; fp32
products on CUDA use TF32. Under autocast the parameters, the optimiser state, the softmax
and the loss stay in fp32.
"""

from __future__ import annotations

import functools
from contextlib import AbstractContextManager
from pathlib import Path

import torch

DTYPES = ("auto", "float32", "bfloat16")


@functools.cache
def _cpu_has_fast_bfloat16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX tiles)."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported",
                                                          "_is_amx_tile_supported")]
    if all(check is not None for check in checks):
        return any(check() for check in checks)
    try:  # an older torch: ask the kernel
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fast_bfloat16(device: torch.device) -> bool:
    """Whether bf16 products are faster than fp32 on ``device``."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu" and _cpu_has_fast_bfloat16()


def resolve_dtype(name: str, device: torch.device) -> str:
    """``float32`` or ``bfloat16``: ``name``, with ``auto`` decided by :func:`fast_bfloat16`."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name == "auto":
        return "bfloat16" if fast_bfloat16(device) else "float32"
    return name


def autocast(name: str, device: torch.device) -> AbstractContextManager:
    """The context of the forward pass for dtype ``name`` (auto, float32 or bfloat16) on
    ``device``: bf16 autocast, or nothing."""
    bf16 = resolve_dtype(name, device) == "bfloat16"
    return torch.autocast(device.type, torch.bfloat16, enabled=bf16)


def use_tf32(device: torch.device) -> None:
    """Let fp32 products on CUDA use TF32 (a process-wide setting; nothing on the CPU)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
