"""One precision policy: what dtype=auto means per job and device, the override of the CPU's
answer, and what a job's precision applies and records."""

from __future__ import annotations

import pytest
import torch

from adaspan.config import TrainConfig
from adaspan.runtime import precision

CPU = torch.device("cpu")


@pytest.mark.parametrize("fast", [False, True])
def test_auto_trains_in_bf16_where_the_cpu_is_fast_and_scores_and_generates_in_fp32(
        monkeypatch, fast):
    monkeypatch.setenv(precision.CPU_FAST_BF16, str(int(fast)))
    chosen = {job: precision.choose("auto", CPU, job) for job in precision.JOBS}
    assert chosen["train"].dtype == ("bfloat16" if fast else "float32")
    assert chosen["score"].dtype == chosen["generate"].dtype == "float32"
    assert not any(p.tf32 for p in chosen.values())  # no TF32 on a CPU
    for job in precision.JOBS:  # asked for: kept, whatever the job
        assert precision.choose("float32", CPU, job).dtype == "float32"
        assert precision.choose("bfloat16", CPU, job).dtype == "bfloat16"


@pytest.mark.parametrize("major, train", [(7, "float32"), (8, "bfloat16")])
def test_on_cuda_scores_are_fp32_without_tf32_and_training_keeps_its_fast_defaults(
        monkeypatch, major, train):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    gpu = torch.device("cuda", 0)
    assert precision.choose("auto", gpu, "train").dtype == train
    assert precision.choose("auto", gpu, "generate") == precision.Precision("float32", True, gpu)
    assert precision.choose("auto", gpu, "score") == precision.Precision("float32", False, gpu)
    assert precision.choose("float32", gpu, "train").tf32  # fp32 training: TF32
    assert not precision.choose("float32", gpu, "score").tf32  # a score: full fp32
    assert not precision.choose("bfloat16", gpu, "train").tf32


def test_tf32_is_set_for_the_block_and_put_back(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "set_float32_matmul_precision", seen.append)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: torch.no_grad())
    gpu = torch.device("cuda", 0)
    for tf32, inside in ((True, "high"), (False, "highest")):
        seen.clear()
        with precision.Precision("float32", tf32, gpu).applied():
            assert seen == [inside]
        assert seen == [inside, "medium"]
    seen.clear()
    with precision.Precision("float32", False, CPU).applied():
        pass
    assert seen == []  # the CPU's fp32 products are left alone


@pytest.mark.parametrize("dtype, expected", [("float32", torch.float32),
                                             ("bfloat16", torch.bfloat16)])
def test_applied_runs_the_products_in_its_dtype_and_records_what_ran(dtype, expected):
    chosen = precision.choose(dtype, CPU, "score")
    with chosen.applied():
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype == expected
    assert not torch.is_autocast_enabled("cpu")  # off again after the block
    assert chosen.record() == {"dtype": dtype, "tf32": False, "device": "cpu",
                               "torch": torch.__version__}


@pytest.mark.parametrize("claim, fast", [("1", True), ("0", False)])
def test_the_environment_overrides_the_cpu_s_answer(monkeypatch, claim, fast):
    monkeypatch.setattr(precision, "_cpu_has_fast_bfloat16", lambda: not fast)
    monkeypatch.setenv(precision.CPU_FAST_BF16, claim)
    assert precision.cpu_fast_bfloat16() is fast
    monkeypatch.delenv(precision.CPU_FAST_BF16)
    assert precision.cpu_fast_bfloat16() is not fast  # unset: the CPU decides
    monkeypatch.setenv(precision.CPU_FAST_BF16, "yes")
    with pytest.raises(ValueError, match="must be 1 or 0"):
        precision.cpu_fast_bfloat16()


@pytest.mark.parametrize("cpuinfo, fast", [("flags : avx512f avx512_bf16 amx_tile", True),
                                            ("flags : avx512f amx_bf16", True),
                                            ("flags : avx512f avx512bw", False), (None, False)])
def test_without_torch_s_probe_the_kernel_s_cpu_flags_decide(monkeypatch, cpuinfo, fast):
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


def test_auto_is_the_default_and_unknown_dtypes_and_jobs_are_refused():
    assert TrainConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype"):
        TrainConfig(dtype="float16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        precision.choose("half", CPU)
    with pytest.raises(ValueError, match="job must be one of"):
        precision.choose("auto", CPU, "sample")
