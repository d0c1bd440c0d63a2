"""Multi-head attention over the previous tokens with a per-head span (paper eqs. 1-3, §2.2).

For a query at position t and a key at r (distance d = t - r, 1 <= d <= S), head scores are

    s_tr = q_t . (k_r + p_d) / sqrt(d_head)          (eq. 1, one p shared by all heads)
    a_tr = m_z(d) exp(s_tr) / sum_q m_z(t - q) exp(s_tq)   (eq. 2 with the soft mask)
    y_t  = sum_r a_tr v_r                            (eq. 3)

:class:`SpanAttention` projects the queries, keys and values and calls
:func:`adaspan.attention.core.span_attention`, which computes eqs. 1-3 with one of its backends.
Computation is truncated to what each head can see: heads are grouped by their key *window*
``ceil(z + R)`` (rounded up to ``span_bucket``), and in training the cached hidden states are
projected to keys per group, only over that group's window (:class:`_ProjectedKeysValues`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import register_choices
from .cache import KeyValueCache, advance, fit_cache
from .core import HeadGroup, HeadLayout, KeysValues, choose_backend, head_index, span_attention
from .fused import KERNELS, keys_values
from .registry import register_attention
from .rotary import rotate
from .span import AdaptiveSpan, DynamicSpan, FixedSpan, Span, windows_of

if TYPE_CHECKING:  # the configuration is handed down; config.py is a later layer
    from ..config import ModelConfig

BACKEND = {"auto": "auto", "grouped": "band", "fused": "fused"}  # kernel -> the core's backend
register_choices("kernel", KERNELS)


class Attention(nn.Module):
    """Interface of every attention variant (see :data:`adaspan.attention.registry.ATTENTIONS`).

    ``forward(x, cache, pos=None)`` takes the block ``x`` (B, M, D), the layer's cache and the
    model's shared position table ``pos`` (S, d_head) and returns the output and the new cache;
    ``span`` is a :class:`Span`; ``empty_cache`` starts a stream. ``shared_positions`` is True
    when the variant reads the model's table (variants with their own encoding ignore ``pos``).
    """

    shared_positions = False
    d_model: int
    d_head: int
    kv_width: int | None = None  # width of the key and value projections (None: d_model)

    def reach(self, block_size: int) -> list[float]:
        """Effective span of each head with blocks of ``block_size``: the farthest distance
        it attends to (here: its span, ``min(S, z + R)``)."""
        return self.span.spans().tolist()

    def keys_per_query(self, block_size: int) -> list[float]:
        """Keys each head attends to per query, on average over a block of ``block_size``
        (here: its reach)."""
        return self.reach(block_size)

    def flops_per_char(self, block_size: int) -> float:
        """Multiply-adds per character (the paper's FLOPS convention, Tables 1-2): the four
        projections (d x d; those of keys and values d x ``kv_width``), and per key a
        head attends to one product with the query, q . (k + p), and one with the value:
        ``2 d_head`` per key."""
        keys = sum(self.keys_per_query(block_size))
        projections = 2 * self.d_model * (self.d_model + (self.kv_width or self.d_model))
        return projections + 2 * self.d_head * keys

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

    ``kernel`` picks how the heads are computed (:data:`KERNELS`; :func:`use_kernel` sets it for
    a whole model): ``"grouped"``, by group of heads of equal window, each with the band kernel
    of :mod:`adaspan.attention.band` (the CPU's path); ``"fused"``, all heads in one Triton
    kernel of :mod:`adaspan.attention.fused` whatever their windows (CUDA's path; on the CPU,
    Triton's interpreter runs it, for tests); ``"auto"`` (default): fused on CUDA where Triton
    is installed, else grouped. Where the device cannot give the fused kernel its resources,
    every layer on that device takes the band kernels, with one warning.
    """

    kernel = "auto"

    def __init__(self, config: ModelConfig, span: Span) -> None:
        super().__init__()
        d, self.n_heads, self.d_head = config.d_model, config.n_heads, config.d_head
        self.d_model, self.max_span, self.ramp = d, config.max_span, config.ramp
        self.bucket, self.truncation, self.dropout = (config.span_bucket, config.truncation,
                                                      config.dropout)
        self.kv_heads = config.key_value_heads  # each read by n_heads / kv_heads query heads
        self.kv_width = d_kv = self.kv_heads * self.d_head
        self.q, self.k, self.v, self.o = (nn.Linear(d, n, bias=False) for n in (d, d_kv, d_kv, d))
        for proj in (self.q, self.k, self.v, self.o):  # paper: U(-1/sqrt(d), 1/sqrt(d))
            nn.init.uniform_(proj.weight, -(d**-0.5), d**-0.5)
        self.shared_positions = config.position_table == "model"
        self.rotary = config.position_table == "rotary"
        # p_d, d = 1..S: here only with position_table="layer"; else the model passes its own
        self.pos = (None if self.shared_positions or self.rotary
                    else nn.Parameter(torch.randn(config.max_span, config.d_head)))
        self.span = span
        self._last_layout: tuple[tuple, HeadLayout] | None = None  # ((windows, device), layout)
        self._rows: dict[tuple[int, ...], slice | Tensor] = {}  # of W_k, W_v, by head group

    def positions(self, pos: Tensor | None) -> Tensor:
        """The table p_d this layer reads: its own, or the model's ``pos`` (None: rotary)."""
        if self.rotary:
            return None
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
        like = self.q.weight.new_zeros(batch_size, self.kv_heads, 0, self.d_head)
        return KeyValueCache.empty(like)

    def key_windows(self, z: Tensor | None) -> list[int]:
        """Number of past keys each head reads, after truncation and bucketing."""
        return self._key_windows(self.span.z_bounds(z))

    def _key_windows(self, bounds: tuple[list[float], list[float]] | None) -> list[int]:
        if self.truncation == "none":
            return [self.max_span] * self.n_heads
        windows = windows_of(bounds, self.max_span, self.ramp, self.n_heads, self.bucket)
        if self.truncation == "layer":
            return [max(windows)] * self.n_heads
        return windows

    def forward(
        self, x: Tensor, cache: Tensor | KeyValueCache, pos: Tensor | None = None
    ) -> tuple[Tensor, Tensor | KeyValueCache]:
        B, M, _ = x.shape
        pos = self.positions(pos)
        z = self.span(x)
        bounds = self.span.z_bounds(z)  # on the host: no wait when the spans did not change
        layout = self._layout(tuple(self._key_windows(bounds)), x.device)
        history = self.max_span if self.span.input_dependent else layout.longest
        q = self.q(x).view(B, M, self.n_heads, self.d_head).transpose(1, 2)
        kv, new_cache = self._keys_values(x, cache, history)
        if self.rotary:  # positions counted from the first of the T = history + M keys
            q, kv = rotate(q, history), KeysValues(rotate(kv.k, 0), kv.v)
        out = span_attention(q, kv, None, z, max_span=self.max_span, ramp=self.ramp,
                             origin=self.origin, pos=pos, dropout=self.dropout,
                             training=self.training, bounds=bounds, layout=layout,
                             memory=self._memory(), backend=BACKEND[self.kernel])
        return self.o(out.transpose(1, 2).reshape(B, M, -1)), new_cache

    @property
    def origin(self) -> int:
        """The nearest key a query reads: 1 (the paper's keys before it), 0 with rotary
        positions (its own key included, as Hugging Face models)."""
        return 0 if self.rotary else 1

    def uses_fused(self, x: Tensor) -> bool:
        """Whether a forward pass on ``x`` takes the fused kernel (:mod:`adaspan.attention.fused`):
        ``kernel`` ``"fused"``, or ``"auto"`` on CUDA with Triton installed; never for a
        variant that joins memory keys to the softmax."""
        return choose_backend(x, BACKEND[self.kernel], self._memory()) == "fused"

    def _memory(self) -> tuple[Tensor, Tensor] | None:
        """Keys (H, d_head, N) and values (H, N, d_head) joined to every query's softmax, scored
        q . key (none here; persistent memory's)."""
        return None

    def _layout(self, windows: tuple[int, ...], device: torch.device) -> HeadLayout:
        """The head groups of ``windows``, made once per grouping and device (their index
        tensors are uploaded once, not at every forward pass)."""
        if self._last_layout is None or self._last_layout[0] != (windows, device):
            layout = HeadLayout.of(windows, device, self.n_heads // self.kv_heads)
            self._last_layout, self._rows = ((windows, device), layout), {}
        return self._last_layout[1]

    def _keys_values(self, x: Tensor, cache: Tensor | KeyValueCache, history: int
                     ) -> tuple[KeysValues, Tensor | KeyValueCache]:
        """The keys and values of the ``history`` positions before the block and of the
        block, and the new cache: from a :class:`KeyValueCache` (inference), else projected
        from the cached hidden states (recomputed with the current weights), per head group
        except with rotary positions (every key turned)."""
        if isinstance(cache, KeyValueCache):
            return _cached_keys_values(self, x, cache, history)
        past = fit_cache(cache, history).to(x)  # (B, history, D)
        new_cache = advance(past, x, history)
        if self.rotary:
            states = torch.cat([past, x], dim=1)
            return KeysValues(*(self._heads(proj(states)) for proj in (self.k, self.v))), new_cache
        return _ProjectedKeysValues(self, past, x), new_cache

    def _group_rows(self, group: HeadGroup, device: torch.device) -> slice | Tensor:
        """The rows of W_k, W_v of the key/value heads ``group`` reads, on ``device`` (made
        once per layout)."""
        rows = self._rows.get(group.members)
        if rows is None:
            G, dh = self.n_heads // self.kv_heads, self.d_head
            rows = self._rows[group.members] = head_index(
                [h // G * dh + i for h in group.members for i in range(dh)], device)
        return rows

    def _heads(self, t: Tensor) -> Tensor:
        """(B, T, h * d_head) -> (B, h, T, d_head)."""
        return t.unflatten(-1, (-1, self.d_head)).transpose(1, 2)


class _ProjectedKeysValues(KeysValues):
    """The keys and values of a layer's cached hidden states ``past`` and block ``x``
    (training). The band backend reads each head group's from its window's first key: the
    block's keys and values projected once for all heads, the cached states' per group with
    the group's rows of W_k and W_v (views when the heads are consecutive), so that cached
    states beyond every window of a group are not projected for it. The fused backend reads
    every key and value in two products with W_k and W_v side by side."""

    def __init__(self, attn: SpanAttention, past: Tensor, x: Tensor) -> None:
        self.attn, self.past, self.x = attn, past, x
        self.block: tuple[Tensor, Tensor] | None = None

    @property
    def shape(self) -> torch.Size:
        B, T = self.x.shape[0], self.past.shape[1] + self.x.shape[1]
        return torch.Size((B, self.attn.kv_heads, T, self.attn.d_head))

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and (self.x.requires_grad
                                            or self.attn.k.weight.requires_grad)

    def pair(self) -> tuple[Tensor, Tensor]:
        return keys_values(self.stacked())

    def window(self, group: HeadGroup, start: int) -> tuple[Tensor, Tensor]:
        if self.block is None:
            self.block = self.attn.k(self.x), self.attn.v(self.x)  # (B, M, Hkv dh) each
        rows = self.attn._group_rows(group, self.x.device)
        return tuple(
            self.attn._heads(torch.cat([F.linear(self.past[:, start:], proj.weight[rows]),
                                        projected[..., rows]], dim=1))
            for proj, projected in zip((self.attn.k, self.attn.v), self.block, strict=True))

    def stacked(self) -> Tensor:
        attn = self.attn
        weight = torch.cat([attn.k.weight, attn.v.weight])
        kv = torch.cat([F.linear(self.past, weight), F.linear(self.x, weight)], dim=1)
        return kv.unflatten(-1, (2, attn.kv_heads, attn.d_head))  # (B, T, 2, Hkv, dh)


def _cached_keys_values(attn: SpanAttention, x: Tensor, cache: KeyValueCache, history: int
                        ) -> tuple[KeysValues, KeyValueCache]:
    """Keys and values (B, Hkv, history + M, d_head) of the cache of ``attn`` extended by those
    of the block's own tokens, and the new cache (inference)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "a KeyValueCache is for inference under torch.no_grad(): in training the keys "
            "of cached positions are recomputed with the current weights, so pass hidden "
            "states (model.empty_cache(batch_size)) instead")
    B, M, _ = x.shape
    new_k, new_v = (proj(x).view(B, M, attn.kv_heads, attn.d_head).transpose(1, 2)
                    for proj in (attn.k, attn.v))
    keys, values, new_cache = cache.extend(new_k, new_v, history)
    return KeysValues(keys, values), new_cache


def use_kernel(model: nn.Module, kernel: str) -> None:
    """Set the ``kernel`` (one of :data:`KERNELS`) of every :class:`SpanAttention` of
    ``model``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    for module in model.modules():
        if isinstance(module, SpanAttention):
            module.kernel = kernel


def fixed_span(config: ModelConfig) -> FixedSpan:
    """Every head sees the last ``max_span`` tokens (the paper's fixed-span model)."""
    return FixedSpan(config.n_heads, config.max_span, config.ramp)


def adaptive_span(config: ModelConfig) -> AdaptiveSpan:
    """One learned span z per head (paper §2.2), or per layer (``span_per="layer"``)."""
    return AdaptiveSpan(config.n_heads, config.max_span, config.ramp, init=config.span_init,
                        per_layer=config.span_per == "layer")


def dynamic_span(config: ModelConfig) -> DynamicSpan:
    """A span predicted per token, z_t = S sigmoid(v . x_t + b) (paper §2.2, dynamic), per head
    or per layer (``span_per="layer"``)."""
    return DynamicSpan(config.n_heads, config.max_span, config.ramp, config.d_model,
                       config.dynamic_bias_init, per_layer=config.span_per == "layer")


@register_attention("fixed", span=FixedSpan, span_of=fixed_span)
def fixed_span_attention(config: ModelConfig) -> SpanAttention:
    """Span attention with a fixed span (:func:`fixed_span`)."""
    return SpanAttention(config, fixed_span(config))


@register_attention("adaptive", span=AdaptiveSpan, span_of=adaptive_span)
def adaptive_span_attention(config: ModelConfig) -> SpanAttention:
    """Span attention with learned spans (:func:`adaptive_span`)."""
    return SpanAttention(config, adaptive_span(config))


@register_attention("dynamic", span=DynamicSpan, span_of=dynamic_span)
def dynamic_span_attention(config: ModelConfig) -> SpanAttention:
    """Span attention with spans predicted per token (:func:`dynamic_span`)."""
    return SpanAttention(config, dynamic_span(config))
