"""The paper's optimisation recipe (§3): Adagrad (or AdamW), linear warm-up, a final
learning-rate drop, and the authors' per-tensor clipping of the step."""

from __future__ import annotations

import torch

from ..config import TrainConfig
from ..model.lm import SpanLM

STATE_PER_PARAMETER = {"adagrad": 1, "adamw": 2}  # tensors the size of a parameter in its state


def lr_factor(step: int, config: TrainConfig) -> float:
    """Multiplier of ``config.lr`` for optimiser step ``step`` (counted from 0).

    Rises linearly from 0 to 1 over ``warmup`` steps (paper §3), then stays at 1, except the
    last ``lr_drop_steps`` steps, which use ``lr_drop_factor``.
    """
    factor = min(1.0, step / config.warmup) if config.warmup else 1.0
    if step >= config.steps - config.lr_drop_steps:
        factor *= config.lr_drop_factor
    return factor


def build_optimizer(model: SpanLM, config: TrainConfig) -> torch.optim.Optimizer:
    """Adagrad (paper) or AdamW; weight decay applies to matrices only, not to spans or norms."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": config.weight_decay},
              {"params": others, "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad(groups, lr=config.lr)
    return torch.optim.AdamW(groups, lr=config.lr)


def step_with_tensor_clip(optimizer: torch.optim.Optimizer, clip: float) -> None:
    """``optimizer.step()`` with the step of each parameter tensor scaled by
    min(1, clip / ||g||), ``g`` its gradient: the authors' per-tensor learning-rate clipping.

    The optimiser itself sees the raw gradient (Adagrad accumulates g^2 unclipped). Scaling the
    step equals scaling that tensor's learning rate for optimisers whose update is proportional
    to it (Adagrad, AdamW, SGD): p <- p_old + s (p_stepped - p_old). Computed on the device
    (every tensor's step is scaled, by 1 where it is not clipped): nothing waits for it.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]
              if p.grad is not None]
    scales = [(clip / (torch.linalg.vector_norm(p.grad.float()) + 1e-10)).clamp(max=1.0)
              for p in params]
    before = [p.detach().clone() for p in params]
    optimizer.step()
    with torch.no_grad():
        for p, old, scale in zip(params, before, scales, strict=True):
            p.lerp_(old, (1.0 - scale).to(p.dtype))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
