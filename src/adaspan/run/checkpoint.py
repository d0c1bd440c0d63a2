"""Run directories: one object, :class:`RunDir`, that names a run's files, holds its
configuration, opens it to train (a new run, or a resumed one: every check in one place), and
saves, archives and restores its checkpoints, written atomically (:mod:`adaspan.data.files`).

Layout of a run directory::

    config.json         model and train configuration, adaspan version
    model.safetensors   weights, with the training step in the metadata
    state.safetensors   step, data position, carried cache, optimiser, scheduler, RNG states:
                        tensors, with everything else as JSON in the metadata
    state.step-N.rank-R.safetensors
                        under torchrun, the carried cache rows and RNG state of rank R >= 1
                        (rank 0's are in state.safetensors), written by that process
    metrics.jsonl       one JSON object per log/eval event (:mod:`adaspan.run.metrics`)
    tb/                 TensorBoard events (when tensorboard is installed)
    checkpoints/        step-N/: the last ``keep_last`` checkpoints (hard links), if asked
    report/             what ``adaspan report`` writes by default
    vocab.json          a run converted from the authors' code: its symbols
    (adaspan.training.official)

Nothing is read with pickle, so a run directory from elsewhere cannot run code (the
``state.pt`` of adaspan 0.1-0.2 runs is read with ``torch.load(weights_only=True)``).

Each file of a checkpoint is written to a temporary file in the run directory, flushed and
fsynced; only then are all of them renamed into place, one right after the other, the training
state last. The state holds the weights too and is all that resuming reads, so a save
interrupted at any moment leaves one consistent checkpoint, the previous or the new one (its
temporary files are removed at the next start). Under torchrun every rank first writes its part
of the state, named by the step, so that the previous checkpoint's parts stay until the new
state that counts the new ones is in place.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .._version import __version__, version_tuple
from ..attention.cache import StreamCache
from ..config import ConfigError, ModelConfig, TrainConfig
from ..data.corpora import resolve_data
from ..data.files import TEMP_SUFFIX, atomic_write, existing_ancestor, load_pickled_tensors
from ..errors import UserError, one_line
from ..model.lm import SpanLM
from ..runtime.distributed import Distributed
from .lock import WRITER_FILE, WriterLock, hold
from .metrics import MetricsLog

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
LEGACY_STATE_FILE = "state.pt"  # adaspan 0.1-0.2
PART_FILE = re.compile(r"state\.step-(\d+)\.rank-(\d+)\.safetensors")  # a rank's part of the state
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
ARCHIVE_DIR = "checkpoints"  # earlier checkpoints kept with TrainConfig.keep_last
REPORT_DIR = "report"
VOCAB_FILE = "vocab.json"  # a converted run's symbols
TOKENIZER_FILE = "tokenizer.json"  # the run's tokenizer (adaspan.data.tokenizer); none: bytes
NEW_RUN_ADVICE = "pass --resume to continue that run, or choose another directory"

Writer = Callable[[Path], None]  # writes one file, given the path to write it to


class RunDirError(UserError):
    """A run directory is missing, incomplete, inconsistent or would be overwritten."""


@dataclass
class TrainingState:
    """Where a training run stands: what resuming needs besides weights and optimiser."""

    step: int  # optimiser steps done
    position: int  # index of the next training block
    cache: StreamCache  # carried hidden states of this rank's streams (its batch rows)
    elapsed: float = 0.0  # seconds of training so far


@dataclass(frozen=True)
class RunComplete:
    """A run resumed at the step it was asked to reach: nothing to train, and not an error (the
    run is left as it is). ``str()`` says so, with the ``steps`` that would continue it."""

    run_dir: Path
    step: int

    def __str__(self) -> str:
        return (f"{self.run_dir} is complete at step {self.step}; pass steps={2 * self.step} "
                "to continue")


class RunDir:
    """A run directory: its files, configuration, opening to train, checkpoints; str(): path."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.config_file = self.path / CONFIG_FILE
        self.weights_file = self.path / WEIGHTS_FILE
        self.state_file = self.path / STATE_FILE
        self.metrics_file = self.path / METRICS_FILE
        self.tensorboard_dir = self.path / TENSORBOARD_DIR
        self.archive_dir = self.path / ARCHIVE_DIR
        self.report_dir = self.path / REPORT_DIR
        self.vocab_file = self.path / VOCAB_FILE
        self.tokenizer_file = self.path / TOKENIZER_FILE
        self._lock: WriterLock | None = None

    @classmethod
    def of(cls, run_dir: RunDir | str | os.PathLike) -> RunDir:
        """``run_dir`` itself where it is a RunDir (passed on), else the one at that path."""
        return run_dir if isinstance(run_dir, RunDir) else cls(run_dir)

    def __fspath__(self) -> str:
        return str(self.path)

    __str__ = __fspath__

    def part_file(self, step: int, rank: int) -> Path:
        """Where rank ``rank`` (>= 1) writes its part of the state of step ``step``."""
        return self.path / f"state.step-{step:09d}.rank-{rank}.safetensors"

    def parts(self) -> dict[Path, int]:
        """The ranks' parts of the state in the directory, with their steps."""
        return {path: int(match[1]) for path in self.path.glob("state.step-*.rank-*.safetensors")
                if (match := PART_FILE.fullmatch(path.name))}

    def load_config(self) -> tuple[ModelConfig, TrainConfig]:
        """The model and train configurations saved here (an invalid one: RunDirError)."""
        saved = _read_config(self)
        try:
            return ModelConfig.from_dict(saved["model"]), TrainConfig.from_dict(saved["train"])
        except ConfigError as exc:
            raise RunDirError(f"{self.config_file}: {exc}") from exc

    def require_new(self, advice: str = NEW_RUN_ADVICE) -> None:
        """Refuse a path that exists and is not an empty directory (the message ends with
        ``advice``), or where no file can be written: RunDirError."""
        if self.path.exists() and (not self.path.is_dir() or any(
                path.name != WRITER_FILE for path in self.path.iterdir())):
            raise RunDirError(f"run directory {self} already exists and is not empty: {advice}")
        _check_writable(self.path)

    def open(self, model_config: ModelConfig, config: TrainConfig, resume: bool,
             dist: Distributed) -> RunComplete | None:
        """Check, before anything is loaded or written, that training may start here: a new
        run (:meth:`require_new`), or with ``resume`` one that exists, was set up alike (the
        model, and the options fixed on resume), is writable and has steps left before
        ``config.steps`` (a run at exactly ``steps`` is :class:`RunComplete`, returned; past
        them, RunDirError). Then it takes the writer lock (:func:`~adaspan.run.lock.hold`;
        :meth:`close` releases it) and, once every rank has checked, rank 0 removes what an
        interrupted save left."""
        if not resume:
            self.require_new()
        else:
            _check_settings(self, model_config, config)
            check_weights(self, model_config)
            _check_writable(self.path)
            step = self.saved_step()
            if step is not None and step >= config.steps:
                if step == config.steps:
                    return RunComplete(self.path, step)
                raise RunDirError(f"{self} is at step {step:,}, steps={config.steps:,}: nothing "
                                  "to train; pass a larger steps=N to continue it")
        self._lock = hold(self.path, dist)  # one writer: before anything is written
        dist.barrier()  # every rank has checked the run directory before rank 0 writes to it
        if dist.is_main and self.path.is_dir():
            _remove_temporaries(self)
        return None

    def close(self) -> None:
        """Release the writer lock that :meth:`open` took, if it did."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def create(self, model_config: ModelConfig, train_config: TrainConfig,
               weights: dict[str, torch.Tensor] | None = None, step: int = 0,
               files: dict[Path, Writer] | None = None) -> None:
        """Make the directory and write its configuration, with ``weights`` (saved at
        ``step``) and any other ``files``, atomically together."""
        self.path.mkdir(parents=True, exist_ok=True)
        writers = {self.config_file: _config_writer(model_config, train_config)}
        if weights is not None:
            writers[self.weights_file] = _weights_writer(weights, step)
        atomic_write({**writers, **(files or {})})

    def restore(self, model: SpanLM, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler,
                device: str | torch.device = "cpu",
                dist: Distributed | None = None) -> TrainingState | None:
        """The training state of the checkpoint, loaded into ``model``, ``optimizer`` and
        ``scheduler`` (:func:`load_training_state`); None for a run stopped before its first
        checkpoint."""
        if not self.has_checkpoint():
            return None
        return load_training_state(self, model, optimizer, scheduler, device, dist)

    def has_checkpoint(self) -> bool:
        """Whether the directory holds weights and training state to resume from."""
        return self.weights_file.is_file() and self.state_path() is not None

    def saved_step(self) -> int | None:
        """The step of the checkpoint, read without loading its tensors; None without one."""
        if not self.has_checkpoint():
            return None
        return int(read_state(self.state_path(), tensors=False)["step"])

    def save(self, model: SpanLM, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, state: TrainingState,
             train_config: TrainConfig, dist: Distributed | None = None) -> None:
        """Write config, weights and training ``state`` atomically, every rank of ``dist`` its
        part (:func:`_save_checkpoint`)."""
        _save_checkpoint(self, model, optimizer, scheduler, state, train_config,
                         dist if dist is not None else Distributed())

    def archive(self, step: int, keep_last: int) -> Path:
        """Link the latest checkpoint's files into ``checkpoints/step-N`` and delete all but
        the ``keep_last`` newest there; return the new folder."""
        folder = self.archive_dir / f"step-{step:09d}"
        folder.mkdir(parents=True, exist_ok=True)
        parts = [path for path, part_step in self.parts().items() if part_step == step]
        for path in (self.config_file, self.weights_file, self.state_file, *parts):
            target = folder / path.name
            target.unlink(missing_ok=True)
            os.link(path, target)  # the run's files are replaced, never rewritten
        for old in sorted(self.archive_dir.glob("step-*"))[:-keep_last]:
            shutil.rmtree(old)
        return folder

    def metrics_log(self, start_step: int, tensorboard: bool) -> MetricsLog:
        """The run's metrics records (and TensorBoard events, if asked), resumed at
        ``start_step``."""
        return MetricsLog(self.metrics_file, start_step,
                          self.tensorboard_dir if tensorboard else None)

    def state_path(self) -> Path | None:
        """The training state: ``state.safetensors``, or the ``state.pt`` of a 0.1-0.2 run."""
        for path in (self.state_file, self.path / LEGACY_STATE_FILE):
            if path.is_file():
                return path
        return None


def _remove_temporaries(run: RunDir) -> None:
    """Delete the temporary files that an interrupted atomic write left, and the ranks'
    parts of the state that an interrupted or superseded checkpoint left."""
    for path in run.path.glob(f".*{TEMP_SUFFIX}"):
        if path.is_file():
            path.unlink(missing_ok=True)
    last = run.saved_step()
    _remove_parts(run, keep=lambda step: step == last)


def _remove_parts(run: RunDir, keep: Callable[[int], bool]) -> None:
    for path, step in run.parts().items():
        if not keep(step):
            path.unlink(missing_ok=True)


def _json_writer(payload: dict) -> Writer:
    return lambda path: path.write_text(json.dumps(payload, indent=2) + "\n")


def _config_writer(model_config: ModelConfig, train_config: TrainConfig) -> Writer:
    """``config.json``: both configurations (dataclasses) and the adaspan version."""
    return _json_writer({
        "adaspan_version": __version__,
        "model": model_config.to_dict(),
        "train": train_config.to_dict(),
    })


def _weights_writer(weights: dict[str, torch.Tensor], step: int) -> Writer:
    """``model.safetensors``: the weights, with the step they were saved at in the metadata."""
    return lambda path: save_file(weights, path, metadata={"step": str(step)})


def _read_config(run: RunDir) -> dict:
    """The contents of ``config.json``: ``model`` and ``train`` dicts, ``adaspan_version``;
    the options added since adaspan 0.1 get the value that version had."""
    path = _require_file(run, run.config_file)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RunDirError(f"cannot read {path}: {exc}") from exc
    if not (isinstance(config, dict)
            and all(isinstance(config.get(table), dict) for table in ("model", "train"))):
        raise RunDirError(f"{path} must hold 'model' and 'train' tables")
    config["model"].setdefault("position_table", "layer")  # adaspan 0.1: one table per layer
    config["train"].setdefault("clip_mode", "global")  # ... and the global gradient norm clipped
    _refuse_positionless_grouped_heads(path, config)
    return config


def _refuse_positionless_grouped_heads(path: Path, config: dict) -> None:
    """A run of grouped-query heads with the table of positions saved before 0.13.0, whose
    layers read no table: this version's layers read it, so its weights would compute another
    function (RunDirError)."""
    model, version = config["model"], str(config.get("adaspan_version", "0"))
    grouped = model.get("kv_heads") not in (None, model.get("n_heads"))
    if grouped and model.get("position_table") != "rotary" and version_tuple(version) < (0, 13):
        raise RunDirError(
            f"{path}: saved by adaspan {version}, whose grouped-query layers (kv_heads) read no "
            "position table; from 0.13.0 they read it, so these weights would compute another "
            "model: train it again, or use adaspan 0.12 for this run")


def stored_form(config: TrainConfig) -> TrainConfig:
    """``config`` as a run directory stores it: corpus paths absolute (a built-in corpus keeps
    its name), so that the run can be evaluated and resumed from any working directory."""
    data_dir = (None if config.data_dir is None
                else str(Path(config.data_dir).expanduser().resolve()))
    tokenizer_file = (None if config.tokenizer_file is None
                      else str(Path(config.tokenizer_file).expanduser().resolve()))
    return replace(config, data=resolve_data(config.data), data_dir=data_dir,
                   tokenizer_file=tokenizer_file)


def new_run_dir(name: str) -> Path:
    """``runs/NAME-YYYYmmdd-HHMMSS``: where a run goes when no directory is given."""
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _check_settings(run: RunDir, model_config: ModelConfig, config: TrainConfig) -> None:
    """Refuse to resume a run that is missing or was set up differently: another model, or
    another value of an option that must stay fixed on resume."""
    if not run.config_file.is_file():
        raise RunDirError(f"nothing to resume in {run}: it is not a run directory (no "
                          f"{CONFIG_FILE})")
    saved_model, saved_train = run.load_config()
    saved = saved_model.to_dict()
    changed = [f"model.{name}={value!r} (saved: {saved[name]!r})"
               for name, value in model_config.to_dict().items() if saved[name] != value]
    changed += [f"train.{name}={getattr(config, name)!r} "
                f"(saved: {getattr(saved_train, name)!r})"
                for name in TrainConfig.fixed_on_resume()
                if not _same_option(name, getattr(saved_train, name), getattr(config, name))]
    if changed:
        raise RunDirError(f"cannot resume {run} with different settings: {'; '.join(changed)}")


def _check_writable(run_dir: Path) -> None:
    """Create and remove a file in ``run_dir`` (or, for one not made yet, in the folder it
    will be made in): RunDirError if that is not permitted, before training starts."""
    folder = existing_ancestor(run_dir)
    if not folder.is_dir():
        return  # a file in the way: making the directory says so
    probe = folder / f".write-test.{uuid.uuid4().hex}{TEMP_SUFFIX}"
    try:
        probe.touch(exist_ok=False)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        what = (f"is not writable ({exc.strerror})" if folder == run_dir else
                f"cannot be created: {folder} is not writable ({exc.strerror})")
        raise RunDirError(f"run directory {run_dir} {what}; choose another directory or make "
                          "it writable") from None
    probe.unlink(missing_ok=True)


def _same_option(name: str, saved: object, value: object) -> bool:
    """Whether a train option keeps its saved value (corpus paths compared resolved)."""
    if name == "data" and isinstance(saved, str) and isinstance(value, str):
        return resolve_data(saved) == resolve_data(value)
    return saved == value


def _save_checkpoint(run: RunDir, model: SpanLM, optimizer: torch.optim.Optimizer,
                     scheduler: torch.optim.lr_scheduler.LRScheduler, state: TrainingState,
                     train_config: TrainConfig, dist: Distributed) -> None:
    """Write config, weights and training ``state`` of ``run`` atomically.

    The training state holds the weights too, and is renamed into place last: a run killed at
    any moment resumes from one consistent checkpoint, the previous or the new one.

    Every rank of ``dist`` calls it with the cache of its own streams: each rank > 0 writes
    that and its RNG state to its part of the state, then rank 0 the rest (with its own cache
    and RNG state), counting the parts; the parts of earlier steps are removed.
    """
    step, cache = state.step, state.cache.to("cpu").layers
    if not dist.is_main:
        part = {"step": step, "rank": dist.rank, "cache": cache, "rng": rng_state()}
        atomic_write({run.part_file(step, dist.rank): lambda path: _save_state(part, path)})
    dist.barrier()  # every part is in place before the state that counts them
    if not dist.is_main:
        return
    # safetensors wants contiguous tensors that share no memory: clone them to the CPU.
    weights = {name: t.detach().to("cpu", copy=True).contiguous()
               for name, t in model.state_dict().items()}
    saved = {
        "step": step,
        "position": state.position,
        "elapsed": state.elapsed,
        "cache": cache,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": [rng_state()],
        "parts": dist.world_size,  # rank 0's part is "cache" and "rng"; the others' in files
        "model": weights,
    }
    atomic_write({  # the state, which alone is read to resume, is renamed into place last
        run.config_file: _config_writer(model.config, train_config),
        run.weights_file: _weights_writer(weights, step),
        run.state_file: lambda path: _save_state(saved, path),
    })
    (run.path / LEGACY_STATE_FILE).unlink(missing_ok=True)  # superseded (a resumed 0.2 run)
    _remove_parts(run, keep=lambda part_step: part_step >= step)  # superseded


def load_model(run_dir: RunDir | str | os.PathLike, device: str | torch.device = "cpu") -> SpanLM:
    """The model saved in ``run_dir`` (its config and latest weights), in eval mode."""
    run = RunDir.of(run_dir)
    config = run.load_config()[0]
    check_weights(run, config)
    model = SpanLM(config)
    load_weights(run, model)
    return model.to(device).eval()


def load_weights(run_dir: RunDir | str | os.PathLike, model: SpanLM) -> int:
    """Load the weights of ``run_dir`` into ``model``; return the step they were saved at."""
    run = RunDir.of(run_dir)
    path = _require_file(run, run.weights_file)
    try:
        with safe_open(path, framework="pt") as weights:
            step = int((weights.metadata() or {}).get("step", -1))
        tensors = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise RunDirError(f"cannot read {path}: {exc}") from exc
    _load_state_dict(model, tensors, path)
    return step


def check_weights(run: RunDir, model_config: ModelConfig) -> None:
    """Refuse, before anything is allocated, a configuration that disagrees with the run's
    saved weights (a hand-edited config.json, another version): the tensors' shapes of a model
    built on the meta device against those in the weights file's header (RunDirError)."""
    if not run.weights_file.is_file():
        return
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in SpanLM(model_config).state_dict().items()}
    try:
        with safe_open(run.weights_file, framework="pt") as weights:
            saved = {name: tuple(weights.get_slice(name).get_shape()) for name in weights.keys()}  # noqa: SIM118
    except (OSError, SafetensorError) as exc:
        raise RunDirError(f"cannot read {run.weights_file}: {one_line(exc)}") from exc
    differ = [f"{name} {saved.get(name, 'missing')} in {WEIGHTS_FILE}, {shape} by {CONFIG_FILE}"
              for name, shape in expected.items() if saved.get(name) != shape]
    differ += [f"{name} is in {WEIGHTS_FILE}, not in the model of {CONFIG_FILE}"
               for name in saved.keys() - expected.keys()]
    if differ:
        raise RunDirError(f"{run.config_file} does not match the weights saved beside it "
                          f"({len(differ)} tensors differ; {differ[0]}): was it edited?")


