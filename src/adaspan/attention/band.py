"""The band kernels of span attention (paper eqs. 1-3 over a band of keys).

A query at position t attends to the ``w`` keys just before it (distances w .. 1). The kernels
here compute that band in chunks of queries, each chunk over the ``w + c - 1`` keys it can see,
so the cost is about ``M (w + c) d_head`` rather than ``M (w + M) d_head``:

- :func:`banded_attention`: eqs. 1-3 for a block of queries (or one query, in generation),
  and on request each query's log-normaliser, log sum_r m_z(d) exp(s_tr), to join other keys
  (the persistent memory of :mod:`adaspan.attention.persistent`) to the softmax;
- :class:`_BandSoftmax`: eqs. 1-2 in one pass over a score tile, the relative positions and the
  soft mask added through a strided view of the tile's band;
- :data:`CHUNKS` and :func:`chunk_size`: queries per chunk by key window;
- :func:`skew`: the distance layout to key layout shift, used by the baselines.

``torch.compile`` runs both public kernels eagerly (graph breaks) and compiles what is around
them.

Used by :mod:`adaspan.attention.span_attention` (span attention),
:mod:`adaspan.attention.baselines` and :mod:`adaspan.attention.persistent`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .span import soft_mask


def _eager(kernel: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``kernel`` excluded from ``torch.compile``'s tracing: inside a compiled model it runs
    eagerly (a graph break), since the band kernels write in place through strided views,
    which the compiler mistranslates. Eager calls pay one flag check, and importing this module
    does not import the compiler (``torch._dynamo``) except on torch < 2.3."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if is_compiling is None:  # torch < 2.3: excluded now, at the price of that import
        from torch import _dynamo

        return _dynamo.disable(kernel)

    @functools.wraps(kernel)
    def run(*args: Any, **kwargs: Any) -> Tensor:
        if is_compiling():
            return torch.compiler.disable(kernel)(*args, **kwargs)
        return kernel(*args, **kwargs)

    return run


@_eager
def skew(x: Tensor, fill: float = 0.0) -> Tensor:
    """Shift row i of ``x[..., c, w]`` right by i: ``out[..., i, j] = x[..., i, j - i]``.

    Entries with ``j - i`` outside [0, w) are ``fill``. Output shape (..., c, w + c - 1).
    """
    return _Skew.apply(fill, x)


def _band(out: Tensor, width: int, start: int = 0) -> Tensor:
    """``out[..., i, i + start + j]`` for j < width, a strided view of ``out`` (..., c, length)
    (contiguous in its last two dimensions): element (i, i + j) sits at offset
    i * (length + 1) + j. With ``start = w`` and ``width = c`` (rows 0 .. c - 2) it is the gap
    between one row's band of w entries and the next row's."""
    c, length = out.shape[-2:]
    rows = c if start == 0 else c - 1
    stride = (*out.stride()[:-2], length + 1, 1)
    return out.as_strided((*out.shape[:-2], rows, width), stride, out.storage_offset() + start)


class _Skew(torch.autograd.Function):
    """:func:`skew` with one copy forward (``x`` and the fill written side by side), and a
    backward that reads the gradient of ``x`` from the band as a strided view: no copy."""

    @staticmethod
    def forward(ctx, fill: float, x: Tensor) -> Tensor:
        lead, (c, w) = x.shape[:-2], x.shape[-2:]
        ctx.w = w
        pad = x.new_full((1,), fill).expand(*lead, c, c)
        flat = torch.cat([x, pad], dim=-1).flatten(-2)[..., : c * (w + c - 1)]
        return flat.view(*lead, c, w + c - 1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor]:
        return None, _band(grad.contiguous(), ctx.w)


def _private_op(find):
    """A private ATen entry point of this torch, or None where it has no such name."""
    try:
        return find()
    except (AttributeError, RuntimeError):
        return None


# ATen's own softmax kernels under their private names (present in torch 2.x): the forward
# written into the score tile, the backward without a temporary. The public formulas below
# stand in where a torch lacks them (tested to agree).
_SOFTMAX_OUT = _private_op(lambda: torch.ops.aten._softmax.out)
_SOFTMAX_BACKWARD = _private_op(lambda: torch._softmax_backward_data)


def _softmax_in_place(scores: Tensor) -> Tensor:
    """Softmax over the last dimension, written into ``scores`` where this torch allows it."""
    if _SOFTMAX_OUT is None:
        return torch.softmax(scores, dim=-1)
    return _SOFTMAX_OUT(scores, -1, False, out=scores)


def _softmax_backward(grad: Tensor, attn: Tensor) -> Tensor:
    """Gradient of the scores from that of ``attn = softmax(scores)``:
    ``attn * (grad - sum(grad * attn))`` over the last dimension."""
    if _SOFTMAX_BACKWARD is None:
        return attn * (grad - (grad * attn).sum(-1, keepdim=True))
    return _SOFTMAX_BACKWARD(grad, attn, -1, attn.dtype)


class _BandSoftmax(torch.autograd.Function):
    """Attention weights of a chunk of queries, eqs. 1-2 in one pass over the score tile:
    ``softmax(q k^T + skew(position + log_mask))`` over keys, -inf outside the band.

    q: (..., c, dh); k_t: (N, dh, L), N the product of the leading dimensions, with
    L = w + c - 1 (key j of the window is column j);
    position: (..., c, w), the position scores in distance layout (column j: distance w - j),
    or None (no positions: rotary, or none);
    log_mask: None, or log m_z of the first ``width`` columns of ``position`` (broadcastable);
    normaliser: return ``(attn, lse)``, also the log-sum-exp of each row's scores (whose
    gradient flows back to the scores as ``attn`` times it); ``start``: the keys of index below
    it in the padded sequence (q's chunks are the third dimension from the end) are absent.
    The tile is written once by the product, the positions are added through its band view
    and the band's complement is filled with -inf in place (no skew copy, no separate score
    tiles); the backward reads the gradients of ``position`` and ``log_mask`` from the band.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k_t: Tensor, position: Tensor | None, log_mask: Tensor | None,
                normaliser: bool = False, start: int = 0):
        lead, c = q.shape[:-2], q.shape[-2]
        w = k_t.shape[-1] - c + 1
        ctx.shapes, ctx.positions = (q.shape, k_t.shape), position is not None
        q, k_t = q.flatten(0, -3), k_t.flatten(0, -3)  # (N, c, dh), (N, dh, L)
        scores = (q @ k_t).view(*lead, c, w + c - 1)
        if scores.dtype not in (torch.float32, torch.float64):  # a bf16 product (autocast):
            scores = scores.float()  # positions, mask and softmax in fp32, logits rounded once
        band = _band(scores, w)
        if position is not None:
            band.add_(position)
        if log_mask is not None:
            band[..., : log_mask.shape[-1]].add_(log_mask)
        _band(scores, c, start=w).fill_(-math.inf)
        for i in range(min(-(-start // c), scores.shape[-3])):  # chunk i's columns below
            # ``start`` (keys i c + j of the padded sequence) are absent keys
            scores[..., i, :, : start - i * c].fill_(-math.inf)
        lse = torch.logsumexp(scores, -1) if normaliser else None
        attn = _softmax_in_place(scores)  # the tile is ours
        ctx.save_for_backward(q, k_t, attn)
        ctx.log_mask = None if log_mask is None else (log_mask.shape, log_mask.dtype)
        return (attn, lse) if normaliser else attn

    @staticmethod
    def backward(ctx, grad: Tensor, grad_lse: Tensor | None = None
                 ) -> tuple[Tensor | None, ...]:
        q, k_t, attn = ctx.saved_tensors
        scores = _softmax_backward(grad, attn)  # 0 off the band
        if grad_lse is not None:  # d lse / d s = attn
            scores = scores.addcmul_(attn, grad_lse[..., None])
        w = scores.shape[-1] - scores.shape[-2] + 1
        s, (q_shape, k_shape) = scores.to(q.dtype).flatten(0, -3), ctx.shapes
        grad_q = (s @ k_t.transpose(-1, -2)).view(q_shape) if ctx.needs_input_grad[0] else None
        grad_k = (q.transpose(-1, -2) @ s).view(k_shape) if ctx.needs_input_grad[1] else None
        band = _band(scores, w)
        grad_mask = None
        if ctx.log_mask is not None and ctx.needs_input_grad[3]:
            shape, dtype = ctx.log_mask
            grad_mask = band[..., : shape[-1]].sum_to_size(shape).to(dtype)
        grad_position = band.to(q.dtype) if ctx.positions else None
        return grad_q, grad_k, grad_position, grad_mask, None, None


class _Windows(torch.autograd.Function):
    """``n`` overlapping windows of ``length`` positions, ``step`` apart, of ``x`` (B, H, T, dh),
    as a view (B, H, n, length, dh). The backward sums each position's gradient over the
    windows holding it, in whichever of two ways takes fewer operators: window by window (a
    slice addition each), or by pieces of ``step`` rows: rows j*step .. (j+1)*step - 1 of
    every window fall on disjoint positions (window i's at (i + j) step), so each piece is one
    operator over all the windows, a copy for j = 0 (no zero fill under it) and an addition
    for each later j: ceil(length / step) operators, fewer when windows overlap less than
    ``n`` deep."""

    @staticmethod
    def forward(ctx, x: Tensor, length: int, step: int, n: int) -> Tensor:
        ctx.shape, ctx.windows = x.shape, (length, step, n)
        return x.unfold(2, length, step)[:, :, :n].transpose(-1, -2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        length, step, n = ctx.windows
        if -(-length // step) >= n:
            dx = grad.new_zeros(ctx.shape)
            for i in range(n):
                dx[:, :, i * step : i * step + length] += grad[:, :, i]
            return dx, None, None, None
        dx = grad.new_empty(ctx.shape)
        dx[:, :, n * step :].zero_()
        for start in range(0, length, step):
            rows = min(step, length - start)
            piece, part = _pieces(dx, start, step, n, rows), grad[:, :, :, start : start + rows]
            if start:
                piece.add_(part)
            else:
                piece.copy_(part)
        return dx, None, None, None


def _pieces(x: Tensor, start: int, step: int, n: int, rows: int) -> Tensor:
    """The view (B, H, n, rows, dh) of ``x`` (B, H, T, dh) whose piece i is positions
    start + i * step .. + rows - 1."""
    B, H, _, dh = x.shape
    s = x.stride()
    return x.as_strided((B, H, n, rows, dh), (s[0], s[1], step * s[2], s[2], s[3]),
                        x.storage_offset() + start * s[2])


def log_soft_mask(distance: Tensor, z: Tensor, ramp: int) -> Tensor:
    """``log m_z(distance)``, -inf where the mask is 0 (whose weight and gradient are then 0).

    At the kink m_z = 0 (distance exactly z + R) this is the derivative from below: a key of
    zero weight contributes no gradient to z.
    """
    m = soft_mask(distance, z, ramp)
    return torch.where(m > 0, torch.log(m.clamp_min(1e-30)), -math.inf)


def ramp_columns(window: int, z_min: float) -> int:
    """How many of the ``window`` distances, counted from the farthest (d = window, window - 1,
    ...), have a mask below 1 for some z >= ``z_min``: those with d > z. Nearer keys have
    m_z = 1."""
    return max(0, min(window, math.ceil(window - z_min)))


# Queries per chunk by key window (up to the window), measured with scripts/bench/tune_chunks.py on
# the 2-core CPU (one head, batch 8, block 256, d_head 64; best of 32/64/128/256 for training,
# 2026-11-23): small chunks waste fewer scores (a chunk reads window + c - 1 keys), large ones
# make larger products. On CUDA (where span attention takes this path only without Triton, or
# with persistent memory; not measured: no GPU was at hand) a block is one chunk:
# fewer, larger kernels, the wasted scores being cheap there.
CHUNKS = ((128, 64), (1024, 128), (math.inf, 256))


def chunk_size(block: int, window: int, device: str = "cpu") -> int:
    """Queries per chunk for a block of ``block`` queries over ``window`` keys on a device of
    type ``device`` (:data:`CHUNKS` on the CPU, the whole block on CUDA)."""
    if device == "cuda":
        return block
    return min(block, next(c for limit, c in CHUNKS if window <= limit))


@_eager
def banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor | None,
    z: Tensor | None,
    ramp: int,
    dropout: float = 0.0,
    training: bool = False,
    chunk: int | None = None,
    z_min: float | None = None,
    normaliser: bool = False,
    window: int | None = None,
    start: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of each query over the ``w`` keys just before it, with relative positions.

    q: (B, H, M, dh) queries; k, v: (B, H, w + M, dh) keys/values (w + M - 1 suffice), the
    last M aligned with the queries (query t sits at key index w + t and attends to indices
    t .. t + w - 1, distances w .. 1; those below ``start`` absent); pos: (w, dh) embeddings of
    distances 1..w, or None (no position product; ``window`` gives w); z: None (no mask) or
    the span broadcastable to (B, H, M). Queries are processed in chunks of ``c`` (each over
    ``w + c - 1`` keys: cost M (w + c) dh, not M (w + M) dh); ``c`` is :func:`chunk_size`
    unless ``chunk`` is given. ``z_min``, the least z on the host, saves a host-device
    synchronisation. With ``normaliser``, returns ``(out, lse)``, lse (B, H, M) the log of each
    query's softmax denominator, log sum_r m_z(d) exp(s_tr), in the scores' dtype (fp32 for a
    bf16 product): the output of the same attention with more keys joined to its softmax is
    then a mixture of ``out`` and theirs (dropout, on the weights, commutes with that scaling).
    """
    M, dh = q.shape[2:]
    w = pos.shape[0] if pos is not None else window
    if M == 1:
        return _one_query_attention(q, k, v, pos, z, ramp, dropout, training, normaliser, w, start)
    c = min(M, chunk) if chunk else chunk_size(M, w, q.device.type)
    n = -(-M // c)
    if z is not None and z_min is None:
        z_min = z.detach().min().item()
    width = 0 if z is None else ramp_columns(w, z_min)  # distance columns where m_z < 1
    if n * c != M:
        q = F.pad(q, (0, 0, 0, n * c - M))
        k, v = (F.pad(t, (0, 0, 0, w + n * c - k.shape[2])) for t in (k, v))
        z = z if z is None or z.shape[-1] == 1 else F.pad(z, (0, n * c - M))
    q = (q * dh**-0.5).unflatten(2, (n, c))  # (B, H, n, c, dh)
    if z is not None:  # per query: (B|1, H, n|1, c|1, 1)
        z = z[..., None, None] if z.shape[-1] == 1 else z.unflatten(-1, (n, c))[..., None]
    # Position scores q . p_d in "distance layout": column j holds distance d = w - j.
    position = None if pos is None else q @ pos.flip(0).t()  # (B, H, n, c, w)
    log_mask = None
    if width:  # eq. 2: m_z(d) exp(s) = exp(s + log m_z(d)), added where m_z < 1 only
        distance = torch.arange(w, w - width, -1, device=q.device, dtype=torch.float32)
        log_mask = log_soft_mask(distance, z, ramp)  # fp32: distances exact up to 2**24
    length = w + c - 1  # keys of a chunk's window: key j of it is column j of the scores
    k_win, v_win = (_windows(t, length, c, n) for t in (k, v))  # (B, H, n, L, dh)
    # keys gathered row-wise (a copy only for several chunks), then read transposed by the BLAS
    k_t = k_win.flatten(0, 2).transpose(-1, -2)  # (B*H*n, dh, L)
    attn = _BandSoftmax.apply(q, k_t, position, log_mask, normaliser, start)  # eqs. 1-2
    attn, lse = attn if normaliser else (attn, None)
    attn = F.dropout(attn, dropout, training)
    out = (attn.to(v_win.dtype) @ v_win).flatten(2, 3)[:, :, :M]  # eq. 3; attn is fp32
    return (out, lse.flatten(2, 3)[:, :, :M]) if normaliser else out


def _windows(x: Tensor, length: int, step: int, n: int) -> Tensor:
    """Key/value windows (B, H, n, length, dh) of the chunks; a single chunk is a slice."""
    if n == 1:
        return x[:, :, None, :length]
    return _Windows.apply(x, length, step, n)


def _one_query_attention(
    q: Tensor, k: Tensor, v: Tensor, pos: Tensor | None, z: Tensor | None, ramp: int,
    dropout: float, training: bool, normaliser: bool = False, w: int = 0, start: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`banded_attention` of a single query (generation): keys 0 .. w-1 at distances
    w .. 1 (those below ``start`` absent), scored directly, without chunks or skew."""
    q = q * q.shape[-1] ** -0.5
    scores = q @ k[:, :, :w].transpose(-1, -2)  # eq. 1
    if pos is not None:
        scores = scores + (q @ pos.t()).flip(-1)
    if z is not None:
        distance = torch.arange(w, 0, -1, device=q.device, dtype=torch.float32)
        scores = scores + log_soft_mask(distance, z[..., None], ramp)  # eq. 2
    if start:
        scores[..., :start] = -math.inf
    attn = F.dropout(torch.softmax(scores, dim=-1), dropout, training)
    out = attn.to(v.dtype) @ v[:, :, :w]  # eq. 3
    return (out, torch.logsumexp(scores, -1)) if normaliser else out
