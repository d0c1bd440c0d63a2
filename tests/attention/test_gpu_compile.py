"""The fused kernels compiled without a GPU for every NVIDIA architecture they are configured for
(``scripts/gpu/gpu_compile.py``): every specialization the CUDA path can launch fits the
architecture's shared memory and spills no register (ptxas's own report). One test per
architecture, so that the suite's workers share them; the script keeps its results in a cache
keyed by the kernels' source (docs/gpu.md), so that a suite run after the first compiles
nothing that did not change. The compiler runs in a process of its own: this one may have
chosen Triton's interpreter (tests/attention/test_fused.py)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaspan.attention import fused

SCRIPT = Path(__file__).parents[2] / "scripts" / "gpu" / "gpu_compile.py"


def _missing() -> str | None:
    """Why the kernels cannot be compiled for NVIDIA GPUs here, or None (Triton is not
    imported: this process may need its interpreter)."""
    spec = importlib.util.find_spec("triton")
    if spec is None:
        return "needs Triton (adaspan[cuda])"
    backend = Path(spec.origin).parent / "backends" / "nvidia"
    if not (backend / "bin" / "ptxas-blackwell").exists():
        return "needs Triton's NVIDIA backend (its compiler and ptxas-blackwell)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


def compile_lines(*options: str) -> list[dict]:
    """The lines of ``scripts/gpu/gpu_compile.py`` with ``options``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT), *options], capture_output=True,
                         text=True, env=env, timeout=900)
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert run.returncode == (0 if all(line["fits"] for line in lines) else 1), run.stderr
    return lines


@pytest.mark.parametrize("arch", sorted(fused.SHARED_MEMORY))
def test_every_specialization_fits_the_architecture_and_spills_nothing(arch):
    lines = compile_lines("--archs", str(arch))
    seen = {(line["kernel"].rpartition(":")[2], line["signature"]["Q"],
             line["constexprs"]["PRECISION"], line["constexprs"]["HAS_Z"],
             line["constexprs"]["DROPOUT"], line["constexprs"]["DH"]) for line in lines}
    products = [("*fp32", "ieee"), ("*fp32", "tf32"), ("*bf16", "ieee"), ("*fp16", "ieee")]
    expected = {(kernel, dtype, precision, has_z, dropout, d_head)
                for kernel, (dtype, precision), has_z, dropout, d_head in itertools.product(
                    ("band_forward", "band_backward"), products, (False, True), (False, True),
                    (32, 64, 128))
                # what takes the grouped path on CUDA (fused.compiled): fp32 heads of 128
                # features; fp32 training with TF32 off beyond 32
                if not (dtype == "*fp32" and d_head == 128)
                and not (kernel == "band_backward" and precision == "ieee" and d_head == 64
                         and dtype == "*fp32")}
    assert seen == expected and len(lines) == len(expected)
    limit = fused.SHARED_MEMORY[arch]
    too_big = [(line["kernel"], line["constexprs"], line["signature"]["Q"], line["shared"],
                line["registers"], line["spill_bytes"])
               for line in lines if line["shared"] > limit or line["spill_bytes"] > 0]
    assert not too_big, f"sm_{arch} gives {limit:,} bytes of shared memory: {too_big}"
    assert all(line["arch"] == arch and 0 < line["registers"] <= 255 for line in lines)
