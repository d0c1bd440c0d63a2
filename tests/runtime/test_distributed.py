"""Training under torchrun, proven on the CPU: two gloo processes share the validation and save
their own parts of the training state; the device each process takes (the training itself
against one process: test_train.py)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing
from helpers import TRAIN_MODEL, run_processes, run_quietly, tiny_train_config
from safetensors.torch import load_file

import adaspan.training.train as train_module
from adaspan import SpanLM
from adaspan.attention.cache import StreamCache
from adaspan.data.corpora import load_corpus
from adaspan.run.checkpoint import (
    ARCHIVE_DIR,
    STATE_FILE,
    RunDirError,
    load_model,
    load_training_state,
    read_state,
)
from adaspan.run.lock import RunLockedError, WriterLock
from adaspan.runtime import distributed
from adaspan.runtime.distributed import DeviceError, Distributed, resolve_device
from adaspan.training.evaluate import evaluate
from adaspan.training.optim import build_optimizer, build_scheduler
from adaspan.training.train import train

MODEL = dataclasses.replace(TRAIN_MODEL, dropout=0.0)
PART = "state.step-000000003.rank-1.safetensors"  # rank 1's part of the checkpoint of step 3


def _model() -> SpanLM:
    torch.manual_seed(0)
    return SpanLM(MODEL).eval()


def _config(data: str, **changes):
    """3 steps, validated at steps 2 and 3, saved at step 3 (and archived)."""
    return tiny_train_config(data, **{"steps": 3, "eval_interval": 2, "keep_last": 1, **changes})


def _worker(rank: int, store: Path, data: str, out: Path, dtype: str) -> None:
    """One of 2 torchrun-like processes: evaluate a share of the streams, then train 3 steps,
    both in ``dtype``."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                  world_size=2)
    try:
        valid = load_corpus(data).valid
        dist = Distributed(rank, 2, rank)
        results = [evaluate(_model(), valid, batch_size=4, block_size=8, dist=dist,
                            dtype=dtype, **options) for options in ({}, {"max_chars": 21})]
        (out / f"eval-{rank}.json").write_text(json.dumps(results))
        run_quietly(out / "run", _config(data, dtype=dtype), MODEL)
    finally:
        torch_dist.destroy_process_group()


