"""Run directories: configuration, weights and training state, written atomically.

Layout of a run directory::

    config.json        model and train configuration, adaspan version
    model.safetensors  weights, with the training step in the metadata
    state.pt           step, data position, carried cache, optimiser, scheduler, RNG states
    metrics.jsonl      one JSON object per log/eval event (written by adaspan.train)
    tb/                TensorBoard events (when tensorboard is installed)

Each file of a checkpoint is written to a temporary file in the run directory, flushed and
fsynced; only then are all of them renamed into place, one right after the other. An
interrupted save leaves the previous checkpoint readable, and the step stored in both the
weights and the state detects the (tiny) window in which they could disagree.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ._version import __version__
from .config import ModelConfig
from .model import Cache, SpanLM

if TYPE_CHECKING:
    from .train import TrainConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "state.pt"


class RunDirError(Exception):
    """A run directory is missing, incomplete, inconsistent or would be overwritten."""


@dataclass
class TrainingState:
    """Where a training run stands: what resuming needs besides weights and optimiser."""

    step: int  # optimiser steps done
    position: int  # index of the next training block
    cache: Cache  # carried hidden states of every stream (all batch rows)
    elapsed: float = 0.0  # seconds of training so far


def atomic_write(files: dict[Path, Callable[[Path], None]]) -> None:
    """Create or replace each path by calling its writer on a temporary file first.

    All temporary files are written and fsynced before any is renamed into place.
    """
    temps: dict[Path, Path] = {}
    try:
        for path, write in files.items():
            temps[path] = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            write(temps[path])
            with temps[path].open("rb+") as written:
                os.fsync(written.fileno())
        for path, temp in temps.items():
            os.replace(temp, path)
    finally:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
    for folder in {path.parent for path in files}:
        _fsync_dir(folder)


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
    if not isinstance(config, dict) or not {"model", "train"} <= config.keys():
        raise RunDirError(f"{path} must hold 'model' and 'train' tables")
    if isinstance(config["model"], dict):  # runs of adaspan 0.1 had a position table per layer
        config["model"].setdefault("position_table", "layer")
    if isinstance(config["train"], dict):  # ... and clipped the global gradient norm
        config["train"].setdefault("clip_mode", "global")
    return config


def has_checkpoint(run_dir: str | Path) -> bool:
    """Whether ``run_dir`` holds weights and training state to resume from."""
    return all((Path(run_dir) / name).is_file() for name in (WEIGHTS_FILE, STATE_FILE))


def save_checkpoint(
    run_dir: str | Path,
    model: SpanLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    position: int,
    cache: Cache,
    train_config: TrainConfig,
    *,
    elapsed: float = 0.0,
    rng: list[dict] | None = None,
) -> None:
    """Write config, weights and training state of ``run_dir`` atomically.

    ``rng`` holds one :func:`rng_state` per distributed rank (default: this process's).
    """
    run_dir = Path(run_dir)
    # safetensors wants contiguous tensors that share no memory: clone them to the CPU.
    weights = {name: t.detach().to("cpu", copy=True).contiguous()
               for name, t in model.state_dict().items()}
    state = {
        "step": step,
        "position": position,
        "elapsed": elapsed,
        "cache": [layer.detach().cpu() for layer in cache],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng if rng is not None else [rng_state()],
    }
    atomic_write({
        run_dir / CONFIG_FILE: _json_writer(_config_payload(model.config, train_config)),
        run_dir / WEIGHTS_FILE: lambda path: save_file(weights, path, metadata={"step": str(step)}),
        run_dir / STATE_FILE: lambda path: torch.save(state, path),
    })


def load_model(run_dir: str | Path, device: str | torch.device = "cpu") -> SpanLM:
    """The model saved in ``run_dir`` (its config and latest weights), in eval mode."""
    run_dir = Path(run_dir)
    try:
        config = ModelConfig.from_dict(read_config(run_dir)["model"])
    except ValueError as exc:
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
    try:
        model.load_state_dict(tensors)
    except RuntimeError as exc:
        raise RunDirError(f"{path} does not match the model of {CONFIG_FILE}: {exc}") from exc
    return step


def load_training_state(
    run_dir: str | Path,
    model: SpanLM,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: str | torch.device = "cpu",
    rank: int = 0,
) -> TrainingState:
    """Restore weights, optimiser, scheduler and the RNG states of ``rank`` from ``run_dir``."""
    run_dir = Path(run_dir)
    weights_step = load_weights(run_dir, model)
    path = _require_file(run_dir, STATE_FILE)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise RunDirError(f"cannot read {path}: {exc}") from exc
    if state["step"] != weights_step:
        raise RunDirError(
            f"{run_dir} is inconsistent: weights are from step {weights_step}, training state "
            f"from step {state['step']} (a save was cut short); restore a backup or start over"
        )
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    rngs = state["rng"]
    set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
    return TrainingState(state["step"], state["position"], state["cache"], state["elapsed"])


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
