"""Span attention as a function of any queries, keys and values (paper eqs. 1-3).

:func:`span_attention` serves models that compute their own q, k, v (rotary positions applied
by the caller, grouped-query attention, a cache of earlier keys): query i of the M newest
positions sits at position T - M + i among the T keys, and reads the keys at distances
x = 0 .. S - 1 (itself included), weighted by the soft mask m_z(x) = clamp((R + z - x) / R, 0, 1)
of eq. 2. Each group of heads of equal key window reads only the ``ceil(z + R)`` keys it can
see, with the band kernels of :mod:`adaspan.attention.band`.

Distances here start at 0 (the query's own key), where :class:`SpanAttention` of SpanLM counts
from 1 (the paper's keys strictly before the query): the band kernel's distance d is x + 1, so
its z is z + 1 (m_{z+1}(x + 1) = m_z(x)) and its table row d - 1 is row x of ``pos``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused
from .band import banded_attention, log_soft_mask
from .span import head_bounds, key_window


def rotate(x: Tensor, first: int, base: float = 10000.0) -> Tensor:
    """Rotary positions (Su et al. 2021) of ``x`` (B, H, T, d) at positions first .. first
    + T - 1: each pair (x_i, x_{i + d/2}) turned by the angle t base ** (-2i / d), so that a
    rotated query and key score a function of their distance alone (the halves' pairing of
    GPT-NeoX and Hugging Face models)."""
    T, d = x.shape[-2:]
    frequency = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angle = torch.arange(first, first + T, device=x.device, dtype=torch.float32)[:, None]
    angle = torch.cat([angle * frequency] * 2, dim=-1)  # (T, d)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return (x * angle.cos() + half * angle.sin()).to(x.dtype)


def span_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor | None, *, max_span: int,
                   ramp: float, pos: Tensor | None = None, scale: float | None = None,
                   dropout: float = 0.0, training: bool = False, z_min: float | None = None,
                   z_host: list[float] | None = None) -> Tensor:
    """Eqs. 1-3 of the M newest positions over their keys at distances 0 .. S - 1.

    q: (B, Hq, M, d); k, v: (B, Hkv, T, d), T >= M, the last M keys the queries' own; query
    head h reads key head h // (Hq / Hkv). z: None (every key with 0 <= x < S, weight 1) or
    the span, broadcastable to (B, Hq, M). Scores s = scale * q . (k + p_x), ``pos`` the
    table (S, d) of p_x by distance x (None: no position product, e.g. rotary positions
    already in q and k); ``scale`` defaults to d ** -0.5. ``z_min``, the least z on the host,
    saves reading it; the key windows need each head's greatest z on the host (one read of z,
    none when z is None or ``z_host``, each head's z on the host, is given: z the same for
    every row and query). Returns (B, Hq, M, d) in the dtype of q.
    """
    B, Hq, M, d = q.shape
    T = _check(q, k, v, pos, max_span)
    if scale is not None and scale != d**-0.5:  # the band kernel scales by d ** -0.5
        q = q * (scale * d**0.5)
    z = None if z is None else _per_head(z, B, Hq, M)
    groups = (_groups(z, Hq, max_span, ramp, T, z_min) if z_host is None or z is None
              else head_groups(z_host, z_host, max_span, ramp, T))
    return grouped_span_attention(q, k, v, z, groups, ramp, pos, dropout, training)


def span_log_mask(z: list[float], window: int, ramp: float) -> Tensor:
    """log m_z(x) of eq. 2 for each head (H, ``window``) at distances x = window - 1 .. 0
    (the oldest key first, as keys are stored), -inf where m_z(x) = 0; built on the host from
    each head's z on the host (float32)."""
    x = torch.arange(window - 1, -1, -1, dtype=torch.float64)
    return log_soft_mask(x, torch.tensor(z, dtype=torch.float64)[:, None], ramp).float()


