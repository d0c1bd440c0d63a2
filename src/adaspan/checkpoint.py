"""Run directories: configuration, weights and training state, written atomically.

Layout of a run directory::

    config.json         model and train configuration, adaspan version
    model.safetensors   weights, with the training step in the metadata
    state.safetensors   step, data position, carried cache, optimiser, scheduler, RNG states:
                        tensors, with everything else as JSON in the metadata
    state.step-N.rank-R.safetensors
                        under torchrun, the carried cache rows and RNG state of rank R >= 1
                        (rank 0's are in state.safetensors), written by that process
    metrics.jsonl       one JSON object per log/eval event (written by adaspan.train)
    checkpoints/        step-N/: the last ``keep_last`` checkpoints (hard links), if asked
    tb/                 TensorBoard events (when tensorboard is installed)

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
import pickle
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ._version import __version__
from .cache import StreamCache
from .config import ConfigError, ModelConfig, TrainConfig
from .data import resolve_data
from .distributed import Distributed
from .errors import UserError
from .model import SpanLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "state.safetensors"
LEGACY_STATE_FILE = "state.pt"  # adaspan 0.1-0.2
TEMP_SUFFIX = ".tmp"
PART_FILE = re.compile(r"state\.step-(\d+)\.rank-(\d+)\.safetensors")  # a rank's part of the state
ARCHIVE_DIR = "checkpoints"  # earlier checkpoints kept with TrainConfig.keep_last


class RunDirError(UserError):
    """A run directory is missing, incomplete, inconsistent or would be overwritten."""


class CheckpointFileError(UserError, ValueError):
    """A file read as a PyTorch checkpoint that is not one, or holds more than tensors and
    plain values (which could run code): refused."""


@dataclass
class TrainingState:
    """Where a training run stands: what resuming needs besides weights and optimiser."""

    step: int  # optimiser steps done
    position: int  # index of the next training block
    cache: StreamCache  # carried hidden states of this rank's streams (its batch rows)
    elapsed: float = 0.0  # seconds of training so far


def atomic_write(files: dict[Path, Callable[[Path], None]]) -> None:
    """Create or replace each path by calling its writer on a temporary file first.

    All temporary files are written and fsynced before any is renamed into place.
    """
    temps: dict[Path, Path] = {}
    mode = 0o666 & ~_umask()
    try:
        for path, write in files.items():
            temps[path] = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
            write(temps[path])
            os.chmod(temps[path], mode)  # as a plain open() would (safetensors writes 0600)
            with temps[path].open("rb+") as written:
                os.fsync(written.fileno())
        for path, temp in temps.items():
            os.replace(temp, path)
    finally:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
    for folder in {path.parent for path in files}:
        _fsync_dir(folder)


def remove_temporaries(run_dir: Path) -> None:
    """Delete the temporary files that an interrupted :func:`atomic_write` left, and the
    ranks' parts of the state that an interrupted or superseded checkpoint left."""
    for path in run_dir.glob(f".*{TEMP_SUFFIX}"):
        if path.is_file():
            path.unlink(missing_ok=True)
    last = saved_step(run_dir)
    _remove_parts(run_dir, keep=lambda step: step == last)


def _part_path(run_dir: Path, step: int, rank: int) -> Path:
    return run_dir / f"state.step-{step:09d}.rank-{rank}.safetensors"


def _parts(run_dir: Path) -> dict[Path, int]:
    """The ranks' parts of the state in ``run_dir``, with their steps."""
    return {path: int(match[1]) for path in run_dir.glob("state.step-*.rank-*.safetensors")
            if (match := PART_FILE.fullmatch(path.name))}


def _remove_parts(run_dir: Path, keep: Callable[[int], bool]) -> None:
    for path, step in _parts(run_dir).items():
        if not keep(step):
            path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _json_writer(payload: dict) -> Callable[[Path], None]:
    return lambda path: path.write_text(json.dumps(payload, indent=2) + "\n")


def save_config(
    run_dir: str | Path, model_config: ModelConfig, train_config: TrainConfig
) -> None:
    """Write ``config.json``: both configurations (dataclasses) and the adaspan version."""
    path = Path(run_dir) / CONFIG_FILE
    atomic_write({path: _json_writer(_config_payload(model_config, train_config))})


