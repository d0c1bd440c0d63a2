"""Never lose a run, never trust a file: kills at any moment, signals, hostile state files,
full disks, one-line errors, paths, file modes, and the memory estimate."""

from __future__ import annotations

import errno
import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TRAIN_MODEL
from safetensors.torch import load_file

from adaspan import ModelConfig, SpanLM, TrainConfig, train
from adaspan.cli import main
from adaspan.run.checkpoint import (
    LEGACY_STATE_FILE,
    STATE_FILE,
    RunDirError,
    load_model,
    load_training_state,
    read_state,
)
from adaspan.runtime.precision import choose
from adaspan.training.memory import estimate_training_memory, profiled_peak
from adaspan.training.optim import build_optimizer, build_scheduler
from adaspan.training.train import train_step

MODEL = TRAIN_MODEL
STEPS = 12
SRC = str(Path(__file__).resolve().parents[2] / "src")


def _options(data: str, **changes) -> dict:
    """A run's options, its precision always named (the child processes decide nothing)."""
    values = dict(data=data, batch_size=4, block_size=32, steps=STEPS, optimizer="adamw",
                  lr=3e-3, warmup=2, clip=1.0, eval_interval=4, eval_chars=64, log_interval=2,
                  checkpoint_interval=1, device="cpu", tensorboard=False, dtype="float32")
    return {**values, **changes}


def _overrides(options: dict) -> list[str]:
    model = [f"model.{k}={v}" for k, v in MODEL.to_dict().items()]
    return model + [f"train.{k}={v}" for k, v in options.items()]


@pytest.fixture(scope="module")
def reference_weights(corpus_file, tmp_path_factory):
    """The weights of an uninterrupted run in a dtype: ``reference_weights(dtype)``."""
    made: dict[str, dict[str, torch.Tensor]] = {}

    def weights(dtype: str) -> dict[str, torch.Tensor]:
        if dtype not in made:
            run = tmp_path_factory.mktemp("runs") / f"uninterrupted-{dtype}"
            train(MODEL, TrainConfig(**_options(corpus_file, dtype=dtype)), run,
                  progress=False, log=lambda m: None)
            made[dtype] = load_file(run / "model.safetensors")
        return made[dtype]

    return weights


def _assert_same_weights(run: Path, expected: dict[str, torch.Tensor]) -> None:
    weights = load_file(run / "model.safetensors")
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


# Run `adaspan train` in a child process that SIGKILLs itself either just before its n-th
# rename of a run file (n > 0; 3 per checkpoint, after the first config.json): inside a
# checkpoint write; or during its n-th training step, ``delay`` seconds after it begins. Each
# step is followed by a 50 ms pause, so a delay below that lands inside step n (in its
# computation or the pause after it), whatever the machine's speed.
_CHILD = """
import importlib, os, signal, sys, threading, time
checkpoint = importlib.import_module("adaspan.run.checkpoint")
training = importlib.import_module("adaspan.training.train")
target, kill_step, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
calls, steps, replace, step = [0], [0], os.replace, training.train_step
def kill():
    os.kill(os.getpid(), signal.SIGKILL)
def killing_replace(src, dst):
    calls[0] += os.path.basename(dst) in ("config.json", "model.safetensors", "state.safetensors")
    if target and calls[0] == target:
        kill()
    replace(src, dst)
def killing_step(*args, **kwargs):
    steps[0] += 1
    if steps[0] == kill_step:
        threading.Timer(delay, kill).start()
    result = step(*args, **kwargs)
    time.sleep(0.05)
    return result
checkpoint.os.replace, training.train_step = killing_replace, killing_step
from adaspan.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _child(args: list[str], kill_at_rename: int = 0, kill_in_step: int = 0,
           delay: float = 0.0) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(kill_at_rename),
                             str(kill_in_step), str(delay), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _resume(run: Path) -> None:
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0


@pytest.mark.parametrize("dtype, renames, in_steps", [
    ("float32", (2, 3, 4, 9, 20, 34), 6), ("bfloat16", (2, 4, 20), 3)])
def test_sigkill_at_any_moment_then_resume_is_bit_identical(tmp_path, corpus_file,
                                                            reference_weights, dtype, renames,
                                                            in_steps):
    """Kills inside checkpoint writes (before each of the three renames, the first checkpoint
    included: 6 in fp32, 3 in bf16) and at random moments of random training steps (6 and 3);
    every run resumes to the same weights as a run never interrupted, in fp32 as under bf16
    autocast, and no temporary file is left."""
    rng = random.Random(0)
    kills = [{"kill_at_rename": n} for n in renames]
    kills += [{"kill_in_step": rng.randint(1, STEPS - 1), "delay": rng.uniform(0.0, 0.05)}
              for _ in range(in_steps)]
    temporaries_seen = killed_in_training = 0
    for i, kill in enumerate(kills):
        run = tmp_path / f"run{i}"
        args = ["train", "--run-dir", str(run), "--no-progress", *_overrides(_options(
            corpus_file, dtype=dtype))]
        child = _child(args, **kill)
        child.communicate(timeout=120)
        assert child.returncode == -signal.SIGKILL, kill
        temporaries_seen += bool(list(run.glob(".*.tmp")))
        if not _finished(run):
            _resume(run)
            killed_in_training += 1
        _assert_same_weights(run, reference_weights(dtype))
        assert list(run.glob(".*.tmp")) == []
    assert temporaries_seen >= len(renames) - 2  # the kills inside writes left files to clean
    assert killed_in_training == len(kills)


def _finished(run: Path) -> bool:
    """Whether the run's last checkpoint is of its last step (killed after saving it)."""
    return (run / STATE_FILE).exists() and read_state(run / STATE_FILE)["step"] == STEPS


