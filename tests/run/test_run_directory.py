"""A run directory that one process writes and that checks its own files: a second writer is
refused, a killed writer blocks nothing, a config.json that disagrees with its weights is
refused before anything is allocated, a full disk is refused before training or reported with
the step that is safe, and a failed allocation is the user's (one line, status 2)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TRAIN_MODEL, run_quietly, tiny_train_config
from safetensors import SafetensorError

from adaspan import SpanLM, TrainConfig
from adaspan.cli import main
from adaspan.run import checkpoint, disk
from adaspan.run.checkpoint import STATE_FILE, WEIGHTS_FILE, RunDir, load_model
from adaspan.run.disk import DiskFullError, check_disk_space, checkpoint_bytes
from adaspan.run.lock import WRITER_FILE, RunLockedError, WriterLock
from adaspan.training.train import _Loop

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _options(data: str, **changes) -> TrainConfig:
    """4 steps of the tiny run, saved at steps 2 and 4."""
    return tiny_train_config(data, **{"steps": 4, "checkpoint_interval": 2, **changes})


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus_file) -> Path:
    run = tmp_path_factory.mktemp("runs") / "run"
    run_quietly(run, _options(corpus_file))
    return run


def _files(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file()}


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that takes the writer lock of ``folder`` and waits (says "locked")."""
    code = ("import sys, time; from pathlib import Path; "
            "from adaspan.run.lock import WriterLock; "
            "WriterLock(Path(sys.argv[1])).acquire(); print('locked', flush=True); "
            "time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code, str(folder)], text=True,
                             stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC})
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_second_writer_exits_2_with_one_line_and_leaves_the_run_intact(finished, capsys):
    before = _files(finished)
    child = _holder(finished)
    try:
        code = main(["train", "--resume", str(finished), "--no-progress", "steps=6"])
    finally:
        child.kill()
        child.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and f"pid {child.pid}" in err[0], err
    assert "being written by another process" in err[0]
    after = _files(finished)
    after.pop(WRITER_FILE, None)  # the killed holder's note, read by no one but the message
    assert after == before


def test_a_writer_killed_with_sigkill_blocks_nothing(finished):
    child = _holder(finished)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (finished / WRITER_FILE).read_text().strip() == str(child.pid)  # left behind
    lock = WriterLock(finished)
    lock.acquire()  # released by the operating system with the process
    lock.release()
    assert main(["train", "--resume", str(finished), "--no-progress", "steps=6"]) == 0
    assert RunDir(finished).saved_step() == 6