def _config_payload(model_config: ModelConfig, train_config: TrainConfig) -> dict:
    return {
        "adaspan_version": __version__,
        "model": model_config.to_dict(),
        "train": train_config.to_dict(),
    }


def read_config(run_dir: str | Path) -> dict:
    """The contents of ``config.json``: ``model`` and ``train`` dicts, ``adaspan_version``."""
    path = _require_file(Path(run_dir), CONFIG_FILE)
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RunDirError(f"cannot read {path}: {exc}") from exc
    if not (isinstance(config, dict)
            and all(isinstance(config.get(table), dict) for table in ("model", "train"))):
        raise RunDirError(f"{path} must hold 'model' and 'train' tables")
    config["model"].setdefault("position_table", "layer")  # adaspan 0.1: one table per layer
    config["train"].setdefault("clip_mode", "global")  # ... and the global gradient norm clipped
    return config


def load_run_config(run_dir: str | Path) -> tuple[ModelConfig, TrainConfig]:
    """The model and train configurations saved in ``run_dir``."""
    saved = read_config(run_dir)
    return ModelConfig.from_dict(saved["model"]), TrainConfig.from_dict(saved["train"])


def stored_form(config: TrainConfig) -> TrainConfig:
    """``config`` as a run directory stores it: corpus paths absolute (a built-in corpus keeps
    its name), so that the run can be evaluated and resumed from any working directory."""
    data_dir = (None if config.data_dir is None
                else str(Path(config.data_dir).expanduser().resolve()))
    return replace(config, data=resolve_data(config.data), data_dir=data_dir)


def new_run_dir(name: str) -> Path:
    """``runs/NAME-YYYYmmdd-HHMMSS``: where a run goes when no directory is given."""
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def prepare_run_dir(
    run_dir: Path, model_config: ModelConfig, config: TrainConfig, resume: bool
) -> None:
    """Refuse to overwrite a run, to resume one that is missing or was set up differently
    (another model, or another value of an option that must stay fixed on resume), or a run
    directory where no file can be written."""
    if not resume:
        if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
            raise RunDirError(f"run directory {run_dir} already exists and is not empty: pass "
                              "--resume to continue that run, or choose another directory")
        _check_writable(run_dir)
        return
    if not (run_dir / CONFIG_FILE).is_file():
        raise RunDirError(f"nothing to resume in {run_dir}: it is not a run directory (no "
                          f"{CONFIG_FILE})")
    saved = read_config(run_dir)
    changed = [f"model.{name}={value!r} (saved: {saved['model'].get(name)!r})"
               for name, value in model_config.to_dict().items()
               if saved["model"].get(name) != value]
    changed += [f"train.{name}={getattr(config, name)!r} (saved: {saved['train'].get(name)!r})"
                for name in TrainConfig.fixed_on_resume()
                if not _same_option(name, saved["train"].get(name), getattr(config, name))]
    if changed:
        raise RunDirError(f"cannot resume {run_dir} with different settings: "
                          f"{'; '.join(changed)}")
    _check_writable(run_dir)