def _wait_for(path: Path, child: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sigterm_saves_and_resumes_exactly(tmp_path, corpus_file, reference_weights, dtype):
    run = tmp_path / "run"
    options = _options(corpus_file, checkpoint_interval=100, dtype=dtype)  # the signal saves
    child = _child(["train", "--run-dir", str(run), *_overrides(options)])
    _wait_for(run / "metrics.jsonl", child)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGTERM
    assert f"continue with `adaspan train --resume {run}`" in stderr
    assert "Traceback" not in stderr
    assert (run / STATE_FILE).exists()
    _resume(run)
    _assert_same_weights(run, reference_weights(dtype))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(
        tmp_path, corpus_file, reference_weights, dtype):
    run = tmp_path / "run"
    child = _child(["train", "--run-dir", str(run),
                    *_overrides(_options(corpus_file, dtype=dtype))],
                   kill_at_rename=2)  # the first checkpoint's first rename
    child.communicate(timeout=120)
    assert (run / "config.json").exists() and not (run / STATE_FILE).exists()
    _resume(run)
    _assert_same_weights(run, reference_weights(dtype))


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("name", [LEGACY_STATE_FILE, STATE_FILE])
def test_a_hostile_state_file_is_refused_and_its_payload_never_runs(tmp_path, corpus_file,
                                                                     name):
    run = tmp_path / "run"
    train(MODEL, TrainConfig(**_options(corpus_file, steps=2)), run, progress=False,
          log=lambda m: None)
    marker = tmp_path / "payload-ran"
    (run / STATE_FILE).unlink()
    (run / name).write_bytes(pickle.dumps({"step": 2, "evil": _Payload(marker)}, protocol=2))
    model = SpanLM(MODEL)
    optimizer = build_optimizer(model, TrainConfig(optimizer="adamw"))
    with pytest.raises(RunDirError) as refused:
        load_training_state(run, model, optimizer, build_scheduler(optimizer, TrainConfig()))
    assert not marker.exists()
    assert "weights_only" not in str(refused.value)
    assert "refused" in str(refused.value)


def test_a_full_disk_keeps_the_previous_checkpoint(tmp_path, corpus_file, monkeypatch,
                                                    capsys):
    run = tmp_path / "run"
    train(MODEL, TrainConfig(**_options(corpus_file, steps=4)), run, progress=False,
          log=lambda m: None)
    import adaspan.run.checkpoint as checkpoint

    def full(state, path):
        Path(path).write_bytes(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpoint, "_save_state", full)
    code = main(["train", "--resume", str(run), "--no-progress", "steps=6"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("adaspan: error: no space left on device while training in")
    assert "the checkpoint of step 4 is intact" in err[-1]
    monkeypatch.undo()
    model = SpanLM(MODEL)
    optimizer = build_optimizer(model, TrainConfig(optimizer="adamw"))
    state = load_training_state(run, model, optimizer, build_scheduler(optimizer, TrainConfig()))
    assert state.step == 4
    assert list(run.glob(".*.tmp")) == []


def _bad_inputs(tmp: Path, corpus: str) -> dict[str, tuple[list[str], str]]:
    """name -> (command line, what the one-line error says)."""
    run = tmp / "run"
    return {
        "device": (["evaluate", str(run), "--device", "foo"], "device must be auto, cpu"),
        "cuda": (["evaluate", str(run), "--device", "cuda"], "CUDA is not available"),
        "block-size": (["evaluate", str(run), "--block-size", "0"], "must be a positive"),
        "bench-steps": (["bench", "--steps", "0"], "must be a positive"),
        "fewer-steps": (["train", "--resume", str(run), "steps=1"], "nothing to train"),
        "corrupt-state": (["train", "--resume", str(tmp / "corrupt")], "cannot read"),
        "divergence": (["train", "--run-dir", str(tmp / "nan"), "--no-progress",
                        *_overrides(_options(corpus, lr=1e6, clip=0.0))],
                       "training diverged at step"),
        "no-run": (["evaluate", str(tmp / "missing")], "does not exist"),
        "resume-other-model": (["train", "--resume", str(run), "d_model=32"],
                               "cannot resume"),
    }


BAD_INPUTS = ["device", "cuda", "block-size", "bench-steps", "fewer-steps", "corrupt-state",
              "divergence", "no-run", "resume-other-model"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus_file) -> Path:
    tmp = tmp_path_factory.mktemp("bad")
    train(MODEL, TrainConfig(**_options(corpus_file, steps=3)), tmp / "run", progress=False,
          log=lambda m: None)
    corrupt = tmp / "corrupt"
    train(MODEL, TrainConfig(**_options(corpus_file, steps=2)), corrupt, progress=False,
          log=lambda m: None)
    (corrupt / STATE_FILE).write_bytes(b"not a state file")
    return tmp


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_end_with_one_line_and_exit_2(case, finished_run, corpus_file, capsys):
    if case == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    argv, says = _bad_inputs(finished_run, corpus_file)[case]
    with pytest.raises(SystemExit) if case in ("block-size", "bench-steps") else _no_raise():
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "error:" in last and says in last, last


class _no_raise:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_debug_shows_the_traceback(finished_run):
    with pytest.raises(ValueError, match="device must be"):
        main(["--debug", "evaluate", str(finished_run / "run"), "--device", "foo"])


def test_non_utf8_prompt_is_read_as_bytes(finished_run, capsys):
    prompt = os.fsdecode(b"caf\xe9 ")  # Latin-1, as a shell passes it
    assert main(["generate", str(finished_run / "run"), "--prompt", prompt, "--length", "5",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt"] == "caf\ufffd "


def test_paths_are_stored_resolved_and_the_run_works_from_elsewhere(tmp_path, corpus_file,
                                                                     monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "text.txt").write_bytes(Path(corpus_file).read_bytes())
    monkeypatch.chdir(data)
    main(["train", "--run-dir", str(tmp_path / "run"), "--no-progress",
          *_overrides(_options("text.txt", steps=2))])
    monkeypatch.chdir(tmp_path)
    assert main(["evaluate", "run", "--json", "--no-progress"]) == 0
    assert main(["train", "--resume", "run", "--no-progress", "steps=3",
                 f"data={data / 'text.txt'}"]) == 0  # the same file, written another way
    assert '"steps": 3' in capsys.readouterr().out


def test_run_files_share_one_mode(tmp_path, corpus_file):
    train(MODEL, TrainConfig(**_options(corpus_file, steps=2)), tmp_path / "run",
          progress=False, log=lambda m: None)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (tmp_path / "run").iterdir()
             if path.is_file()}
    umask = os.umask(0)
    os.umask(umask)
    assert set(modes.values()) == {0o666 & ~umask}, modes


@pytest.mark.parametrize(("changes", "batch", "block", "optimizer", "dtype"), [
    ({}, 4, 64, "adamw", "float32"),
    ({}, 4, 64, "adamw", "bfloat16"),
    ({"d_model": 64, "n_heads": 4, "d_inner": 256, "max_span": 256}, 8, 128, "adagrad",
     "float32"),
    ({"d_model": 64, "n_heads": 4, "d_inner": 256, "max_span": 256}, 8, 128, "adagrad",
     "bfloat16"),
    ({"d_model": 32, "n_heads": 4, "n_layers": 3, "attention": "fixed", "max_span": 128}, 6,
     96, "adamw", "float32"),
])
def test_memory_estimate_is_within_a_quarter_of_the_measured_peak(changes, batch, block,
                                                                  optimizer, dtype):
    """The estimate of a step in its precision (bf16 autocast: bf16 activations and weight
    copies) against the peak of that step."""
    config = ModelConfig(**{**MODEL.to_dict(), **changes})
    torch.manual_seed(0)
    model = SpanLM(config)
    train_config = TrainConfig(batch_size=batch, block_size=block, optimizer=optimizer,
                               lr=1e-3, warmup=0, dtype=dtype)
    estimate = estimate_training_memory(model, optimizer, batch, block,
                                        precision=choose(dtype, torch.device("cpu")))
    optimizer_ = build_optimizer(model, train_config)
    scheduler = build_scheduler(optimizer_, train_config)
    x = torch.randint(0, 256, (batch, block))
    cache = _full_cache(model, batch)
    peak = profiled_peak(lambda: train_step(model, optimizer_, scheduler, x, x, cache,
                                            train_config))
    measured = estimate.weights + peak
    assert abs(estimate.total - measured) <= 0.25 * measured, (estimate, measured)


def _full_cache(model: SpanLM, batch: int):
    from adaspan.attention.cache import StreamCache

    return StreamCache([torch.zeros(batch, model.config.max_span, model.config.d_model)
                        for _ in model.layers])


def test_keep_last_keeps_the_newest_checkpoints_loadable(tmp_path, corpus_file):
    run = tmp_path / "run"
    train(MODEL, TrainConfig(**_options(corpus_file, steps=7, checkpoint_interval=2,
                                        keep_last=2)), run, progress=False, log=lambda m: None)
    kept = sorted(path.name for path in (run / "checkpoints").iterdir())
    assert kept == ["step-000000006", "step-000000007"]
    older = load_model(run / "checkpoints" / kept[0])
    newest = load_model(run)
    assert not torch.equal(older.embed.weight, newest.embed.weight)
    assert torch.equal(load_model(run / "checkpoints" / kept[1]).embed.weight,
                       newest.embed.weight)


def test_an_unwritable_run_directory_is_one_line(tmp_path, corpus_file, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["train", "--run-dir", str(blocker / "run"), "--no-progress",
            *_overrides(_options(corpus_file, steps=1))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("adaspan: error: Not a directory")


def _read_only(folder: Path, monkeypatch) -> None:
    """Make ``folder`` refuse new files: by its mode, or (as root, whom modes do not stop) by
    refusing the creation of files in it as a read-only file system would."""
    folder.chmod(0o555)
    if os.geteuid() != 0:
        return
    touch = Path.touch

    def refused(path: Path, *args, **kwargs) -> None:
        if path.parent == folder:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        touch(path, *args, **kwargs)

    monkeypatch.setattr(Path, "touch", refused)


def test_a_read_only_run_directory_is_refused_before_training(finished_run, tmp_path,
                                                              corpus_file, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run / "run", run)
    files = sorted(path.name for path in run.iterdir())
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for folder in (run, fresh):
        _read_only(folder, monkeypatch)
    try:
        assert main(["train", "--resume", str(run), "steps=6", "--no-progress"]) == 2
        assert capsys.readouterr().err == (
            f"adaspan: error: run directory {run} is not writable "
            f"({os.strerror(errno.EROFS if os.geteuid() == 0 else errno.EACCES)}); "
            "choose another directory or make it writable\n")
        assert sorted(path.name for path in run.iterdir()) == files  # nothing written
        for target, says in ((fresh, f"run directory {fresh} is not writable"),
                             (fresh / "new" / "run", f"run directory {fresh / 'new' / 'run'} "
                              f"cannot be created: {fresh} is not writable")):
            argv = ["train", "--run-dir", str(target), "--no-progress",
                    *_overrides(_options(corpus_file, steps=1))]
            assert main(argv) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"adaspan: error: {says}") and err.count("\n") == 1
        assert list(fresh.iterdir()) == []
    finally:
        run.chmod(0o755)
        fresh.chmod(0o755)


def test_missing_matplotlib_is_one_line(finished_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["inspect", str(finished_run / "run"), "--plot", str(tmp_path)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("adaspan: error: plots need matplotlib")


def test_a_hostile_checkpoint_of_the_authors_is_refused(tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    hostile = tmp_path / "model.pt"
    hostile.write_bytes(pickle.dumps({"model": _Payload(marker)}, protocol=2))
    assert main(["convert-official", str(hostile), str(tmp_path / "out"), "--data",
                 str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert not marker.exists()
    assert "could run code" in err and "weights_only" not in err
