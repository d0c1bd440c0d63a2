"""Multi-head attention over the previous tokens with a per-head span (paper eqs. 1-3, §2.2).

For a query at position t and a key at r (distance d = t - r, 1 <= d <= S), head scores are

    s_tr = q_t . (k_r + p_d) / sqrt(d_head)          (eq. 1, one p shared by all heads)
    a_tr = m_z(d) exp(s_tr) / sum_q m_z(t - q) exp(s_tq)   (eq. 2 with the soft mask)
    y_t  = sum_r a_tr v_r                            (eq. 3)

Eq. 2 is computed exactly as a softmax of ``s + log m_z(d)`` (m_z = 0 gives -inf: no weight,
no gradient). Computation is truncated to what each head can see: heads are grouped by their key
*window* ``ceil(z + R)`` (rounded up to ``span_bucket``), and each group projects and scores
only the keys of its window (``truncation="head"``), with the band kernels of
:mod:`adaspan.attention.band`; or, on CUDA, every head in one kernel that reads each head's
window as data (:mod:`adaspan.attention.fused`: as many kernel launches however many windows a
layer has).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import fused
from .band import banded_attention
from .cache import KeyValueCache, advance, fit_cache
from .functional import grouped_span_attention, head_index, rotate, window_tensor, windows_by_head
from .fused import KERNELS
from .registry import register_attention
from .span import AdaptiveSpan, DynamicSpan, FixedSpan, Span, windows_of

if TYPE_CHECKING:  # the configuration is handed down; config.py is a later layer
    from ..config import ModelConfig


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
    is installed, else grouped. A fused kernel that the device cannot give its resources sets
    the layer's ``kernel`` to ``"grouped"``, with one warning per device.
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
        # functional: rotary or grouped-query heads, computed by functional.span_attention's
        # convention (keys at distances 0 .. S-1, the query's own included)
        self.functional = self.rotary or self.kv_heads != self.n_heads
        # p_d, d = 1..S: here only with position_table="layer"; else the model passes its own
        self.pos = (None if self.shared_positions or self.rotary
                    else nn.Parameter(torch.randn(config.max_span, config.d_head)))
        self.span = span
        self._last_layout: tuple[tuple, _Layout] | None = None  # ((windows, device), layout)

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
        if self.functional:
            out, new_cache = _functional_heads(self, x, q, cache, z, bounds, layout, history)
        elif self.uses_fused(x):
            out, new_cache = _fused_heads(self, x, q, cache, pos, z, bounds, layout, history)
        else:
            out, new_cache = _grouped_heads(self, x, q, cache, pos, z, bounds, layout, history)
        return self.o(out.reshape(B, M, -1)), new_cache

    def uses_fused(self, x: Tensor) -> bool:
        """Whether a forward pass on ``x`` takes the fused kernel (:mod:`adaspan.attention.fused`):
        ``kernel`` ``"fused"``, or ``"auto"`` on CUDA with Triton installed; never for a
        subclass that joins keys to the softmax (its own :meth:`_attend`)."""
        if type(self)._attend is not SpanAttention._attend or self.kernel == "grouped":
            return False
        return self.kernel == "fused" or (x.is_cuda and fused.available())

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, pos: Tensor, z: Tensor | None,
                z_min: float | None, heads: slice | Tensor) -> Tensor:
        """Eqs. 1-3 for the heads ``heads`` of one group, over their window of keys (the band
        kernel); a subclass may join more keys to their softmax."""
        return banded_attention(q, k, v, pos, z, self.ramp, self.dropout, self.training,
                                z_min=z_min)

    def _layout(self, windows: tuple[int, ...], device: torch.device) -> _Layout:
        """The head groups of ``windows``, made once per grouping and device (their index
        tensors are uploaded once, not at every forward pass)."""
        if self._last_layout is None or self._last_layout[0] != (windows, device):
            self._last_layout = (windows, device), _Layout.of(windows, self.d_head, device)
        return self._last_layout[1]

    def _projected_keys_values(self, x: Tensor, cache: Tensor, history: int):
        """Keys/values from the cached hidden states, projected per head group (training).

        The block's keys and values are projected once for all heads; the cached states, per
        head group, with that group's rows of W_k and W_v (views when the heads are
        consecutive). Cached states need no input gradient: the backward pass computes one
        only for the block's own rows.
        """
        past = fit_cache(cache, history).to(x)  # (B, history, D)
        block = self.k(x), self.v(x)  # (B, M, D) each

        def keys_values(group: _Group, start: int) -> tuple[Tensor, Tensor]:
            return tuple(
                self._heads(torch.cat([F.linear(past[:, start:], proj.weight[group.rows]),
                                       projected[..., group.rows]], dim=1))
                for proj, projected in zip((self.k, self.v), block, strict=True))

        return keys_values, advance(past, x, history)

    def _heads(self, t: Tensor) -> Tensor:
        """(B, T, h * d_head) -> (B, h, T, d_head)."""
        return t.unflatten(-1, (-1, self.d_head)).transpose(1, 2)


def _grouped_heads(attn: SpanAttention, x: Tensor, q: Tensor, cache: Tensor | KeyValueCache,
                   pos: Tensor, z: Tensor | None, bounds: tuple | None, layout: _Layout,
                   history: int) -> tuple[Tensor, Tensor | KeyValueCache]:
    """The outputs (B, M, H, dh) of the heads of ``attn`` by head group, each group over its
    own window with the band kernel of :mod:`adaspan.attention.band` (``attn._attend``), and the new
    cache."""
    if isinstance(cache, KeyValueCache):
        keys, values, new_cache = _cached_keys_values(attn, x, cache, history)
        keys_values = _sliced(keys, values)
    else:
        keys_values, new_cache = attn._projected_keys_values(x, cache, history)
    return _by_group(attn, q, keys_values, pos, z, bounds, layout, history), new_cache


def _cached_keys_values(attn: SpanAttention, x: Tensor, cache: KeyValueCache, history: int
                        ) -> tuple[Tensor, Tensor, KeyValueCache]:
    """Keys and values (B, H, history + M, d_head) of the cache of ``attn`` extended by those
    of the block's own tokens, and the new cache (inference)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            "a KeyValueCache is for inference under torch.no_grad(): in training the keys "
            "of cached positions are recomputed with the current weights, so pass hidden "
            "states (model.empty_cache(batch_size)) instead")
    B, M, _ = x.shape
    new_k, new_v = (proj(x).view(B, M, attn.kv_heads, attn.d_head).transpose(1, 2)
                    for proj in (attn.k, attn.v))
    return cache.extend(new_k, new_v, history)