def _load_state_dict(model: SpanLM, tensors: dict, path: Path) -> None:
    try:
        model.load_state_dict(tensors)
    except RuntimeError as exc:
        raise RunDirError(f"{path} does not match the model of {CONFIG_FILE}: {exc}") from exc


def load_training_state(
    run_dir: str | os.PathLike,
    model: SpanLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: str | torch.device = "cpu",
    dist: Distributed | None = None,
) -> TrainingState:
    """Restore weights, optimiser, scheduler and the RNG state of this rank of ``dist`` from
    ``run_dir``; the state returned holds the carried cache of this rank's streams, on
    ``device``.

    Everything is read onto the CPU: the weights are copied into the model where it is, and
    the optimiser puts its state where torch.optim wants it (``step`` counters stay on the
    CPU). A run saved by as many processes reads only its own part; one saved by another
    number of processes reads the parts that hold its streams' cache rows.
    """
    run = RunDir.of(run_dir)
    dist = dist if dist is not None else Distributed()
    path = run.state_path() or _require_file(run, run.state_file)
    state = read_state(path)
    if "model" in state:
        _load_state_dict(model, state["model"], path)
    elif (weights_step := load_weights(run, model)) != state["step"]:  # a 0.1-0.2 run
        raise RunDirError(
            f"{run} is inconsistent: weights are from step {weights_step}, training state "
            f"from step {state['step']} (a save was cut short); restore a backup or start over"
        )
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    cache, rng = _rank_part(run, state, dist)
    set_rng_state(rng)
    return TrainingState(state["step"], state["position"], cache.to(device), state["elapsed"])


