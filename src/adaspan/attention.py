"""Multi-head attention over the previous tokens with a per-head span (paper eqs. 1-3, §2.2).

For a query at position t and a key at r (distance d = t - r, 1 <= d <= S), head scores are

    s_tr = q_t . (k_r + p_d) / sqrt(d_head)          (eq. 1, one p shared by all heads)
    a_tr = m_z(d) exp(s_tr) / sum_q m_z(t - q) exp(s_tq)   (eq. 2 with the soft mask)
    y_t  = sum_r a_tr v_r                            (eq. 3)

Eq. 2 is computed exactly as a softmax of ``s + log m_z(d)`` (m_z = 0 gives -inf: no weight,
no gradient). Computation is truncated to what each head can see: heads are grouped by their key
*window* ``ceil(z + R)`` (rounded up to ``span_bucket``), and each group projects and scores only
the keys of its window (``truncation="head"``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KeyValueCache, advance, fit_cache
from .config import ModelConfig
from .registry import register_attention
from .span import AdaptiveSpan, DynamicSpan, FixedSpan, Span, soft_mask


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


class _BandSoftmax(torch.autograd.Function):
    """Attention weights of a chunk of queries, eqs. 1-2 in one pass over the score tile:
    ``softmax(q k^T + skew(position + log_mask))`` over keys, -inf outside the band.

    q: (..., c, dh); k_t: (N, dh, L), N the product of the leading dimensions, with
    L = w + c - 1 (key j of the window is column j);
    position: (..., c, w), the position scores in distance layout (column j: distance w - j);
    log_mask: None, or log m_z of the first ``width`` columns of ``position`` (broadcastable).
    The tile is written once by the product, the positions are added through its band view
    and the band's complement is filled with -inf in place (no skew copy, no separate score
    tiles); the backward reads the gradients of ``position`` and ``log_mask`` from the band.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k_t: Tensor, position: Tensor, log_mask: Tensor | None):
        lead, (c, w) = position.shape[:-2], position.shape[-2:]
        ctx.shapes = q.shape, k_t.shape
        q, k_t = q.flatten(0, -3), k_t.flatten(0, -3)  # (N, c, dh), (N, dh, L)
        scores = (q @ k_t).view(*lead, c, w + c - 1)
        band = _band(scores, w)
        band.add_(position)
        if log_mask is not None:
            band[..., : log_mask.shape[-1]].add_(log_mask)
        _band(scores, c, start=w).fill_(-math.inf)
        if scores.dtype in (torch.float32, torch.float64):  # in place: the tile is ours
            attn = torch.ops.aten._softmax.out(scores, -1, False, out=scores)
        else:  # a bf16 tile under autocast: softmax in float32, as autocast does
            attn = torch.softmax(scores, dim=-1, dtype=torch.float32)
        ctx.save_for_backward(q, k_t, attn)
        ctx.log_mask = None if log_mask is None else (log_mask.shape, log_mask.dtype)
        return attn

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k_t, attn = ctx.saved_tensors
        scores = torch._softmax_backward_data(grad, attn, -1, attn.dtype)  # 0 off the band
        w = scores.shape[-1] - scores.shape[-2] + 1
        s, (q_shape, k_shape) = scores.to(q.dtype).flatten(0, -3), ctx.shapes
        grad_q = (s @ k_t.transpose(-1, -2)).view(q_shape) if ctx.needs_input_grad[0] else None
        grad_k = (q.transpose(-1, -2) @ s).view(k_shape) if ctx.needs_input_grad[1] else None
        band = _band(scores, w)
        grad_mask = None
        if ctx.log_mask is not None and ctx.needs_input_grad[3]:
            shape, dtype = ctx.log_mask
            grad_mask = band[..., : shape[-1]].sum_to_size(shape).to(dtype)
        return grad_q, grad_k, band.to(q.dtype), grad_mask


class _Windows(torch.autograd.Function):
    """``n`` overlapping windows of ``length`` positions, ``step`` apart, of ``x`` (B, H, T, dh),
    as a view (B, H, n, length, dh). The backward adds each window's gradient back with ``n``
    slice additions of contiguous rows, cheaper than the generic unfold backward."""

    @staticmethod
    def forward(ctx, x: Tensor, length: int, step: int, n: int) -> Tensor:
        ctx.shape, ctx.windows = x.shape, (length, step, n)
        return x.unfold(2, length, step)[:, :, :n].transpose(-1, -2)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        length, step, n = ctx.windows
        dx = grad.new_zeros(ctx.shape)
        for i in range(n):
            dx[:, :, i * step : i * step + length] += grad[:, :, i]
        return dx, None, None, None


