"""Rotary positions (Su et al. 2021), for span attention heads without a table of p_d."""

from __future__ import annotations

import torch
from torch import Tensor


def rotate(x: Tensor, first: int, base: float = 10000.0) -> Tensor:
    """Rotary positions of ``x`` (B, H, T, d) at positions first .. first + T - 1: each pair
    (x_i, x_{i + d/2}) turned by the angle t base ** (-2i / d), so that a rotated query and
    key score a function of their distance alone (the halves' pairing of GPT-NeoX and Hugging
    Face models)."""
    T, d = x.shape[-2:]
    frequency = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = torch.arange(first, first + T, device=x.device, dtype=torch.float32)[:, None]
    angle = torch.cat([angle * frequency] * 2, dim=-1)  # (T, d)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return (x * angle.cos() + half * angle.sin()).to(x.dtype)