def test_a_killed_training_run_resumes(tmp_path, corpus_file):
    """A real ``adaspan train`` killed with SIGKILL after its first checkpoint: the next
    resume takes the lock and finishes."""
    run = tmp_path / "run"
    options = _options(corpus_file, steps=400, checkpoint_interval=1)
    args = [f"model.{k}={v}" for k, v in TRAIN_MODEL.to_dict().items()]
    args += [f"train.{k}={v}" for k, v in options.to_dict().items()]
    child = subprocess.Popen([sys.executable, "-m", "adaspan.cli", "train", "--run-dir",
                              str(run), "--no-progress", *args],
                             env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (run / STATE_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    child.send_signal(signal.SIGKILL)
    child.wait()
    step = RunDir(run).saved_step()
    assert step is not None
    assert main(["train", "--resume", str(run), "--no-progress", f"steps={step + 2}"]) == 0
    assert RunDir(run).saved_step() == step + 2
    assert not (run / WRITER_FILE).exists()  # released at the end


def test_the_lock_is_taken_and_released_around_a_training_call(tmp_path, corpus_file):
    run = tmp_path / "run"
    seen = []
    original = _Loop.run_steps

    def run_steps(self):
        with pytest.raises(RunLockedError):
            WriterLock(run).acquire()  # held by this call, on another descriptor
        seen.append((run / WRITER_FILE).read_text().strip())
        return original(self)

    _Loop.run_steps = run_steps
    try:
        run_quietly(run, _options(corpus_file, steps=2))
    finally:
        _Loop.run_steps = original
    assert seen == [str(os.getpid())]
    lock = WriterLock(run)
    lock.acquire()  # released
    lock.release()


def _edit_config(run: Path, **model) -> None:
    saved = json.loads((run / "config.json").read_text())
    saved["model"].update(model)
    (run / "config.json").write_text(json.dumps(saved))


@pytest.mark.parametrize("command", [["evaluate", "{run}", "--max-chars", "64"],
                                     ["generate", "{run}", "--length", "4"],
                                     ["train", "--resume", "{run}", "--no-progress", "steps=8"]])
def test_a_config_that_disagrees_with_its_weights_gets_one_line(tmp_path, finished, capsys,
                                                                 monkeypatch, command):
    run = tmp_path / "run"
    run.mkdir()
    for path in finished.iterdir():
        if path.is_file():
            (run / path.name).write_bytes(path.read_bytes())
    _edit_config(run, d_model=10_000_000, n_heads=8)
    built = []
    monkeypatch.setattr(SpanLM, "__init__", _recording(SpanLM.__init__, built))
    code = main([part.format(run=run) for part in command])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "config.json does not match the weights saved beside it" in err[0]
    assert "in model.safetensors" in err[0]
    assert all(device == "meta" for device in built)  # nothing built on a real device


def _recording(init, built: list):
    def recording_init(self, config):
        built.append(torch.get_default_device().type)
        init(self, config)
    return recording_init


def test_weights_of_another_model_are_refused_before_loading(finished, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.json", WEIGHTS_FILE):
        (run / name).write_bytes((finished / name).read_bytes())
    assert load_model(run).config == TRAIN_MODEL
    _edit_config(run, n_layers=TRAIN_MODEL.n_layers + 1)
    with pytest.raises(checkpoint.RunDirError, match=r"layers\.\d+\..* missing in"):
        load_model(run)


def test_the_checkpoint_estimate_bounds_what_is_written(finished):
    model = load_model(finished)
    _, config = RunDir(finished).load_config()
    written = (finished / WEIGHTS_FILE).stat().st_size + (finished / STATE_FILE).stat().st_size
    estimate = checkpoint_bytes(model, config)
    assert written <= estimate <= 1.25 * written + 200_000


def test_too_little_disk_is_refused_before_training(tmp_path, corpus_file, monkeypatch):
    free = {"bytes": 0}
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda path: _usage(free["bytes"]))
    run = tmp_path / "run"
    with pytest.raises(DiskFullError, match=r"needs [\d.,]+ MB free for its checkpoints"):
        run_quietly(run, _options(corpus_file))
    assert not run.exists()
    model = SpanLM(TRAIN_MODEL)
    free["bytes"] = 2 * checkpoint_bytes(model, _options(corpus_file))
    assert check_disk_space(RunDir(run), model, _options(corpus_file), resuming=False) \
        == free["bytes"]
    with pytest.raises(DiskFullError):  # keep_last keeps older checkpoints too
        check_disk_space(RunDir(run), model, _options(corpus_file, keep_last=1), False)


def _usage(free: int) -> shutil._ntuple_diskusage:
    return shutil._ntuple_diskusage(total=10 * free + 1, used=0, free=free)


def test_a_full_disk_in_a_library_s_words_gets_one_line_with_the_safe_step(
        tmp_path, corpus_file, monkeypatch, capsys):
    """safetensors reports ENOSPC as its own error, not an OSError: still the user's."""
    run = tmp_path / "run"
    run_quietly(run, _options(corpus_file))

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: "
                              "StorageFull, message: \"No space left on device\" })")

    monkeypatch.setattr(checkpoint, "save_file", full)
    code = main(["train", "--resume", str(run), "--no-progress", "steps=6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "no space left on device" in err[0] and "step 4 is intact" in err[0]
    monkeypatch.undo()
    assert RunDir(run).saved_step() == 4
    load_model(run)


def test_a_failed_allocation_is_one_line_and_status_2(monkeypatch, capsys, finished):
    def huge(*args, **kwargs):
        torch.empty(2**45, dtype=torch.uint8)  # more than any machine here: the allocator fails

    monkeypatch.setattr(checkpoint, "load_weights", huge)
    code = main(["evaluate", str(finished), "--max-chars", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("adaspan: error: out of memory: 35184.4 GB could not be allocated")