def _functional_heads(attn: SpanAttention, x: Tensor, q: Tensor, cache: Tensor | KeyValueCache,
                      z: Tensor | None, bounds: tuple | None, layout: _Layout, history: int
                      ) -> tuple[Tensor, Tensor | KeyValueCache]:
    """The outputs (B, M, H, dh) of rotary or grouped-query heads with
    :func:`~adaspan.attention.functional.grouped_span_attention` (keys at distances 0 .. w - 1,
    each head over its window: in the fused kernel where :meth:`SpanAttention.uses_fused`,
    else by head group), and the new cache. The keys of the cached states are
    recomputed, and rotary positions count from the first of the T = history + M keys: the
    same relative positions whatever the block."""
    if isinstance(cache, KeyValueCache):  # keys kept unrotated, turned at every block
        keys, values, new_cache = _cached_keys_values(attn, x, cache, history)
    else:
        past = fit_cache(cache, history).to(x)  # (B, history, D)
        states = torch.cat([past, x], dim=1)
        keys, values = (attn._heads(proj(states)) for proj in (attn.k, attn.v))
        new_cache = advance(past, x, history)
    T, M = keys.shape[2], q.shape[2]
    if attn.rotary:
        q, keys = rotate(q, T - M), rotate(keys, 0)
    groups = [(min(g.window, T), list(g.members),
               0.0 if bounds is None else min(bounds[0][h] for h in g.members))
              for g in layout.groups]
    fused_kernel = attn.uses_fused(x)
    kept = fused_kernel and layout.longest <= T  # the layout's windows, none capped at T
    out = grouped_span_attention(q, keys, values, z, groups, attn.ramp, dropout=attn.dropout,
                                 training=attn.training, kernel=fused_kernel,
                                 windows=layout.windows if kept else None)
    return out.transpose(1, 2), new_cache


def _sliced(keys: Tensor, values: Tensor):
    """Each group's keys and values from ``start``: slices of every head's (B, H, T, dh)."""

    def keys_values(group: _Group, start: int) -> tuple[Tensor, Tensor]:
        return keys[:, group.heads, start:], values[:, group.heads, start:]

    return keys_values


def _by_group(attn: SpanAttention, q: Tensor, keys_values, pos: Tensor, z: Tensor | None,
              bounds: tuple | None, layout: _Layout, history: int) -> Tensor:
    """The outputs (B, M, H, dh) of every head group over its window, the group's keys and
    values given by ``keys_values(group, start)``."""
    outputs = []
    for group in layout.groups:
        k, v = keys_values(group, history - group.window)
        zg, z_min = None, None
        if z is not None:
            zg, z_min = z[:, group.heads], min(bounds[0][h] for h in group.members)
        outputs.append(attn._attend(q[:, group.heads], k, v, pos[: group.window], zg,
                                    z_min, group.heads))
    out = torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]
    if layout.order is not None:
        out = out[:, layout.order]
    return out.transpose(1, 2)


