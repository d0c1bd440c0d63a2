"""Span attention as one function (temporary plain version: the full score matrix with the
soft mask; replaced at merge)."""

from __future__ import annotations

import torch
from torch import Tensor

from .span import soft_mask


def span_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor | None, *, max_span: int,
                   ramp: float, pos: Tensor | None = None, scale: float | None = None,
                   dropout: float = 0.0, training: bool = False,
                   z_min: Tensor | None = None) -> Tensor:
    """Eqs. 1-3 with m_z(x): query i of q (B, Hq, M, d) reads keys j of k, v (B, Hkv, T, d)
    at distance x = (T - M + i) - j, 0 <= x < max_span; output (B, Hq, M, d)."""
    _, Hq, M, d = q.shape
    T, group = k.shape[2], Hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    x = (T - M + torch.arange(M, device=q.device))[:, None] - torch.arange(T, device=q.device)
    visible = (x >= 0) & (x < max_span)
    scores = (q @ k.transpose(-1, -2)) * (d**-0.5 if scale is None else scale)
    scores = scores.float().masked_fill(~visible, float("-inf"))
    weights = scores.softmax(-1)
    if z is not None:
        m = soft_mask(x.to(scores), torch.as_tensor(z, dtype=scores.dtype)[..., None], ramp)
        weights = weights * m
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=1e-8)
    weights = torch.nn.functional.dropout(weights, dropout, training)
    return (weights.to(v.dtype) @ v)
