"""The disk a run's checkpoints need: estimated before training starts, as memory is, and a
full disk met while training reported with the step that is safe on disk."""

from __future__ import annotations

import shutil

from ..config import STATE_PER_PARAMETER, TrainConfig
from ..data.files import existing_ancestor
from ..errors import UserError
from ..model.lm import SpanLM
from .checkpoint import RunDir


class DiskFullError(UserError):
    """The run's file system has no room for its checkpoints."""


def checkpoint_bytes(model: SpanLM, config: TrainConfig) -> int:
    """Bytes of one checkpoint: the weights file, and the state file with the weights again,
    the optimiser's state (float32), the streams' cache at the spans the heads reach now, and
    the files' headers (a few hundred bytes for each tensor's name and shape, about 4 tensors
    per weight in all) and RNG states (16 KiB)."""
    tensors = model.state_dict()
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    optimizer = STATE_PER_PARAMETER[config.optimizer] * sum(
        p.numel() * 4 for p in model.parameters())
    reach = sum(max(layer.attn.reach(config.block_size)) for layer in model.layers)
    cache = config.batch_size * int(reach) * model.config.d_model * 4
    overhead = 16_384 + 4 * 256 * len(tensors)
    return 2 * weights + optimizer + cache + overhead


def check_disk_space(run: RunDir, model: SpanLM, config: TrainConfig, resuming: bool) -> int:
    """Refuse a run whose checkpoints cannot fit on its file system (DiskFullError), before
    anything is written; return the bytes it needs. A checkpoint is written beside the last
    before that is removed; those that ``keep_last`` keeps add theirs."""
    one = checkpoint_bytes(model, config)
    needed = one * ((1 if resuming else 2) + config.keep_last)
    free = shutil.disk_usage(existing_ancestor(run.path)).free
    if needed > free:
        raise DiskFullError(
            f"{run} needs {needed / 1e6:,.1f} MB free for its checkpoints ({one / 1e6:,.1f} MB "
            f"each, the next written beside the last), and its file system has "
            f"{free / 1e6:,.1f} MB: free space or train elsewhere"
        )
    return needed


def disk_full_error(run: RunDir, exc: BaseException) -> DiskFullError:
    """A full disk met while training in ``run``, in one line: which checkpoint is safe."""
    step = run.saved_step()
    safe = (f"the checkpoint of step {step:,} is intact: free space, then resume with "
            f"--resume {run}" if step is not None else "no checkpoint was saved yet")
    return DiskFullError(f"no space left on device while training in {run} ({safe})")