def log_soft_mask(distance: Tensor, z: Tensor, ramp: int) -> Tensor:
    """``log m_z(distance)``, -inf where the mask is 0 (whose weight and gradient are then 0).

    At the kink m_z = 0 (distance exactly z + R) this is the derivative from below: a key of
    zero weight contributes no gradient to z.
    """
    m = soft_mask(distance, z, ramp)
    return torch.where(m > 0, torch.log(m.clamp_min(1e-30)), -math.inf)


def ramp_columns(window: int, z: Tensor) -> int:
    """How many of the ``window`` distances, counted from the farthest (d = window, window - 1,
    ...), have a mask below 1 for some z in ``z``: those with d > z. Nearer keys have m_z = 1."""
    return max(0, min(window, math.ceil(window - z.detach().min().item())))


# Queries per chunk by key window (up to the window), measured with scripts/tune_chunks.py on
# the 2-core CPU (one head, batch 8, block 256, d_head 64; best of 32/64/128/256 for training,
# 2026-11-23): small chunks waste fewer scores (a chunk reads window + c - 1 keys), large ones
# make larger products.
CHUNKS = ((128, 64), (1024, 128), (math.inf, 256))


def chunk_size(block: int, window: int) -> int:
    """Queries per chunk for a block of ``block`` queries over ``window`` keys (:data:`CHUNKS`)."""
    return min(block, next(c for limit, c in CHUNKS if window <= limit))


