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
from .span import Span, soft_mask


def skew(*pieces: Tensor, fill: float = 0.0) -> Tensor:
    """Shift row i of ``x[..., c, w]`` right by i: ``out[..., i, j] = x[..., i, j - i]``.

    ``x`` is the concatenation of ``pieces`` along the last dimension (one tensor, or several
    computed separately). Entries with ``j - i`` outside [0, w) are ``fill``. Output shape
    (..., c, w + c - 1).
    """
    return _Skew.apply(fill, *pieces)


class _Skew(torch.autograd.Function):
    """:func:`skew` with one copy forward (the pieces and the fill written side by side), and
    a backward that reads each piece's gradient from the band as a strided view: no copy."""

    @staticmethod
    def forward(ctx, fill: float, *pieces: Tensor) -> Tensor:
        lead, c = pieces[0].shape[:-2], pieces[0].shape[-2]
        ctx.widths = [piece.shape[-1] for piece in pieces]
        w = sum(ctx.widths)
        pad = pieces[0].new_full((1,), fill).expand(*lead, c, c)
        flat = torch.cat([*pieces, pad], dim=-1).flatten(-2)[..., : c * (w + c - 1)]
        return flat.view(*lead, c, w + c - 1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        grad = grad.contiguous()  # x[..., i, j] sits at offset i * (length + 1) + j
        c, length = grad.shape[-2:]
        stride = (*grad.stride()[:-2], length + 1, 1)
        grads, offset = [], grad.storage_offset()
        for width in ctx.widths:
            grads.append(grad.as_strided((*grad.shape[:-2], c, width), stride, offset))
            offset += width
        return (None, *grads)


class _Windows(torch.autograd.Function):
    """``x.unfold(2, length, step)[:, :, :n]``: ``n`` overlapping windows of the positions of
    ``x`` (B, H, T, dh), as (B, H, n, dh, length). The backward adds each window's gradient back
    with ``n`` slice additions, cheaper than the generic unfold backward."""

    @staticmethod
    def forward(ctx, x: Tensor, length: int, step: int, n: int) -> Tensor:
        ctx.shape, ctx.windows = x.shape, (length, step, n)
        return x.unfold(2, length, step)[:, :, :n]

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        length, step, n = ctx.windows
        dx = grad.new_zeros(ctx.shape)
        for i in range(n):
            dx[:, :, i * step : i * step + length] += grad[:, :, i].transpose(-1, -2)
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


def chunk_size(block: int, window: int) -> int:
    """Queries per chunk: small chunks waste fewer scores (each chunk reads ``window + c - 1``
    keys), large chunks make larger matrix products."""
    return min(block, max(32, min(256, window // 4)))


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
    B, H, M, dh = q.shape
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
    pieces = [position]
    if width:  # eq. 2: m_z(d) exp(s) = exp(s + log m_z(d)), added where m_z < 1 only
        distance = torch.arange(w, w - width, -1, device=q.device, dtype=z.dtype)
        masked = position[..., :width] + log_soft_mask(distance, z, ramp)
        pieces = [masked.to(position.dtype), position[..., width:]]
    # Skewed into "key layout" (column j = key t0 + j); -inf fill = outside the band 1 <= d <= w.
    scores = skew(*pieces, fill=-math.inf).flatten(0, 2)
    length = w + c - 1
    k_win = _Windows.apply(k, length, c, n).flatten(0, 2)  # (B*H*n, dh, L)
    scores = torch.baddbmm(scores, q.flatten(0, 2), k_win)  # eq. 1: q . (k_r + p_{t-r})
    attn = torch.softmax(scores, dim=-1).view(B, H, n, c, length)
    attn = F.dropout(attn, dropout, training)
    v_win = _Windows.apply(v, length, c, n)  # (B, H, n, dh, L)
    out = attn @ v_win.transpose(-1, -2)  # eq. 3, (B, H, n, c, dh)
    return out.flatten(2, 3)[:, :, :M]


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
    """Interface of every attention variant (see ``adaspan.model.ATTENTION_TYPES``).

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

        Cached states and the block are projected separately: the cache needs no input
        gradient, so the backward pass computes one only for the block's own rows.
        """
        past = fit_cache(cache, history).to(x)  # (B, history, D)
        weight = torch.cat([self.k.weight, self.v.weight])  # rows: all of W_k, then W_v

        def keys_values(heads: list[int], start: int) -> tuple[Tensor, Tensor]:
            return self._project(past[:, start:], weight, heads, x)

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

    def _project(
        self, states: Tensor, weight: Tensor, heads: list[int], block: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Keys and values (each (B, len(heads), T, d_head)) of ``states`` (B, T, D), followed
        by those of ``block`` if given, for the heads ``heads``: products with their rows of
        ``weight`` (W_k stacked on W_v)."""
        if len(heads) != self.n_heads:
            rows = torch.arange(self.d_head, device=weight.device)
            rows = torch.cat([rows + h * self.d_head for h in heads])
            weight = weight[torch.cat([rows, rows + self.n_heads * self.d_head])]
        kv = F.linear(states, weight)
        if block is not None:
            kv = torch.cat([kv, F.linear(block, weight)], dim=1)
        B, T, _ = kv.shape
        k, v = kv.view(B, T, 2, len(heads), self.d_head).permute(2, 0, 3, 1, 4)
        return k, v


def _index(heads: list[int]) -> slice | list[int]:
    """``heads`` as a slice (a view, no copy) when they are consecutive."""
    if heads == list(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return heads


def _group(windows: list[int]) -> list[tuple[int, list[int]]]:
    """Heads grouped by key window, longest window first."""
    groups: dict[int, list[int]] = {}
    for head, w in enumerate(windows):
        groups.setdefault(w, []).append(head)
    return sorted(groups.items(), reverse=True)