def _refused_worker(rank: int, store: Path, data: str, run: Path, out: Path) -> None:
    """One of 2 torchrun-like processes resuming ``run`` while another process writes it:
    writes what refused it."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                  world_size=2)
    try:
        run_quietly(run, _config(data, steps=5), MODEL, resume=True)
    except RunLockedError as exc:
        (out / f"refused-{rank}.txt").write_text(str(exc))
    finally:
        # both ranks are refused together, so both can meet here and leave the group together
        torch_dist.barrier()
        torch_dist.destroy_process_group()


def _spawn(tmp_path_factory, corpus_file: str, dtype: str) -> Path:
    """What the 2 processes of :func:`_worker` wrote, working in ``dtype``."""
    out = tmp_path_factory.mktemp(f"two-processes-{dtype}")
    run_processes(_worker, (out / "store", corpus_file, out, dtype), "the 2 processes")
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, corpus_file) -> Path:
    return _spawn(tmp_path_factory, corpus_file, "float32")


@pytest.fixture(scope="module")
def two_processes_bf16(tmp_path_factory, corpus_file) -> Path:
    return _spawn(tmp_path_factory, corpus_file, "bfloat16")


@pytest.mark.parametrize("dtype, outputs", [("float32", "two_processes"),
                                            ("bfloat16", "two_processes_bf16")])
def test_two_processes_validate_as_one(request, corpus_file, dtype, outputs):
    """Each process scores half the streams; their sums are those of one process scoring all
    of them, in fp32 as under bf16 autocast (whose products of 2 streams may round apart
    from those of 4 in the last bf16 bit; held to 1e-4 bpc)."""
    two_processes, tolerance = request.getfixturevalue(outputs), {"float32": 1e-6}.get(dtype, 1e-4)
    valid = load_corpus(corpus_file).valid
    for rank in (0, 1):
        shared = json.loads((two_processes / f"eval-{rank}.json").read_text())
        for result, options in zip(shared, ({}, {"max_chars": 21}), strict=True):
            alone = evaluate(_model(), valid, batch_size=4, block_size=8, dtype=dtype, **options)
            assert result["chars"] == alone["chars"]
            assert result["precision"] == alone["precision"]
            assert result["bpc"] == pytest.approx(alone["bpc"], abs=tolerance)
    run = two_processes / "run"  # the validation during training: the saved model, scored alone
    config = _config(corpus_file)
    alone = evaluate(load_model(run), valid, batch_size=config.batch_size,
                     block_size=config.block_size, max_chars=config.eval_chars, dtype=dtype)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 3 and last["precision"] == dtype
    assert last["valid_bpc"] == pytest.approx(alone["bpc"], abs=tolerance)


def test_the_ranks_of_a_job_are_one_writer_and_all_refused_together(two_processes, tmp_path,
                                                                     corpus_file):
    """Rank 0 holds the lock for the job (the ranks of :func:`_worker` trained together); a
    job resuming a run that another process writes is refused on every rank, the run left
    as it was."""
    run = two_processes / "run"
    before = load_file(run / "model.safetensors")
    lock = WriterLock(run)
    lock.acquire()
    try:
        run_processes(_refused_worker, (tmp_path / "store", corpus_file, run, tmp_path),
                      "the 2 refused processes")
    finally:
        lock.release()
    for rank in (0, 1):
        assert "is being written by another process" in (
            tmp_path / f"refused-{rank}.txt").read_text()
    after = load_file(run / "model.safetensors")
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def _load(run: Path, dist: Distributed):
    model = SpanLM(MODEL)
    optimizer = build_optimizer(model, _config("kjv"))
    return load_training_state(run, model, optimizer, build_scheduler(optimizer, _config("kjv")),
                               dist=dist)


def test_each_process_saves_and_resumes_its_part_of_the_cache(two_processes):
    run = two_processes / "run"
    state, part = read_state(run / STATE_FILE), read_state(run / PART)
    assert state["parts"] == 2 and (part["step"], part["rank"]) == (3, 1)
    assert [layer.shape[0] for layer in state["cache"] + part["cache"]] == [2] * 4  # 4 streams
    assert (run / ARCHIVE_DIR / "step-000000003" / PART).is_file()
    whole = StreamCache.merge([StreamCache(state["cache"]), StreamCache(part["cache"])])
    for world_size in (1, 2, 4):  # as saved, one process, and more processes than saved
        for rank in range(world_size):
            rows = Distributed(rank, world_size).rows(4)
            got = _load(run, Distributed(rank, world_size)).cache
            for layer, saved in zip(got.layers, whole.layers, strict=True):
                assert torch.equal(layer, saved[rows])
    _load(run, Distributed(1, 2))
    assert torch.equal(torch.get_rng_state(), part["rng"]["torch"])  # rank 1's own RNG state


def test_a_resume_reads_onto_the_cpu_and_moves_only_the_cache(two_processes):
    """The weights are copied into the model where it is, the optimiser's ``step`` counters
    stay on the CPU as torch.optim wants them (unless capturable or fused); ``meta`` stands
    for a GPU here."""
    model = SpanLM(MODEL)
    optimizer = build_optimizer(model, _config("kjv"))
    state = load_training_state(two_processes / "run", model, optimizer,
                                build_scheduler(optimizer, _config("kjv")), device="meta")
    assert {layer.device.type for layer in state.cache.layers} == {"meta"}
    assert {t.device.type for s in optimizer.state.values() for t in s.values()} == {"cpu"}
    saved = load_model(two_processes / "run").state_dict()
    assert all(torch.equal(t, saved[name]) for name, t in model.state_dict().items())


def test_a_missing_part_is_refused_in_one_line(two_processes, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for path in (two_processes / "run").iterdir():
        if path.is_file() and path.name != PART:
            (run / path.name).write_bytes(path.read_bytes())
    _load(run, Distributed(0, 2))  # rank 0's part is the state itself
    with pytest.raises(RunDirError, match=f"has no {PART}, the part .* rank 1 wrote") as refused:
        _load(run, Distributed(1, 2))
    assert "\n" not in str(refused.value)


def test_one_process_resumes_a_run_of_two(two_processes, corpus_file, tmp_path):
    """The weights match a run in one process all along (no dropout: the same arithmetic)."""
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for path in (two_processes / "run").iterdir():
        if path.is_file():
            (resumed / path.name).write_bytes(path.read_bytes())
    run_quietly(resumed, _config(corpus_file, steps=5), MODEL, resume=True)
    assert not list(resumed.glob("state.step-*"))  # its parts: superseded by a one-process state
    run_quietly(tmp_path / "alone", _config(corpus_file, steps=5), MODEL)
    alone = load_file(tmp_path / "alone" / "model.safetensors")
    for name, tensor in load_file(resumed / "model.safetensors").items():
        torch.testing.assert_close(tensor, alone[name], atol=1e-6, rtol=0)


# --- the device of each process ---------------------------------------------------------------


def test_a_numbered_gpu_is_refused_under_torchrun(corpus_file, tmp_path, monkeypatch):
    assert resolve_device("cpu", 1, 2) == torch.device("cpu")
    with pytest.raises(DeviceError, match=r"'cuda:1' .* 2 processes .* use device=cuda or auto$"):
        resolve_device("cuda:1", 1, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(DeviceError, match="use device=cuda or auto") as refused:
        train(MODEL, _config(corpus_file, device="cuda:0"), tmp_path / "run", progress=False)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("has_device_id", [True, False])
def test_the_process_group_is_bound_to_the_gpu_where_torch_can(monkeypatch, has_device_id):
    calls = []

    def new_torch(backend, *, device_id=None):
        calls.append((backend, device_id))

    def old_torch(backend):  # torch < 2.3
        calls.append((backend, None))

    monkeypatch.setattr(torch_dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch_dist, "init_process_group", new_torch if has_device_id else old_torch)
    monkeypatch.setattr(torch_dist, "get_backend", lambda group=None: calls[-1][0])
    monkeypatch.setattr(torch_dist, "new_group", lambda backend: calls.append(("new", backend)))
    monkeypatch.setattr(distributed, "_HOST_GROUP", [])
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(device))
    gpu = torch.device("cuda", 1)
    assert Distributed(1, 2, 1).start(gpu)  # and a gloo group for host values, made at once
    assert Distributed(0, 2, 0).start(torch.device("cpu"))  # gloo already: no second group
    assert not Distributed().start(torch.device("cpu"))  # one process: no group
    assert calls == [gpu, ("nccl", gpu if has_device_id else None), ("new", "gloo"),
                     ("gloo", None)]


def _fast_clock_worker(rank: int, store: Path, data: str, run: Path) -> None:
    """One of 2 processes training with a time budget; rank 1's clock runs 10,000 times fast,
    so that it alone finds the budget spent after the first step."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if rank == 1:
        real = train_module.time.monotonic
        train_module.time = type("Clock", (), {"monotonic": staticmethod(
            lambda: 10_000 * real())})
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                  world_size=2)
    try:
        run_quietly(run, _config(data, steps=50, lr_schedule="linear", lr_end_factor=0.5,
                                 warmup=0, time_budget=60.0), MODEL)
    finally:
        torch_dist.destroy_process_group()


def test_the_ranks_agree_on_the_time_budget_and_the_rate_it_sets(tmp_path, corpus_file):
    """Rank 1 alone sees its budget spent: both ranks stop after step 1 (else rank 0 would
    wait for rank 1 at step 2), and rank 0's optimiser ends at the schedule's end, paced by
    rank 1's share of the budget."""
    run = tmp_path / "run"
    run_processes(_fast_clock_worker, (tmp_path / "store", corpus_file, run),
                  "the 2 processes with a time budget")
    state = read_state(run / STATE_FILE, tensors=False)
    lrs = [group["lr"] for group in state["optimizer"]["param_groups"]]
    assert state["step"] == 1
    assert lrs == pytest.approx([0.5 * _config(corpus_file).lr] * len(lrs))
