"""Span attention: the paper's eqs. 1-3 for any queries, keys and values, in one function.

:func:`span_attention` is the one place that applies the soft mask and the softmax of span
attention outside the kernels. Query i of the M newest positions sits at position T - M + i
among the T keys; a key ``o`` positions behind it (o = 0 its own) is read when
``origin <= o < origin + S`` and weighed by

    m_z(o) = clamp((R + z - o) / R, 0, 1)                                        (eq. 2)

``origin`` is 1 in the paper's layer (the keys strictly before the query, distances d = 1 .. S)
and 0 in models that attend to their own key (Hugging Face models, rotary or grouped-query
SpanLM heads). Scores are s = scale q . (k + p), p row ``o - origin`` of an optional table of
relative positions (eq. 1). Each head reads only its key window ``ceil(z + R)`` (truncation),
with one of three backends:

- ``band``: heads grouped by window, each group over only its keys in chunked band products
  (:mod:`adaspan.attention.band`; any device). Learned keys and values joined to every query's
  softmax (``memory``: persistent memory) are computed here.
- ``fused``: every head in one Triton kernel whatever its window
  (:mod:`adaspan.attention.fused`; CUDA, or Triton's interpreter on the CPU).
- ``decode``: a few queries without gradients (generation): every head at once over the longest
  window, the mask a precomputed log-mask (:func:`span_log_mask`).

``backend="auto"`` picks decode where a log-mask is given and the call decodes, else fused on
CUDA with Triton, else band. :func:`decode_step` is the decode backend of one query per head
written into preallocated buffers (the batch-1 decoder's).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from . import fused
from . import sinks as sink_part
from .band import banded_attention, log_soft_mask
from .sinks import Sinks
from .span import head_bounds, key_window

BACKENDS = ("auto", "band", "fused", "decode")
DECODE_QUERIES = 32  # "auto" decodes calls of at most this many queries given a log-mask
Bounds = tuple[list[float], list[float]]  # each head's least and greatest z, on the host


class KeysValues:
    """The keys and values (B, Hkv, T, d) of one call. A layer that makes them on demand
    (keys projected per head group, only over each group's window) subclasses it."""

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.k, self.v = k, v

    @property
    def shape(self) -> torch.Size:
        """(B, Hkv, T, d)."""
        return self.k.shape

    @property
    def requires_grad(self) -> bool:
        """Whether gradients flow back through the keys or values."""
        return self.k.requires_grad or self.v.requires_grad

    def pair(self) -> tuple[Tensor, Tensor]:
        """Every key and value, (B, Hkv, T, d) each."""
        return self.k, self.v

    def window(self, group: HeadGroup, start: int) -> tuple[Tensor, Tensor]:
        """The keys and values (B, h, T - start, d) read by ``group``'s query heads, from key
        ``start`` on."""
        return self.k[:, group.kv, start:], self.v[:, group.kv, start:]

    def stacked(self) -> Tensor | tuple[Tensor, Tensor]:
        """Every key and value as the fused kernel reads them: (B, T, 2, Hkv, d)."""
        return torch.stack([self.k.transpose(1, 2), self.v.transpose(1, 2)], dim=2)


@dataclass(frozen=True)
class HeadGroup:
    """Query heads ``members`` that read the same key ``window``: their index in the query
    heads' dimension (``heads``) and of their key/value heads (``kv``), slices (views) when
    consecutive, else index tensors on the device."""

    window: int
    members: tuple[int, ...]
    heads: slice | Tensor
    kv: slice | Tensor


@dataclass(frozen=True)
class HeadLayout:
    """Query heads grouped by key window, in the order of their first head (groups of
    consecutive heads are joined in head order); ``order`` puts the outputs back in head order
    otherwise; ``longest`` is the longest window; ``device`` that of the index tensors. Made
    once per grouping by a layer whose windows stay (:meth:`of`)."""

    groups: tuple[HeadGroup, ...]
    order: Tensor | None
    longest: int
    device: torch.device

    @functools.cached_property
    def windows(self) -> Tensor:
        """Each head's window, (H,) int32 on the device (the fused kernel's; uploaded at its
        first use)."""
        by_head = {h: g.window for g in self.groups for h in g.members}
        return torch.tensor([by_head[h] for h in range(len(by_head))], dtype=torch.int32,
                            device=self.device)

    @classmethod
    def of(cls, windows: Sequence[int], device: torch.device, group_size: int = 1) -> HeadLayout:
        """The layout of heads whose key windows are ``windows``, query head h reading key/value
        head h // ``group_size``."""
        members: dict[int, list[int]] = {}
        for head, w in enumerate(windows):
            members.setdefault(w, []).append(head)
        groups = [HeadGroup(w, tuple(heads), head_index(heads, device),
                            head_index([h // group_size for h in heads], device))
                  for w, heads in members.items()]
        order = [h for g in groups for h in g.members]
        inverse = (None if order == sorted(order)
                   else torch.tensor(order, device=device).argsort())
        return cls(tuple(groups), inverse, max(windows), device)

    def capped(self, keys: int, group_size: int) -> HeadLayout:
        """This layout with no window longer than ``keys`` (itself where none is)."""
        if self.longest <= keys:
            return self
        by_head = {h: min(g.window, keys) for g in self.groups for h in g.members}
        return HeadLayout.of([by_head[h] for h in range(len(by_head))], self.device, group_size)


def head_index(heads: Sequence[int], device: torch.device) -> slice | Tensor:
    """The heads ``heads`` as an index of a head dimension: a slice (a view) when they are
    consecutive, else an index tensor on ``device``."""
    if list(heads) == list(range(heads[0], heads[-1] + 1)):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(list(heads), device=device)


def span_attention(q: Tensor, k: Tensor | KeysValues, v: Tensor | None,
                   z: Tensor | Callable[[], Tensor] | None, *,
                   max_span: int, ramp: float, origin: int = 0, pos: Tensor | None = None,
                   scale: float | None = None, dropout: float = 0.0, training: bool = False,
                   bounds: Bounds | None = None, layout: HeadLayout | None = None,
                   memory: tuple[Tensor, Tensor] | None = None, log_mask: Tensor | None = None,
                   key_mask: Tensor | None = None, sinks: Sinks | None = None,
                   key_offsets: Tensor | None = None, backend: str = "auto",
                   z_min: float | None = None,
                   z_host: list[float] | Callable[[], list[float]] | None = None) -> Tensor:
    """Eqs. 1-3 of the M newest positions over the keys ``origin`` .. ``origin + S - 1``
    positions behind each. Returns (B, Hq, M, d) in the dtype of q.

    q: (B, Hq, M, d); k, v: (B, Hkv, T, d), T >= M + origin, the last M keys the queries' own,
    query head h reading key head h // (Hq / Hkv); or ``k`` a :class:`KeysValues`, ``v`` None.
    z: None (every key in reach weighs 1) or the span, broadcastable to (B, Hq, M), or a
    function that gives it (called only by the backends that read z, not by decode). ``pos``:
    the table (S, d) of p by offset (row o - origin), None for no position product (rotary
    positions in q and k); ``scale`` defaults to d ** -0.5; ``dropout`` on the weights in
    ``training``.

    The windows come from each head's greatest z on the host: ``bounds`` (each head's least and
    greatest z), else ``z_host`` (each head's z, the same for every row and query, or a
    function that gives it, called only where z is read), else read from z (one host read;
    ``z_min``, the least z, saves reading the least). A ``layout`` of the caller's
    windows (S, or bucketed, possibly longer than ``ceil(z + R)``) replaces them. ``memory``:
    keys (Hq, d, N) and values (Hq, N, d) joined to every query's softmax without mask or
    position, scored q . key (the caller folds in any scale; band backend only).
    ``log_mask``: the decode backend's (Hq, W) of :func:`span_log_mask`. ``key_mask``: (B, T),
    False for keys that are not there (a padded batch's pads), which then weigh 0 (decode
    backend). ``backend``: one of :data:`BACKENDS`; a fused kernel that cannot run these heads
    falls back to band. ``sinks``: the keys and values of the sequence's first positions, which
    weigh 1 for every query they precede (:mod:`adaspan.attention.sinks`; no table, no memory
    keys, no key mask; band or decode). ``key_offsets``: (T,) each key's offset behind the one
    query, for keys out of order (a ring buffer's; decode backend, origin 0, no table).
    """
    kv = k if isinstance(k, KeysValues) else KeysValues(k, v)
    B, Hq, M, d = q.shape
    T, Hkv = _check(q, kv, pos, max_span, origin)
    _check_sinks(sinks, pos, memory, key_mask)
    scale = d**-0.5 if scale is None else scale
    choice = choose_backend(q, backend, memory, log_mask, training and dropout > 0, key_mask,
                            sinks is not None)
    _check_offsets(key_offsets, choice, log_mask, M, T, origin, pos)
    if choice == "decode":
        return _decode(q, *kv.pair(), log_mask, origin, pos, scale, key_mask, sinks, key_offsets)
    if scale != d**-0.5:  # the band and fused kernels scale by d ** -0.5
        q = q * (scale * d**0.5)
    z = z() if callable(z) else z
    z = None if z is None else _per_head(z, B, Hq, M)
    bounds = _bounds(z, bounds, z_min, z_host, Hq)
    if layout is None:
        layout = _layout(bounds, Hq, Hq // Hkv, max_span, ramp, q.device)
    layout = layout.capped(T, Hq // Hkv)
    if choice == "fused":
        out = _fused(q, kv, z, layout, ramp, origin, pos, dropout if training else 0.0)
        if out is not None:
            return out
    extra = _Extra(memory, sinks, max_span, d**-0.5)
    return _band(q, kv, z, bounds, layout, ramp, origin, pos, dropout, training, extra)


def choose_backend(q: Tensor, backend: str, memory: object = None,
                   log_mask: Tensor | None = None, drops: bool = False,
                   key_mask: Tensor | None = None, sinks: bool = False) -> str:
    """The backend a call takes: ``backend``, or for ``"auto"`` decode where a log-mask is given
    for at most :data:`DECODE_QUERIES` queries without gradients or dropout, else fused on CUDA
    with Triton installed, else band; band wherever memory keys are joined, and for fused on a
    device that could not run the kernel, and band for fused with ``sinks``; decode wherever
    keys are masked (``key_mask``)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if key_mask is not None:
        if log_mask is None or memory is not None:
            raise ValueError("a key_mask needs the decode backend: give its log_mask (and no "
                             "memory keys)")
        return "decode"
    if backend == "auto":
        decodes = (log_mask is not None and q.shape[2] <= DECODE_QUERIES and not drops
                   and not torch.is_grad_enabled())
        backend = "decode" if decodes else "fused" if q.is_cuda and fused.available() else "band"
    if memory is not None or (backend == "fused" and (sinks or q.device in _refused)):
        return "band"
    return backend


def _bounds(z: Tensor | None, bounds: Bounds | None, z_min: float | None,
            z_host: list[float] | Callable[[], list[float]] | None, H: int) -> Bounds | None:
    """Each head's least and greatest z on the host (None without z)."""
    if z is None or bounds is not None:
        return bounds if z is not None else None
    if z_host is not None:
        z_host = z_host() if callable(z_host) else z_host
        return list(z_host), list(z_host)
    if z_min is not None:
        return [z_min] * H, z.detach().amax(dim=(0, 2)).tolist()
    return head_bounds(z)


def _layout(bounds: Bounds | None, H: int, group_size: int, max_span: int, ramp: float,
            device: torch.device) -> HeadLayout:
    """Heads grouped by their key window ``ceil(z + R)`` (S without z)."""
    if bounds is None:
        return HeadLayout.of([max_span] * H, device, group_size)
    return HeadLayout.of([key_window(g, max_span, ramp) for g in bounds[1]], device, group_size)


@dataclass(frozen=True)
class _Extra:
    """Keys the band backend joins to its softmax: memory keys or sinks (or none)."""

    memory: tuple[Tensor, Tensor] | None
    sinks: Sinks | None
    max_span: int
    scale: float  # the band kernel's, d ** -0.5: q carries any other

    @property
    def joined(self) -> bool:
        return self.memory is not None or self.sinks is not None

    def part(self, q: Tensor, group: HeadGroup, z: Tensor | None, ramp: float,
             origin: int) -> tuple[Tensor, Tensor]:
        """The logits (B, h, M, N) and values of the joined keys for ``group``'s queries ``q``;
        z: the group's (B|1, h, M|1), or None."""
        if self.memory is not None:
            keys, values = (m[group.heads] for m in self.memory)
            return q @ keys, values
        sinks = self.sinks
        offsets = sinks.offsets(q.shape[2], q.device)
        weights = sink_part.band_weights(z, offsets, ramp, origin, self.max_span)
        logits = sink_part.scores(q, sinks.k[:, group.kv], weights, offsets, origin, self.scale)
        return logits, sinks.v[:, group.kv]


def _band(q: Tensor, kv: KeysValues, z: Tensor | None, bounds: Bounds | None,
          layout: HeadLayout, ramp: float, origin: int, pos: Tensor | None, dropout: float,
          training: bool, extra: _Extra) -> Tensor:
    """The band backend: each head group over its window with the band kernel, whose distance
    d = o + 1 - origin (its z is z + 1 - origin, its table row d - 1 that of offset o), joined
    to the ``extra`` keys' softmax."""
    T, M, shift = kv.shape[2], q.shape[2], 1 - origin
    outputs = []
    for group in layout.groups:
        w = group.window
        lo = T - M - w + shift  # the first key of the first query's window
        k, v = kv.window(group, max(lo, 0))
        if lo < 0:  # the first queries' windows begin before position 0: absent keys
            k, v = (F.pad(t, (0, 0, -lo, 0)) for t in (k, v))
        zg = z_least = None
        if z is not None:
            zg = z[:, group.heads] + shift if shift else z[:, group.heads]
            z_least = min(bounds[0][h] for h in group.members) + shift
        table = None if pos is None else pos[:w].to(q.dtype)
        out = banded_attention(q[:, group.heads], k, v, table, zg, ramp, dropout, training,
                               z_min=z_least, window=w, start=max(-lo, 0),
                               normaliser=extra.joined)
        if extra.joined:
            own_z = None if z is None else z[:, group.heads]
            part = extra.part(q[:, group.heads], group, own_z, ramp, origin)
            out = sink_part.join(*out, *part, dropout, training)
        outputs.append(out)
    if len(outputs) == 1:
        return outputs[0].to(q.dtype)
    out = torch.cat(outputs, dim=1)
    return (out if layout.order is None else out[:, layout.order]).to(q.dtype)


_refused: set[torch.device] = set()  # devices that cannot run the fused kernel


def _fused(q: Tensor, kv: KeysValues, z: Tensor | None, layout: HeadLayout, ramp: float,
           origin: int, pos: Tensor | None, dropout: float) -> Tensor | None:
    """The fused backend: every head in one kernel, each over its window (its distance is
    o + 1 - origin, its history T - M + 1 - origin; without ``pos`` its table is zeros); None
    where the kernel is not compiled for these heads or the device cannot run it (then never
    tried there again, with one warning)."""
    backward = torch.is_grad_enabled() and (kv.requires_grad or any(
        t is not None and t.requires_grad for t in (q, z, pos)))
    if q.is_cuda and not fused.compiled(q.dtype, q.shape[-1],
                                        fused.precision(q.dtype, "cuda"), backward):
        return None
    shift, (T, M) = 1 - origin, (kv.shape[2], q.shape[2])
    table = q.new_zeros(layout.longest, q.shape[-1]) if pos is None else pos
    zb = z + shift if z is not None and shift else z
    try:
        keys_values = kv.stacked() if backward else kv.pair()  # a pair: inference, no copy
        out = fused.fused_attention(q, keys_values, table, zb, layout.windows, T - M + shift,
                                   ramp, dropout)
    except fused.ResourcesExceeded as exc:
        _refused.add(q.device)
        warnings.warn(f"the fused attention kernel cannot run here ({exc}); span attention "
                      "takes the band kernels instead", RuntimeWarning, stacklevel=3)
        return None
    return out.transpose(1, 2)


def span_log_mask(z: Tensor | Sequence[float], window: int, ramp: float,
                  origin: int = 0) -> Tensor:
    """log m_z(o) of each head (H, ``window``) at offsets o = origin + window - 1 .. origin
    (the oldest key first, as keys are stored), -inf where m_z(o) = 0: for ``z`` a tensor (H,),
    in its dtype and on its device; for each head's z on the host, computed in float64 and
    returned in float32."""
    if not isinstance(z, Tensor):
        return span_log_mask(torch.tensor(z, dtype=torch.float64), window, ramp, origin).float()
    o = torch.arange(origin + window - 1, origin - 1, -1, dtype=z.dtype, device=z.device)
    return log_soft_mask(o, z[:, None], ramp)


def _decode(q: Tensor, k: Tensor, v: Tensor, log_mask: Tensor, origin: int,
            pos: Tensor | None, scale: float, key_mask: Tensor | None = None,
            sinks: Sinks | None = None, key_offsets: Tensor | None = None) -> Tensor:
    """The decode backend: every head at once over the keys the longest window W sees,
    log m_z(o) (``log_mask`` (Hq, W)) plus the scores in one product, a softmax (float32),
    times v; grouped-query heads read their key head without copying it (q as
    (B Hkv, G M, d)). ``sinks`` join the keys in front, weighed log(1 - b); ``key_offsets``
    replace the keys' offsets W - 1 .. 0."""
    B, Hq, M, d = q.shape
    Hkv, T, W = k.shape[1], k.shape[2], log_mask.shape[1]
    n = min(T, W + M - 1 + origin)  # the keys some query sees
    if key_offsets is not None:  # (1, n): a ring buffer's
        o = key_offsets[None]
    elif M == 1 and pos is None and origin == 0:
        o = None
    else:  # (M, n) offsets
        o = n - M + torch.arange(M, device=q.device)[:, None] - torch.arange(n, device=q.device)
    mask = _offset_mask(log_mask, o, n, origin).to(q.dtype).expand(B, Hq, M, n)
    if pos is not None:  # q . p of each pair's own table row, scaled
        p = pos[:W].to(q.dtype)[(o - origin).clamp(0, W - 1)]  # (M, n, d)
        mask = mask + scale * torch.einsum("bhmd,mnd->bhmn", q, p)
    if key_mask is not None:  # the finite least: a query without keys weighs them alike
        absent = ~key_mask[:, None, None, T - n:].to(q.device, torch.bool)
        mask = mask.masked_fill(absent, torch.finfo(mask.dtype).min)
    rows = Hq // Hkv * M
    keys, values = (t[:, :, T - n:] for t in (k, v))
    if sinks is not None:
        offsets = sinks.offsets(M, q.device)
        front = sink_part.decode_logits(log_mask, offsets, origin).to(mask.dtype)
        mask = torch.cat([front.expand(B, Hq, M, -1), mask], dim=-1)
        keys, values = (sinks.joined if sinks.joined is not None and n == T else
                        (torch.cat([sinks.k, keys], dim=2), torch.cat([sinks.v, values], dim=2)))
        n += sinks.k.shape[2]
    keys, values = (t.reshape(B * Hkv, n, d) for t in (keys, values))
    scores = torch.baddbmm(mask.reshape(B * Hkv, rows, n), q.reshape(B * Hkv, rows, d),
                           keys.transpose(1, 2), alpha=scale)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.bmm(weights, values).view(B, Hq, M, d)


def _offset_mask(log_mask: Tensor, o: Tensor | None, n: int, origin: int) -> Tensor:
    """log m_z(o) of each head for the keys' offsets ``o`` (M, n), -inf outside origin ..
    origin + W - 1: (Hq, M, n); o None: one query over the last n keys, its own the last (a
    view)."""
    W = log_mask.shape[1]
    if o is None:
        return log_mask[:, None, W - n:]
    column = W - 1 + origin - o
    return log_mask[:, column.clamp(0, W - 1)].masked_fill((column < 0) | (column >= W),
                                                           -math.inf)


def decode_step(scores: Tensor, q: Tensor, keys_t: Tensor, values: Tensor, out: Tensor) -> Tensor:
    """The decode backend for one query per head, in preallocated buffers (the batch-1
    decoder's): ``scores`` (H, 1, W) holds log m_z + q . p of each key on entry; q . k is added
    (eq. 1; q carries 1 / sqrt(d)), the softmax taken in place (eq. 2) and the weights times
    the values written to ``out`` (H, 1, d) (eq. 3). q: (H, 1, d); keys_t: (H, d, W); values:
    (H, W, d)."""
    scores.baddbmm_(q, keys_t)
    torch.softmax(scores, -1, out=scores)
    return torch.bmm(scores, values, out=out)


def _check(q: Tensor, kv: KeysValues, pos: Tensor | None, max_span: int,
           origin: int) -> tuple[int, int]:
    """T and Hkv, once the shapes are those of :func:`span_attention`."""
    plain = type(kv) is KeysValues  # a layer's own source is shaped by the layer
    if q.dim() != 4 or (plain and (kv.k.dim() != 4 or kv.k.shape != kv.v.shape)):
        raise ValueError(f"q must be (B, Hq, M, d) and k, v (B, Hkv, T, d), got q "
                         f"{tuple(q.shape)}, k {tuple(kv.k.shape)}, v {tuple(kv.v.shape)}")
    (B, Hq, M, d), (Bk, Hkv, T, dk) = q.shape, kv.shape
    if (Bk, dk) != (B, d) or Hq % Hkv or M + origin > T:
        raise ValueError(f"q {tuple(q.shape)} and k, v {tuple(kv.shape)} must share B and d, "
                         "with query heads a multiple of key heads and T >= M (T > M with "
                         "origin 1: a key before the first query)")
    if pos is not None and tuple(pos.shape) != (max_span, d):
        raise ValueError(f"pos must be (max_span, d) = ({max_span}, {d}), "
                         f"got {tuple(pos.shape)}")
    if max_span < 1 or origin not in (0, 1):
        raise ValueError(f"max_span must be at least 1 and origin 0 or 1, got {max_span} "
                         f"and {origin}")
    return T, Hkv


def _check_sinks(sinks: Sinks | None, pos: Tensor | None, memory: object,
                 key_mask: Tensor | None) -> None:
    """Sinks go with positions in q and k (no table), without memory keys or a key mask."""
    if sinks is not None and (pos is not None or memory is not None or key_mask is not None):
        raise ValueError("sinks take no table of positions, memory keys or key mask")


def _check_offsets(key_offsets: Tensor | None, choice: str, log_mask: Tensor | None, M: int,
                   T: int, origin: int, pos: Tensor | None) -> None:
    """``key_offsets`` go with the decode backend, a log-mask of W >= T columns, one query
    over T keys, origin 0, no table."""
    if key_offsets is None:
        return
    if (choice != "decode" or log_mask is None or M != 1 or origin or pos is not None
            or tuple(key_offsets.shape) != (T,) or log_mask.shape[1] < T):
        raise ValueError("key_offsets (T,) take the decode backend and its log_mask (W >= T "
                         "columns), one query, origin 0 and no table")


def _per_head(z: Tensor, B: int, H: int, M: int) -> Tensor:
    """``z`` as (B|1, H, M|1), each head's own (an expanded view where heads share one)."""
    z = z.reshape((1,) * (3 - z.dim()) + tuple(z.shape)) if z.dim() < 3 else z
    if z.dim() != 3 or torch.broadcast_shapes(z.shape, (B, H, M)) != (B, H, M):
        raise ValueError(f"z must be broadcastable to (B, Hq, M) = {(B, H, M)}, "
                         f"got {tuple(z.shape)}")
    return z.expand(z.shape[0], H, z.shape[2])