def _fused_heads(attn: SpanAttention, x: Tensor, q: Tensor, cache: Tensor | KeyValueCache,
                 pos: Tensor, z: Tensor | None, bounds: tuple | None, layout: _Layout,
                 history: int) -> tuple[Tensor, Tensor | KeyValueCache]:
    """The outputs (B, M, H, dh) of the heads of ``attn`` in one kernel whatever their
    windows, and the new cache. In training, the keys and values of the cached states and of
    the block are two products with W_k and W_v side by side (no weights sliced per head).
    Where the kernels are not compiled for these heads
    (:func:`adaspan.attention.fused.compiled`), or the device cannot run them (the layer's
    ``kernel`` then set to ``"grouped"``), the same keys and values by head group."""
    if isinstance(cache, KeyValueCache):
        keys, values, new_cache = _cached_keys_values(attn, x, cache, history)
        kv = keys, values
    else:
        past = fit_cache(cache, history).to(x)  # (B, history, D)
        weight = torch.cat([attn.k.weight, attn.v.weight])
        kv = torch.cat([F.linear(past, weight), F.linear(x, weight)], dim=1)
        kv = kv.unflatten(-1, (2, attn.n_heads, attn.d_head))  # (B, T, 2, H, dh)
        new_cache = advance(past, x, history)
    dropout = attn.dropout if attn.training else 0.0
    backward = torch.is_grad_enabled() and q.requires_grad
    if not q.is_cuda or fused.compiled(q.dtype, attn.d_head, fused.precision(q.dtype, "cuda"),
                                       backward):
        try:
            out = fused.band_attention(q, kv, pos, z, layout.windows, history, attn.ramp,
                                       dropout)
            return out, new_cache
        except fused.ResourcesExceeded as exc:
            _warn_once(x.device, f"the fused attention kernel cannot run here ({exc}); span "
                                 "attention takes the grouped path (the band kernels) instead")
            attn.kernel = "grouped"
    keys_values = _sliced(*(kv if isinstance(kv, tuple) else fused.keys_values(kv)))
    return _by_group(attn, q, keys_values, pos, z, bounds, layout, history), new_cache


_warned: set[torch.device] = set()  # devices where the fused kernel could not run


def _warn_once(device: torch.device, message: str) -> None:
    """Warn with ``message``, the first time only for this device."""
    if device not in _warned:
        _warned.add(device)
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def use_kernel(model: nn.Module, kernel: str) -> None:
    """Set the ``kernel`` (one of :data:`KERNELS`) of every :class:`SpanAttention` of
    ``model``."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    for module in model.modules():
        if isinstance(module, SpanAttention):
            module.kernel = kernel


@dataclass(frozen=True)
class _Group:
    """Heads ``members`` that read the same key ``window``: their index in the head dimension
    (``heads``) and their rows of W_k, W_v (``rows``), slices (views) when they are consecutive,
    else index tensors on the device."""

    window: int
    members: tuple[int, ...]
    heads: slice | Tensor
    rows: slice | Tensor


@dataclass(frozen=True)
class _Layout:
    """Heads grouped by key window, in the order of their first head (groups of consecutive
    heads are concatenated in head order, with no reordering); ``order`` puts the outputs
    back in head order otherwise; ``longest`` is the longest window; ``device`` that of the
    index tensors."""

    groups: tuple[_Group, ...]
    order: Tensor | None
    longest: int
    device: torch.device

    @functools.cached_property
    def windows(self) -> Tensor:
        """Each head's window, (H,) int32 on the device (for the fused kernel; uploaded at
        its first use)."""
        return window_tensor(windows_by_head((g.window, g.members) for g in self.groups),
                             self.device)

    @classmethod
    def of(cls, windows: tuple[int, ...], d_head: int, device: torch.device) -> _Layout:
        members: dict[int, list[int]] = {}
        for head, w in enumerate(windows):
            members.setdefault(w, []).append(head)
        groups = [_Group(w, tuple(heads), *_indices(heads, d_head, device))
                  for w, heads in members.items()]
        order = [h for g in groups for h in g.members]
        inverse = (None if order == sorted(order)
                   else torch.tensor(order, device=device).argsort())
        return cls(tuple(groups), inverse, max(windows), device)


def _indices(heads: list[int], d_head: int, device: torch.device
             ) -> tuple[slice | Tensor, slice | Tensor]:
    """The heads ``heads`` as an index of the head dimension and of the rows of W_k, W_v:
    slices (views, no copy) when they are consecutive, else index tensors on ``device``."""
    rows = [h * d_head + i for h in heads for i in range(d_head)]
    return head_index(heads, device), head_index(rows, device)


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
