"""The paper's optimisation recipe (§3): Adagrad (or AdamW), linear warm-up, a final
learning-rate drop, and the authors' per-tensor clipping of the step; beside it, a cosine or
linear decay to the last step or the end of the time budget."""

from __future__ import annotations

import math

import torch

from ..config import TrainConfig
from ..model.lm import SpanLM


def lr_factor(step: int, config: TrainConfig, spent: float = 0.0) -> float:
    """Multiplier of ``config.lr`` for optimiser step ``step`` (counted from 0).

    Rises linearly from 0 to 1 over ``warmup`` steps (paper §3), then stays at 1
    (``lr_schedule=constant``) or decays to ``lr_end_factor`` (:func:`decay`) by the progress
    ``u``: the share of the steps after the warm-up done (1 at the last step, ``steps - 1``),
    or ``spent``, the share of the time budget used, whichever is larger. The last
    ``lr_drop_steps`` steps are multiplied by ``lr_drop_factor``.
    """
    factor = min(1.0, step / config.warmup) if config.warmup else 1.0
    if config.lr_schedule != "constant":
        done = (step - config.warmup) / max(1, config.steps - 1 - config.warmup)
        factor *= decay(config.lr_schedule, min(1.0, max(done, spent, 0.0)),
                        config.lr_end_factor)
    if step >= config.steps - config.lr_drop_steps:
        factor *= config.lr_drop_factor
    return factor


def decay(schedule: str, u: float, end: float) -> float:
    """The factor at progress ``u`` in [0, 1], from 1 to ``end``: ``end + (1 − end) s(u)`` with
    ``s(u) = (1 + cos πu) / 2`` (cosine) or ``1 − u`` (linear)."""
    shape = (1 + math.cos(math.pi * u)) / 2 if schedule == "cosine" else 1 - u
    return end + (1 - end) * shape


def build_optimizer(model: SpanLM, config: TrainConfig) -> torch.optim.Optimizer:
    """Adagrad (paper) or AdamW; weight decay applies to matrices only, not to spans or norms."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay},
              {"params": others, "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]
    kind = torch.optim.Adagrad if config.optimizer == "adagrad" else torch.optim.AdamW
    return fused_where_offered(kind, groups, lr=config.lr)


# The devices on which each optimiser of torch.optim has a fused kernel (torch 2.4 to 2.13):
# Adagrad's runs on the CPU only (on CUDA, fused=True is accepted when the optimiser is built
# and refused at its first step).
FUSED_DEVICES = {torch.optim.Adagrad: frozenset({"cpu"}),
                 torch.optim.AdamW: frozenset({"cpu", "cuda", "mps", "xpu"})}


def fused_where_offered(kind: type[torch.optim.Optimizer], params, **options
                        ) -> torch.optim.Optimizer:
    """``kind(params, fused=True, **options)``: every parameter stepped by one fused kernel
    (the race model's Adagrad step on one CPU thread: 1.5 ms against 4.7 ms for the per-tensor
    loop, docs/performance.md), or that loop where this torch has no fused ``kind`` for the
    parameters' device (:data:`FUSED_DEVICES`) or refuses ``fused``. Both compute the same
    update up to fp32 rounding."""
    params = list(params)
    tensors = [p for item in params
               for p in (item["params"] if isinstance(item, dict) else [item])]
    devices = {p.device.type for p in tensors}
    if not devices <= FUSED_DEVICES.get(kind, devices):
        return kind(params, **options)
    try:
        return kind(params, fused=True, **options)
    except (RuntimeError, TypeError, ValueError):
        return kind(params, **options)


def step_with_tensor_clip(optimizer: torch.optim.Optimizer, clip: float) -> None:
    """``optimizer.step()`` with the step of each parameter tensor scaled by
    min(1, clip / ||g||), ``g`` its gradient: the authors' per-tensor learning-rate clipping.

    The optimiser itself sees the raw gradient (Adagrad accumulates g^2 unclipped). Scaling the
    step equals scaling that tensor's learning rate for optimisers whose update is proportional
    to it (Adagrad, AdamW, SGD): p <- p_old + s (p_stepped - p_old). Computed on the device
    (every tensor's step is scaled, by 1 where it is not clipped): nothing waits for it.
    The norms, the copies and the interpolations are each one call for all the tensors
    (``torch._foreach_*``: one kernel per call on CUDA; on the CPU torch loops over the
    tensors in C++, without a Python step per tensor).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.grad is not None]
    if not params:
        optimizer.step()
        return
    norms = torch.stack(torch._foreach_norm([p.grad.float() for p in params]))
    keep = (1.0 - (clip / (norms + 1e-10)).clamp(max=1.0)).unbind()  # 1 - s, per tensor
    with torch.no_grad():
        before = torch._foreach_mul(params, 1.0)  # an exact copy of every tensor
    optimizer.step()
    with torch.no_grad():
        weights = [w.to(p.dtype) for w, p in zip(keep, params, strict=True)]
        torch._foreach_lerp_(params, before, weights)


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))


def set_lr(scheduler: torch.optim.lr_scheduler.LambdaLR, factor: float) -> None:
    """Every parameter group's learning rate: its base rate times ``factor`` (a resumed run
    whose ``steps`` changed, a schedule paced by a time budget)."""
    for group, base_lr in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base_lr * factor