def _rank_part(run: RunDir, state: dict, dist: Distributed) -> tuple[StreamCache, dict]:
    """The carried cache of the streams of ``dist``'s rank and its RNG state (saved rank 0's
    RNG state where no rank of its number was saved), read from the state's parts.

    A state saved by ``n`` processes holds rank 0's cache rows, and names the ``n - 1``
    other parts, each with as many rows (a state without ``parts``: every row)."""
    saved = {0: state}
    count = state.get("parts", 1)

    def part(rank: int) -> dict:
        if rank not in saved:
            saved[rank] = _read_part(run, state["step"], rank)
        return saved[rank]

    share = state["cache"][0].shape[0]  # streams of each part
    rows = dist.rows(share * count)
    first, last = rows.start // share, -(-rows.stop // share)  # the parts that hold them
    cache = StreamCache.merge([StreamCache(part(p)["cache"]) for p in range(first, last)])
    cache = cache.rows(slice(rows.start - first * share, rows.stop - first * share))
    if 0 < dist.rank < count:
        return cache, part(dist.rank)["rng"]
    rngs = state["rng"]  # one per rank in a torchrun state saved before there were parts
    return cache, rngs[dist.rank] if dist.rank < len(rngs) else rngs[0]


def _read_part(run: RunDir, step: int, rank: int) -> dict:
    path = run.part_file(step, rank)
    if not path.is_file():
        raise RunDirError(f"{run} has no {path.name}, the part of the training state that "
                          f"rank {rank} wrote (on its own machine, if it ran on another one): "
                          "copy it here, or start the run over")
    return read_state(path)