def _check_writable(run_dir: Path) -> None:
    """Create and remove a file in ``run_dir`` (or, for one not made yet, in the folder it
    will be made in): RunDirError if that is not permitted, before training starts."""
    folder = run_dir
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
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


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds weights and training state to resume from."""
    run_dir = Path(run_dir)
    return (run_dir / WEIGHTS_FILE).is_file() and _state_path(run_dir) is not None


def _state_path(run_dir: Path) -> Path | None:
    for name in (STATE_FILE, LEGACY_STATE_FILE):
        if (run_dir / name).is_file():
            return run_dir / name
    return None


def saved_step(run_dir: str | Path) -> int | None:
    """The step of the checkpoint of ``run_dir``, read without loading its tensors; None if
    it has no checkpoint to resume from."""
    run_dir = Path(run_dir)
    if not has_checkpoint(run_dir):
        return None
    path = _state_path(run_dir)
    with _refused_if_unreadable(path):
        if path.name == LEGACY_STATE_FILE:
            return int(load_pickled_tensors(path)["step"])
        with safe_open(path, framework="pt") as stored:
            tree = json.loads((stored.metadata() or {})["state"])
        return int(dict(tree["dict"])["step"])  # the top level of _save_state's tree


def save_checkpoint(
    run_dir: str | Path,
    model: SpanLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    position: int,
    cache: StreamCache,
    train_config: TrainConfig,
    *,
    elapsed: float = 0.0,
    dist: Distributed | None = None,
) -> None:
    """Write config, weights and training state of ``run_dir`` atomically.

    The training state holds the weights too, and is renamed into place last: a run killed at
    any moment resumes from one consistent checkpoint, the previous or the new one.

    With ``dist``, every rank calls it with the ``cache`` of its own streams: each rank > 0
    writes that and its RNG state to its part of the state, then rank 0 the rest (with its
    own cache and RNG state), counting the parts; the parts of earlier steps are removed.
    """
    run_dir = Path(run_dir)
    dist = dist if dist is not None else Distributed()
    if not dist.is_main:
        part = {"step": step, "rank": dist.rank, "cache": cache.to("cpu").layers,
                "rng": rng_state()}
        atomic_write({_part_path(run_dir, step, dist.rank): lambda path: _save_state(part, path)})
    dist.barrier()  # every part is in place before the state that counts them
    if not dist.is_main:
        return
    # safetensors wants contiguous tensors that share no memory: clone them to the CPU.
    weights = {name: t.detach().to("cpu", copy=True).contiguous()
               for name, t in model.state_dict().items()}
    state = {
        "step": step,
        "position": position,
        "elapsed": elapsed,
        "cache": cache.to("cpu").layers,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": [rng_state()],
        "parts": dist.world_size,  # rank 0's part is "cache" and "rng"; the others' in files
        "model": weights,
    }
    atomic_write({  # the state, which alone is read to resume, is renamed into place last
        run_dir / CONFIG_FILE: _json_writer(_config_payload(model.config, train_config)),
        run_dir / WEIGHTS_FILE: lambda path: save_file(weights, path, metadata={"step": str(step)}),
        run_dir / STATE_FILE: lambda path: _save_state(state, path),
    })
    (run_dir / LEGACY_STATE_FILE).unlink(missing_ok=True)  # superseded (a resumed 0.2 run)
    _remove_parts(run_dir, keep=lambda part_step: part_step >= step)  # superseded


def archive_checkpoint(run_dir: Path, step: int, keep_last: int) -> Path:
    """Link the latest checkpoint's weights and state into ``checkpoints/step-N`` and delete
    all but the ``keep_last`` newest there; return the new folder."""
    archive = run_dir / ARCHIVE_DIR
    folder = archive / f"step-{step:09d}"
    folder.mkdir(parents=True, exist_ok=True)
    parts = [path.name for path, part_step in _parts(run_dir).items() if part_step == step]
    for name in (CONFIG_FILE, WEIGHTS_FILE, STATE_FILE, *parts):
        target = folder / name
        target.unlink(missing_ok=True)
        os.link(run_dir / name, target)  # the run's files are replaced, never rewritten
    for old in sorted(archive.glob("step-*"))[:-keep_last]:
        shutil.rmtree(old)
    return folder


def load_model(run_dir: str | Path, device: str | torch.device = "cpu") -> SpanLM:
    """The model saved in ``run_dir`` (its config and latest weights), in eval mode."""
    run_dir = Path(run_dir)
    try:
        config = ModelConfig.from_dict(read_config(run_dir)["model"])
    except ConfigError as exc:
        raise RunDirError(f"{run_dir / CONFIG_FILE}: {exc}") from exc
    model = SpanLM(config)
    load_weights(run_dir, model)
    return model.to(device).eval()


def load_weights(run_dir: str | Path, model: SpanLM) -> int:
    """Load the weights of ``run_dir`` into ``model``; return the step they were saved at."""
    path = _require_file(Path(run_dir), WEIGHTS_FILE)
    try:
        with safe_open(path, framework="pt") as weights:
            step = int((weights.metadata() or {}).get("step", -1))
        tensors = load_file(path)
    except (OSError, SafetensorError) as exc:
        raise RunDirError(f"cannot read {path}: {exc}") from exc
    _load_state_dict(model, tensors, path)
    return step


def _load_state_dict(model: SpanLM, tensors: dict, path: Path) -> None:
    try:
        model.load_state_dict(tensors)
    except RuntimeError as exc:
        raise RunDirError(f"{path} does not match the model of {CONFIG_FILE}: {exc}") from exc


def load_training_state(
    run_dir: str | Path,
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
    run_dir = Path(run_dir)
    dist = dist if dist is not None else Distributed()
    path = _state_path(run_dir) or _require_file(run_dir, STATE_FILE)
    state = read_state(path)
    if "model" in state:
        _load_state_dict(model, state["model"], path)
    elif (weights_step := load_weights(run_dir, model)) != state["step"]:  # a 0.1-0.2 run
        raise RunDirError(
            f"{run_dir} is inconsistent: weights are from step {weights_step}, training state "
            f"from step {state['step']} (a save was cut short); restore a backup or start over"
        )
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    cache, rng = _rank_part(run_dir, state, dist)
    set_rng_state(rng)
    return TrainingState(state["step"], state["position"], cache.to(device), state["elapsed"])


def _rank_part(run_dir: Path, state: dict, dist: Distributed) -> tuple[StreamCache, dict]:
    """The carried cache of the streams of ``dist``'s rank and its RNG state (saved rank 0's
    RNG state where no rank of its number was saved), read from the state's parts.

    A state saved by ``n`` processes holds rank 0's cache rows, and names the ``n - 1``
    other parts, each with as many rows (a state without ``parts``: every row)."""
    saved = {0: state}
    count = state.get("parts", 1)

    def part(rank: int) -> dict:
        if rank not in saved:
            saved[rank] = _read_part(run_dir, state["step"], rank)
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


def _read_part(run_dir: Path, step: int, rank: int) -> dict:
    path = _part_path(run_dir, step, rank)
    if not path.is_file():
        raise RunDirError(f"{run_dir} has no {path.name}, the part of the training state that "
                          f"rank {rank} wrote (on its own machine, if it ran on another one): "
                          "copy it here, or start the run over")
    return read_state(path)


def _save_state(state: dict, path: Path) -> None:
    """``state`` as safetensors: its tensors, and the rest as JSON in the metadata."""
    tensors: dict[str, torch.Tensor] = {}
    tree = _to_tree(state, tensors)
    save_file({k: t.contiguous() for k, t in tensors.items()}, path,
              metadata={"state": json.dumps(tree)})


def read_state(path: Path, device: str | torch.device = "cpu") -> dict:
    """What :func:`_save_state` wrote (or an adaspan 0.1-0.2 ``state.pt``, without pickle's
    code execution); a file that is not one is refused as such."""
    with _refused_if_unreadable(path):
        if path.name == LEGACY_STATE_FILE:
            return load_pickled_tensors(path, device)
        with safe_open(path, framework="pt", device=str(device)) as stored:
            tensors = {key: stored.get_tensor(key) for key in stored.keys()}  # noqa: SIM118
            tree = json.loads((stored.metadata() or {})["state"])
        return _from_tree(tree, tensors)


@contextmanager
def _refused_if_unreadable(path: Path) -> Iterator[None]:
    """Turn a failure to read the training state ``path`` into a RunDirError saying so."""
    try:
        yield
    except (OSError, SafetensorError, KeyError, ValueError, TypeError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise RunDirError(f"cannot read {path}: {reason}; it is refused as it is: restore "
                          "it from a backup or start the run over") from None


def load_pickled_tensors(path: Path, device: str | torch.device = "cpu") -> object:
    """A PyTorch file (pickle) read with ``torch.load(weights_only=True)``: tensors and plain
    containers only, so that it cannot run code. Any other file is refused with
    :class:`CheckpointFileError`, whose message never suggests lifting the restriction."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "GLOBAL" in str(exc):  # torch refused to import something: code, or objects
            raise CheckpointFileError(f"{path} holds objects other than tensors and plain "
                                      "values; adaspan does not load it, as that could run "
                                      "code") from None
        raise CheckpointFileError(f"{path} is not a PyTorch file (it cannot be "
                                  "unpickled)") from None
    except (RuntimeError, EOFError, AttributeError, ImportError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointFileError(f"{path} is not a PyTorch file: {first_line}") from None


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


def _require_file(run_dir: Path, name: str) -> Path:
    path = run_dir / name
    if not run_dir.is_dir():
        raise RunDirError(f"run directory {run_dir} does not exist")
    if not path.is_file():
        raise RunDirError(f"{run_dir} has no {name}: it is not a training run directory, "
                          "or its first checkpoint was never saved")
    return path