def decode_attention(q: Tensor, k: Tensor, v: Tensor, log_mask: Tensor,
                     pos: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Eqs. 1-3 of the M newest positions (few: decoding) with every head in a few operators,
    without gradients of the mask: over the keys the longest window W sees, log m_z(x)
    (``log_mask`` (Hq, W) of :func:`span_log_mask`; -inf beyond W and before the query) plus
    the scores s = scale q . (k + p_x) in one product, a softmax (float32), so that exp(s) is
    weighed by m_z(x) (eq. 2), times v. Grouped-query heads read their key head without
    copying it (q as (B Hkv, G M, d)). Shapes as :func:`span_attention`."""
    B, Hq, M, d = q.shape
    Hkv, T, W = k.shape[1], k.shape[2], log_mask.shape[1]
    n = min(T, W + M - 1)  # the keys some query sees
    x = None if M == 1 and pos is None else (
        n - M + torch.arange(M, device=q.device)[:, None]
        - torch.arange(n, device=q.device))  # (M, n) distances
    scale = d**-0.5 if scale is None else scale
    mask = _distance_mask(log_mask, x, n).to(q.dtype).expand(B, Hq, M, n)
    if pos is not None:  # scale q . p_x, each pair's own table row
        p = pos[:W].to(q.dtype)[x.clamp(0, W - 1)]  # (M, n, d)
        mask = mask + scale * torch.einsum("bhmd,mnd->bhmn", q, p)
    rows = Hq // Hkv * M
    keys, values = (t[:, :, T - n:].reshape(B * Hkv, n, d) for t in (k, v))
    scores = torch.baddbmm(mask.reshape(B * Hkv, rows, n), q.reshape(B * Hkv, rows, d),
                           keys.transpose(1, 2), alpha=scale)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.bmm(weights, values).view(B, Hq, M, d)


def _distance_mask(log_mask: Tensor, x: Tensor | None, n: int) -> Tensor:
    """log m_z(x) of each head for the keys' distances ``x`` (M, n), -inf outside 0 .. W - 1:
    (Hq, M, n); x None: one query over the last n keys (a view)."""
    W = log_mask.shape[1]
    if x is None:
        return log_mask[:, None, W - n:]
    rows = log_mask[:, (W - 1 - x).clamp(0, W - 1)]
    return rows.masked_fill((x < 0) | (x >= W), -math.inf)


def grouped_span_attention(q: Tensor, k: Tensor, v: Tensor, z: Tensor | None,
                           groups: list[tuple[int, list[int], float]], ramp: float,
                           pos: Tensor | None = None, dropout: float = 0.0,
                           training: bool = False, kernel: bool | None = None,
                           windows: Tensor | None = None) -> Tensor:
    """:func:`span_attention` (scale d ** -0.5, z (B|1, Hq, M|1) or None) with the heads
    grouped by the caller: ``groups`` of (key window w <= T, query heads, least z of those
    heads), each head's window at least ``key_window`` of its greatest z. ``kernel``: all
    heads in the fused kernel of :mod:`adaspan.attention.fused` (None: on CUDA where Triton
    is installed), else (or where it cannot run these heads) each group with the band
    kernel; ``windows``: the groups' :func:`window_tensor` on the device, where the caller
    keeps it (else made at each call)."""
    if kernel or (kernel is None and q.is_cuda and fused.available()):
        out = _fused_heads(q, k, v, z, groups, ramp, pos, dropout if training else 0.0,
                           windows)
        if out is not None:
            return out
    outputs = [_group_attention(q, k, v, pos, z, window, heads, z_least, ramp, dropout,
                                training) for window, heads, z_least in groups]
    if len(outputs) == 1:
        return outputs[0].to(q.dtype)
    out = q.new_empty(q.shape)
    for (_, heads, _), o in zip(groups, outputs, strict=True):
        out[:, heads] = o.to(q.dtype)
    return out


def _fused_heads(q: Tensor, k: Tensor, v: Tensor, z: Tensor | None,
                 groups: list[tuple[int, list[int], float]], ramp: float, pos: Tensor | None,
                 dropout: float, windows: Tensor | None = None) -> Tensor | None:
    """Every head in one fused kernel, each over its window (the kernel's distance d is
    x + 1, its z is z + 1, its history T - M + 1; without ``pos`` its table is zeros); None
    where the kernel is not compiled for these heads or the device cannot run it."""
    backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, z, pos))
    if q.is_cuda and not fused.compiled(q.dtype, q.shape[-1],
                                        fused.precision(q.dtype, "cuda"), backward):
        return None
    longest, (T, M) = max(window for window, _, _ in groups), (k.shape[2], q.shape[2])
    if windows is None:
        windows = window_tensor(windows_by_head((w, heads) for w, heads, _ in groups), q.device)
    table = q.new_zeros(longest, q.shape[-1]) if pos is None else pos[:longest]
    kv = torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=2)  # (B, T, 2, Hkv, d)
    try:
        out = fused.band_attention(q, kv, table, None if z is None else z + 1,
                                   windows, T - M + 1, ramp, dropout)
    except fused.ResourcesExceeded:
        return None
    return out.transpose(1, 2)


def _group_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor | None, z: Tensor | None,
                     window: int, heads: list[int], z_least: float, ramp: float, dropout: float,
                     training: bool) -> Tensor:
    """Eqs. 1-3 for the query heads ``heads`` over their last ``window`` keys, with the band
    kernel (distances shifted by one: its key t + w - 1 is query t's own)."""
    T, M = k.shape[2], q.shape[2]
    lo = T - M - window + 1  # the first key of the first query's window
    rows = head_index(heads, q.device)
    kv = head_index([h // (q.shape[1] // k.shape[1]) for h in heads], q.device)
    keys, values = (t[:, kv, max(lo, 0):] for t in (k, v))
    if lo < 0:  # the first queries' windows begin before position 0: absent keys
        keys, values = (F.pad(t, (0, 0, -lo, 0)) for t in (keys, values))
    zg = None if z is None else z[:, rows] + 1  # band distances are x + 1
    table = None if pos is None else pos[:window].to(q.dtype)
    return banded_attention(q[:, rows], keys, values, table,
                            zg, ramp, dropout, training,
                            z_min=None if z is None else z_least + 1, window=window,
                            start=max(-lo, 0))


def _check(q: Tensor, k: Tensor, v: Tensor, pos: Tensor | None, max_span: int) -> int:
    """T, the number of keys, once the shapes are those of :func:`span_attention`."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"q must be (B, Hq, M, d) and k, v (B, Hkv, T, d), got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    (B, Hq, M, d), (Bk, Hkv, T, dk) = q.shape, k.shape
    if (Bk, dk) != (B, d) or Hq % Hkv or T < M:
        raise ValueError(f"q {tuple(q.shape)} and k, v {tuple(k.shape)} must share B and d, "
                         "with query heads a multiple of key heads and T >= M")
    if pos is not None and tuple(pos.shape) != (max_span, d):
        raise ValueError(f"pos must be (max_span, d) = ({max_span}, {d}), "
                         f"got {tuple(pos.shape)}")
    if max_span < 1:
        raise ValueError(f"max_span must be at least 1, got {max_span}")
    return T


def _per_head(z: Tensor, B: int, H: int, M: int) -> Tensor:
    """``z`` as (B|1, H, M|1), each head's own (an expanded view where heads share one)."""
    z = z.reshape((1,) * (3 - z.dim()) + tuple(z.shape)) if z.dim() < 3 else z
    if z.dim() != 3 or torch.broadcast_shapes(z.shape, (B, H, M)) != (B, H, M):
        raise ValueError(f"z must be broadcastable to (B, Hq, M) = {(B, H, M)}, "
                         f"got {tuple(z.shape)}")
    return z.expand(z.shape[0], H, z.shape[2])


def _groups(z: Tensor | None, H: int, max_span: int, ramp: float, T: int,
            z_min: float | None) -> list[tuple[int, list[int], float]]:
    """The heads grouped by key window: (window, heads, least z of the group), the windows
    ``key_window`` of each head's greatest z, capped at T (one read of z from the device)."""
    if z is None:
        return [(min(max_span, T), list(range(H)), 0.0)]
    if z_min is None:
        least, greatest = head_bounds(z)
    else:
        least, greatest = [z_min] * H, z.detach().amax(dim=(0, 2)).tolist()
    return head_groups(least, greatest, max_span, ramp, T)


def head_groups(least: list[float], greatest: list[float], max_span: int, ramp: float,
                keys: int, bucket: int = 1) -> list[tuple[int, list[int], float]]:
    """The groups of :func:`grouped_span_attention` from each head's least and greatest z on
    the host: heads of equal key window ``key_window(greatest z, S, R, bucket)``, capped at
    ``keys`` (T), as (window, heads, least z of the group)."""
    members: dict[int, list[int]] = {}
    for head, z_max in enumerate(greatest):
        members.setdefault(min(key_window(z_max, max_span, ramp, bucket), keys), []).append(head)
    return [(w, heads, min(least[h] for h in heads)) for w, heads in members.items()]


def head_index(heads: Sequence[int], device: torch.device) -> slice | Tensor:
    """The heads ``heads`` as an index of a head dimension: a slice (a view) when they are
    consecutive, else an index tensor on ``device``."""
    if list(heads) == list(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(list(heads), device=device)


def windows_by_head(groups: Iterable[tuple[int, Sequence[int]]]) -> tuple[int, ...]:
    """Each head's key window, from (window, heads) groups that cover every head once."""
    windows = {head: window for window, heads in groups for head in heads}
    return tuple(windows[head] for head in range(len(windows)))


def window_tensor(windows: Sequence[int], device: torch.device) -> Tensor:
    """Each head's window as the fused kernel reads it, (H,) int32 on ``device``."""
    return torch.tensor(windows, dtype=torch.int32, device=device)