def banded_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    z: Tensor | None,
    ramp: int,
    dropout: float = 0.0,
    training: bool = False,
) -> Tensor:
    """Attention of each query over the ``w`` keys just before it, with relative positions.

    q: (B, H, M, dh) queries; k, v: (B, H, w + M, dh) keys/values, the last M aligned with the
    queries (query t sits at key index w + t and attends to indices t .. t + w - 1, distances
    w .. 1); pos: (w, dh) embeddings of distances 1..w; z: None (no mask) or the span broadcastable
    to (B, H, M). Queries are processed in chunks of ``c``, each over a window of ``w + c - 1``
    keys, so the cost is about M * (w + c) * dh rather than M * (w + M) * dh.
    """
    M, dh = q.shape[2:]
    w = pos.shape[0]
    if M == 1:
        return _one_query_attention(q, k, v, pos, z, ramp, dropout, training)
    c = chunk_size(M, w)
    n = -(-M // c)
    width = 0 if z is None else ramp_columns(w, z)  # distance columns where m_z < 1
    if n * c != M:
        q = F.pad(q, (0, 0, 0, n * c - M))
        k, v = (F.pad(t, (0, 0, 0, n * c - M)) for t in (k, v))
        z = z if z is None or z.shape[-1] == 1 else F.pad(z, (0, n * c - M))
    q = (q * dh**-0.5).unflatten(2, (n, c))  # (B, H, n, c, dh)
    if z is not None:  # per query: (B|1, H, n|1, c|1, 1)
        z = z[..., None, None] if z.shape[-1] == 1 else z.unflatten(-1, (n, c))[..., None]
    # Position scores q . p_d in "distance layout": column j holds distance d = w - j.
    position = q @ pos.flip(0).t()  # (B, H, n, c, w)
    log_mask = None
    if width:  # eq. 2: m_z(d) exp(s) = exp(s + log m_z(d)), added where m_z < 1 only
        distance = torch.arange(w, w - width, -1, device=q.device, dtype=z.dtype)
        log_mask = log_soft_mask(distance, z, ramp)
    length = w + c - 1  # keys of a chunk's window: key j of it is column j of the scores
    k_win, v_win = (_windows(t, length, c, n) for t in (k, v))  # (B, H, n, L, dh)
    # keys gathered row-wise (a copy only for several chunks), then read transposed by the BLAS
    k_t = k_win.flatten(0, 2).transpose(-1, -2)  # (B*H*n, dh, L)
    attn = _BandSoftmax.apply(q, k_t, position, log_mask)  # eqs. 1-2
    attn = F.dropout(attn, dropout, training)
    out = attn @ v_win  # eq. 3, (B, H, n, c, dh)
    return out.flatten(2, 3)[:, :, :M]


def _windows(x: Tensor, length: int, step: int, n: int) -> Tensor:
    """Key/value windows (B, H, n, length, dh) of the chunks; a single chunk is a slice."""
    if n == 1:
        return x[:, :, None, :length]
    return _Windows.apply(x, length, step, n)


def _one_query_attention(
    q: Tensor, k: Tensor, v: Tensor, pos: Tensor, z: Tensor | None, ramp: int,
    dropout: float, training: bool,
) -> Tensor:
    """:func:`banded_attention` of a single query (generation): keys 0 .. w-1 at distances
    w .. 1, scored directly, without chunks or skew."""
    w = pos.shape[0]
    q = q * q.shape[-1] ** -0.5
    scores = q @ k[:, :, :w].transpose(-1, -2) + (q @ pos.t()).flip(-1)  # eq. 1
    if z is not None:
        distance = torch.arange(w, 0, -1, device=q.device, dtype=z.dtype)
        scores = scores + log_soft_mask(distance, z[..., None], ramp)  # eq. 2
    attn = F.dropout(torch.softmax(scores, dim=-1), dropout, training)
    return attn @ v[:, :, :w]  # eq. 3


class Attention(nn.Module):
    """Interface of every attention variant (see :data:`adaspan.registry.ATTENTIONS`).

    ``forward(x, cache, pos=None)`` takes the block ``x`` (B, M, D), the layer's cache and the
    model's shared position table ``pos`` (S, d_head) and returns the output and the new cache;
    ``span`` is a :class:`Span`; ``empty_cache`` starts a stream. ``shared_positions`` is True
    when the variant reads the model's table (variants with their own encoding ignore ``pos``).
    """

    shared_positions = False
    d_model: int
    d_head: int

    def keys_per_query(self, block_size: int) -> list[float]:
        """Keys each head attends to per query, on average over a block of ``block_size``
        (here: its span, ``min(S, z + R)``)."""
        return self.span.spans().tolist()

    def flops_per_char(self, block_size: int) -> float:
        """Multiply-adds per character (the paper's FLOPS convention, Tables 1-2): the four
        d x d projections, and per key a head attends to one product with the query,
        q . (k + p), and one with the value: ``2 d_head`` per key."""
        keys = sum(self.keys_per_query(block_size))
        return 4 * self.d_model**2 + 2 * self.d_head * keys

    def empty_cache(self, batch_size: int, keys_values: bool = False) -> Tensor | KeyValueCache:
        """Cache of a stream's start: no history (read as zero hidden states). This variant
        always caches hidden states, whatever ``keys_values``."""
        return next(self.parameters()).new_zeros(batch_size, 0, self.d_model)


class SpanAttention(Attention):
    """Multi-head attention whose heads see at most their span of past tokens.

    ``forward(x, cache)`` takes the block ``x`` (B, M, D) and either the previous hidden states
    (B, C, D) or, at inference, a :class:`KeyValueCache`, and returns the output and the new
    cache of the same kind: what this layer's heads can still see next block (for dynamic
    spans, which depend on the next tokens, the last S positions).
    """

    def __init__(self, config: ModelConfig, span: Span) -> None:
        super().__init__()
        d, self.n_heads, self.d_head = config.d_model, config.n_heads, config.d_head
        self.d_model, self.max_span, self.ramp = d, config.max_span, config.ramp
        self.bucket, self.truncation, self.dropout = (config.span_bucket, config.truncation,
                                                      config.dropout)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        for proj in (self.q, self.k, self.v, self.o):  # paper: U(-1/sqrt(d), 1/sqrt(d))
            nn.init.uniform_(proj.weight, -(d**-0.5), d**-0.5)
        self.shared_positions = config.position_table == "model"
        # p_d, d = 1..S: here only with position_table="layer"; else the model passes its own
        self.pos = (None if self.shared_positions
                    else nn.Parameter(torch.randn(config.max_span, config.d_head)))
        self.span = span

    def positions(self, pos: Tensor | None) -> Tensor:
        """The table p_d this layer reads: its own, or the model's ``pos``."""
        if (pos is None) != self.shared_positions:
            return self.pos if pos is None else pos
        raise ValueError(
            "this attention reads the model's position table (position_table='model'): pass it "
            "as forward(x, cache, pos)" if pos is None else
            "this attention has its own position table (position_table='layer'): pass no pos")

    def empty_cache(self, batch_size: int, keys_values: bool = False) -> Tensor | KeyValueCache:
        """No history; ``keys_values=True`` gives a :class:`KeyValueCache` (inference only)."""
        if not keys_values:
            return super().empty_cache(batch_size)
        like = self.q.weight.new_zeros(batch_size, self.n_heads, 0, self.d_head)
        return KeyValueCache.empty(like)

    def key_windows(self, z: Tensor | None) -> list[int]:
        """Number of past keys each head reads, after truncation and bucketing."""
        if self.truncation == "none":
            return [self.max_span] * self.n_heads
        windows = [min(self.max_span, -(-w // self.bucket) * self.bucket)
                   for w in self.span.windows(z)]
        if self.truncation == "layer":
            return [max(windows)] * self.n_heads
        return windows

    def forward(
        self, x: Tensor, cache: Tensor | KeyValueCache, pos: Tensor | None = None
    ) -> tuple[Tensor, Tensor | KeyValueCache]:
        B, M, _ = x.shape
        pos = self.positions(pos)
        z = self.span(x)
        windows = self.key_windows(z)
        history = self.max_span if self.span.input_dependent else max(windows)
        if isinstance(cache, KeyValueCache):
            keys_values, new_cache = self._cached_keys_values(x, cache, history)
        else:
            keys_values, new_cache = self._projected_keys_values(x, cache, history)
        q = self.q(x).view(B, M, self.n_heads, self.d_head).transpose(1, 2)
        outputs, order = [], []
        for w, heads in _group(windows):
            k, v = keys_values(heads, history - w)
            zg = None if z is None else z[:, _index(heads)]
            outputs.append(banded_attention(q[:, _index(heads)], k, v, pos[:w], zg,
                                            self.ramp, self.dropout, self.training))
            order += heads
        out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
        if order != sorted(order):
            out = out[:, torch.tensor(order, device=x.device).argsort()]
        return self.o(out.transpose(1, 2).reshape(B, M, -1)), new_cache

    def _projected_keys_values(self, x: Tensor, cache: Tensor, history: int):
        """Keys/values from the cached hidden states, projected per head group (training).

        The block's keys and values are projected once for all heads; the cached states, per
        head group, with that group's rows of W_k and W_v (views when the heads are
        consecutive). Cached states need no input gradient: the backward pass computes one
        only for the block's own rows.
        """
        past = fit_cache(cache, history).to(x)  # (B, history, D)
        block = self.k(x), self.v(x)  # (B, M, D) each

        def keys_values(heads: list[int], start: int) -> tuple[Tensor, Tensor]:
            rows = _rows(heads, self.d_head, x.device)
            return tuple(
                self._heads(torch.cat([F.linear(past[:, start:], proj.weight[rows]),
                                       projected[..., rows]], dim=1))
                for proj, projected in zip((self.k, self.v), block, strict=True))

        return keys_values, advance(past, x, history)

    def _cached_keys_values(self, x: Tensor, cache: KeyValueCache, history: int):
        """Keys/values of the cache extended by those of the block's own tokens (inference)."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                "a KeyValueCache is for inference under torch.no_grad(): in training the keys "
                "of cached positions are recomputed with the current weights, so pass hidden "
                "states (model.empty_cache(batch_size)) instead")
        B, M, _ = x.shape
        new_k, new_v = (proj(x).view(B, M, self.n_heads, self.d_head).transpose(1, 2)
                        for proj in (self.k, self.v))
        keys, values, new_cache = cache.extend(new_k, new_v, history)

        def keys_values(heads: list[int], start: int) -> tuple[Tensor, Tensor]:
            return keys[:, _index(heads), start:], values[:, _index(heads), start:]

        return keys_values, new_cache

    def _heads(self, t: Tensor) -> Tensor:
        """(B, T, h * d_head) -> (B, h, T, d_head)."""
        return t.unflatten(-1, (-1, self.d_head)).transpose(1, 2)


def _index(heads: list[int]) -> slice | list[int]:
    """``heads`` as a slice (a view, no copy) when they are consecutive."""
    if heads == list(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return heads


def _rows(heads: list[int], d_head: int, device: torch.device) -> slice | Tensor:
    """The rows (of W_k, W_v) or columns (of keys, values) of the heads ``heads``: a slice
    (a view, no copy) when they are consecutive."""
    index = _index(heads)
    if isinstance(index, slice):
        return slice(index.start * d_head, index.stop * d_head)
    return torch.cat([torch.arange(h * d_head, (h + 1) * d_head, device=device) for h in heads])


def _group(windows: list[int]) -> list[tuple[int, list[int]]]:
    """Heads grouped by key window, in the order of their first head (so that the outputs of
    groups of consecutive heads are concatenated in head order, with no reordering)."""
    groups: dict[int, list[int]] = {}
    for head, w in enumerate(windows):
        groups.setdefault(w, []).append(head)
    return list(groups.items())


@register_attention("fixed")
def fixed_span_attention(config: ModelConfig) -> SpanAttention:
    """Every head sees the last ``max_span`` tokens (the paper's fixed-span model)."""
    return SpanAttention(config, FixedSpan(config.n_heads, config.max_span, config.ramp))


@register_attention("adaptive")
def adaptive_span_attention(config: ModelConfig) -> SpanAttention:
    """One learned span z per head (paper §2.2)."""
    return SpanAttention(config, AdaptiveSpan(config.n_heads, config.max_span, config.ramp,
                                              init=config.span_init))


@register_attention("dynamic")
def dynamic_span_attention(config: ModelConfig) -> SpanAttention:
    """A span predicted per token, z_t = S sigmoid(v . x_t + b) (paper §2.2, dynamic)."""
    return SpanAttention(config, DynamicSpan(config.n_heads, config.max_span, config.ramp,
                                             config.d_model, config.dynamic_bias_init))
