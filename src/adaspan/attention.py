"""Multi-head attention over the previous tokens with a per-head span (paper eqs. 1-3, §2.2).

For a query at position t and a key at r (distance d = t - r, 1 <= d <= S), head scores are

    s_tr = q_t . (k_r + p_d) / sqrt(d_head)          (eq. 1, one p shared by all heads)
    a_tr = m_z(d) exp(s_tr) / sum_q m_z(t - q) exp(s_tq)   (eq. 2 with the soft mask)
    y_t  = sum_r a_tr v_r                            (eq. 3)

Eq. 2 is computed exactly as a softmax of ``s + log m_z(d)`` (m_z = 0 gives -inf: no weight,
no gradient). Computation is truncated to what each head can see: heads are grouped by their key
*window* ``ceil(z + R)`` (rounded up to ``span_bucket``), and each group projects and scores only
the keys of its window (``truncation="head"``), with the band kernels of :mod:`adaspan.band`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .band import banded_attention
from .cache import KeyValueCache, advance, fit_cache
from .config import ModelConfig
from .registry import register_attention
from .span import AdaptiveSpan, DynamicSpan, FixedSpan, Span


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