def _save_state(state: dict, path: Path) -> None:
    """``state`` as safetensors: its tensors, and the rest as JSON in the metadata."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _to_tree(state, tensors)
    save_file({k: t.contiguous() for k, t in tensors.items()}, path,
              metadata={"state": json.dumps(tree)})


def read_state(path: Path, device: str | torch.device = "cpu", *, tensors: bool = True) -> dict:
    """What :func:`_save_state` wrote (or an adaspan 0.1-0.2 ``state.pt``, without pickle's
    code execution); a file that is not one is refused as such. Without ``tensors``, every
    tensor is None and only the metadata of a safetensors state is read (its ``step``...)."""
    with _refused_if_unreadable(path):
        if path.name == LEGACY_STATE_FILE:
            return load_pickled_tensors(path, device)
        with safe_open(path, framework="pt", device=str(device)) as stored:
            loaded = ({key: stored.get_tensor(key) for key in stored.keys()}  # noqa: SIM118
                      if tensors else defaultdict(type(None)))
            tree = json.loads((stored.metadata() or {})["state"])
        return _from_tree(tree, loaded)


@contextmanager
def _refused_if_unreadable(path: Path) -> Iterator[None]:
    """Turn a failure to read the training state ``path`` into a RunDirError saying so."""
    try:
        yield
    except (OSError, SafetensorError, KeyError, ValueError, TypeError) as exc:
        raise RunDirError(f"cannot read {path}: {one_line(exc)}; it is refused as it is: restore "
                          "it from a backup or start the run over") from None


def _to_tree(value: object, tensors: dict[str, torch.Tensor]) -> object:
    """``value`` (dicts, lists, tuples, tensors, JSON scalars) as JSON, its tensors moved
    into ``tensors`` and referred to by key; tuples and non-string keys are marked."""
    if isinstance(value, torch.Tensor):
        key = str(len(tensors))
        tensors[key] = value.detach().cpu()
        return {"tensor": key}
    if isinstance(value, dict):
        return {"dict": [[_to_tree(k, tensors), _to_tree(v, tensors)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return {type(value).__name__: [_to_tree(v, tensors) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot store a {type(value).__name__} in a training state")


def _from_tree(tree: object, tensors: dict[str, torch.Tensor]) -> object:
    """The inverse of :func:`_to_tree`."""
    if not isinstance(tree, dict):
        return tree
    (kind, body), = tree.items()
    if kind == "tensor":
        return tensors[body]
    if kind == "dict":
        return {_from_tree(k, tensors): _from_tree(v, tensors) for k, v in body}
    items = [_from_tree(v, tensors) for v in body]
    return tuple(items) if kind == "tuple" else items


def rng_state() -> dict:
    """Python, NumPy, torch (and CUDA) random states, as tensors and plain values."""
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {**numpy_state, "state": {
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": numpy_state["state"]["pos"],
        }},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    key = numpy_state["state"]["key"].cpu().numpy().astype(np.uint32)
    np.random.set_state({**numpy_state, "state": {**numpy_state["state"], "key": key}})
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def _require_file(run: RunDir, path: Path) -> Path:
    if not run.path.is_dir():
        raise RunDirError(f"run directory {run} does not exist")
    if not path.is_file():
        raise RunDirError(f"{run} has no {path.name}: it is not a training run directory, "
                          "or its first checkpoint was never saved")
    return path
