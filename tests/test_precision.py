"""dtype=auto: bf16 autocast exactly where the device has fast bf16, fp32 elsewhere."""

from __future__ import annotations

import pytest
import torch

from adaspan import precision
from adaspan.config import TrainConfig


@pytest.mark.parametrize("fast", [False, True])
def test_auto_follows_the_cpu(monkeypatch, fast):
    monkeypatch.setattr(precision, "_cpu_has_fast_bfloat16", lambda: fast)
    cpu = torch.device("cpu")
    assert precision.resolve_dtype("auto", cpu) == ("bfloat16" if fast else "float32")
    assert precision.resolve_dtype("float32", cpu) == "float32"  # asked for: kept
    assert precision.resolve_dtype("bfloat16", cpu) == "bfloat16"
    with precision.autocast("auto", cpu):
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype == (torch.bfloat16 if fast else torch.float32)


@pytest.mark.parametrize("cpuinfo, fast", [("flags : avx512f avx512_bf16 amx_tile", True),
                                            ("flags : avx512f amx_bf16", True),
                                            ("flags : avx512f avx512bw", False), (None, False)])
def test_without_torch_s_probe_the_kernel_s_cpu_flags_decide(monkeypatch, cpuinfo, fast):
    monkeypatch.undo()  # the real detection, not the suite's fp32 default
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)

    class FakePath:  # /proc/cpuinfo holding ``cpuinfo`` (None: unreadable)
        def __init__(self, path: str) -> None:
            assert path == "/proc/cpuinfo"

        def read_text(self) -> str:
            if cpuinfo is None:
                raise OSError("no /proc here")
            return cpuinfo

    monkeypatch.setattr(precision, "Path", FakePath)
    precision._cpu_has_fast_bfloat16.cache_clear()
    try:
        assert precision._cpu_has_fast_bfloat16() is fast
    finally:
        precision._cpu_has_fast_bfloat16.cache_clear()


def test_auto_is_the_default_and_unknown_dtypes_are_refused():
    assert TrainConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(dtype="float16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        precision.resolve_dtype("half", torch.device("cpu"))
