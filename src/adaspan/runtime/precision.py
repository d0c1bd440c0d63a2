"""The precision of a job, decided in one place for every command.

``dtype`` is ``auto``, ``float32`` or ``bfloat16``; what ``auto`` means depends on the job
(:func:`choose`):

- ``train`` (``adaspan train``, ``compare``'s training, ``bench``'s training step): bf16
  autocast where the device has fast bf16 products (a CUDA GPU of compute capability 8.0 or
  later; a CPU with AVX-512 BF16 or AMX), else fp32; fp32 products on CUDA use TF32.
  Validation inside training runs in the training's precision (its records say which).
- ``score`` (``evaluate``, the bpc of ``compare``'s table and of ``demo``): fp32 with TF32 off,
  so that a reported bpc or log-probability does not depend on the hardware it was scored on;
  bf16 only when asked for.
- ``generate`` (batch-1 decoding, a dozen small products per layer and token): fp32, TF32 on
  CUDA; measured faster than bf16 on a CPU with AVX-512 BF16 (``docs/performance.md``), and
  not measured on a GPU, where ``--dtype bfloat16`` is one flag away.

Under bf16 autocast the parameters, the optimiser state, the softmax and the loss stay in fp32.
``ADASPAN_CPU_FAST_BF16=1`` (or ``0``) overrides the detection of fast bf16 on the CPU, in this
process and in those it starts (the test suite runs under both claims).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DTYPES

JOBS = ("train", "score", "generate")
CPU_FAST_BF16 = "ADASPAN_CPU_FAST_BF16"  # environment variable: 1 or 0 overrides detection


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


def cpu_fast_bfloat16() -> bool:
    """Whether bf16 products are fast on this CPU: ``ADASPAN_CPU_FAST_BF16`` where it is set
    (1 or 0), else what the CPU reports."""
    claim = os.environ.get(CPU_FAST_BF16, "").strip()
    if claim in ("0", "1"):
        return claim == "1"
    if claim:
        raise ValueError(f"{CPU_FAST_BF16} must be 1 or 0, got {claim!r}")
    return _cpu_has_fast_bfloat16()


def fast_bfloat16(device: torch.device) -> bool:
    """Whether bf16 products are faster than fp32 on ``device``."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu" and cpu_fast_bfloat16()


@dataclass(frozen=True)
class Precision:
    """What a job's products run in: ``dtype`` (float32 or bfloat16 autocast) on ``device``,
    ``tf32`` whether fp32 products may use TF32 (CUDA only)."""

    dtype: str
    tf32: bool
    device: torch.device

    @property
    def bf16(self) -> bool:
        return self.dtype == "bfloat16"

    def describe(self) -> str:
        """``bfloat16``, ``float32`` or ``float32 (TF32)``: for people."""
        return f"{self.dtype} (TF32)" if self.tf32 else self.dtype

    def record(self) -> dict:
        """What ran, for JSON outputs: dtype, TF32, device and torch's version."""
        return {"dtype": self.dtype, "tf32": self.tf32, "device": str(self.device),
                "torch": torch.__version__}

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Run the block in this precision: bf16 autocast, or fp32 with TF32 on or off (a
        process-wide setting on CUDA, put back afterwards)."""
        before = torch.get_float32_matmul_precision()
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high" if self.tf32 else "highest")
        try:
            with torch.autocast(self.device.type, torch.bfloat16, enabled=self.bf16):
                yield
        finally:
            if self.device.type == "cuda":
                torch.set_float32_matmul_precision(before)


def choose(dtype: str, device: torch.device, job: str = "train") -> Precision:
    """The precision of ``job`` (train, score or generate) for the requested ``dtype``
    (auto, float32 or bfloat16) on ``device``; see the module docstring."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if job not in JOBS:
        raise ValueError(f"job must be one of {', '.join(JOBS)}, got {job!r}")
    if dtype == "auto":
        dtype = "bfloat16" if job == "train" and fast_bfloat16(device) else "float32"
    tf32 = device.type == "cuda" and dtype == "float32" and job != "score"
    return Precision(dtype, tf32, device)
