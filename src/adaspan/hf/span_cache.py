"""A key/value cache for Hugging Face ``generate`` that holds only what the heads can see.

A head with span parameter z gives weight m_z(x) = 0 to every key at distance x >= z + R
(eq. 2), so it needs only the keys and values of its last ``window`` positions, window =
min(S, ceil(z + R)): the current token and the window - 1 before it. A key/value head serves
a group of query heads: it keeps the window - 1 positions of the group's longest span. Each
layer of :class:`SpanCache` holds those, every head its own number of positions, and reports
every position it has seen as its length, so positions (rotary or learned) stay absolute.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..attention.core import HeadLayout
from ..errors import UserError
from .attention import Part, attached_spans, per_query_head
from .support import layer_states


def cache_argument(model: nn.Module, cache: Cache) -> dict[str, Cache]:
    """``{keyword: cache}`` for ``model``'s forward and ``generate``: the keyword is ``cache``
    where this transformers names it so (5.24 on), ``past_key_values`` where it does not
    (before), which would ignore the other one."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def head_windows(model: nn.Module) -> list[list[int]]:
    """Keys each query head needs, min(S, ceil(z + R)), per layer in layer order (with spans
    per key/value head, each of those heads' for its query heads)."""
    heads = model.config.num_attention_heads
    return [per_query_head(span.windows(None), heads) for span in attached_spans(model)]


def kv_head_windows(query_windows: list[int], kv_heads: int) -> list[int]:
    """Each key/value head's window: the longest of its query heads' ``query_windows``."""
    group = len(query_windows) // kv_heads
    return [max(query_windows[h * group:(h + 1) * group]) for h in range(kv_heads)]


def windows(model: nn.Module) -> list[int]:
    """Keys each layer needs: its longest :func:`head_windows`."""
    return [max(heads) for heads in head_windows(model)]


PADDED_WASTE = 1 / 8  # the most padding, per position kept, of a layer held as one window
PART_BYTES = 1 << 18  # what handing the attention one more group of heads costs, in bytes read


class SpanLayer(DynamicSlidingWindowLayer):
    """The keys and values of one layer: key/value head g keeps its last ``kept[g]`` positions,
    and the sequence's first ``sinks`` positions where the span has sinks, all heads side by
    side in one tensor (B, rows, d) so that transformers' batch operations (beam search's
    reordering, selecting rows) apply unchanged. ``update`` hands the attention, per group of
    key/value heads (``span.parts``; :func:`pad_groups`), (B, h, sinks + L + M, d), L the
    group's longest kept, its shorter heads padded after the sinks with copies of their newest
    key (finite; beyond every window of the head, so weighed 0).

    Without sinks, where padding every head to the layer's longest holds at most
    ``PADDED_WASTE`` more positions than the heads keep (``padded``: key/value heads of near
    spans), the layer keeps (B, Hkv, L, d) instead, transformers' sliding window of L + 1: one
    concatenation per update, no join."""

    def __init__(self, query_windows: list[int], span: nn.Module) -> None:
        super().__init__(sliding_window=max(query_windows))
        self.query_windows = query_windows
        self.span, self.sinks = span, getattr(span, "sinks", 0)
        self.kept: list[int] = []  # positions kept per key/value head, set by the first update
        self._index_cache: tuple = ()  # the key of the last join, its indices and group rows

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor | None = None
                            ) -> None:
        super().lazy_initialization(*layer_states(key_states, value_states))
        B, kv_heads, _, d = key_states.shape
        self.kept = [w - 1 for w in kv_head_windows(self.query_windows, kv_heads)]
        longest = max(self.kept)
        self.padded = (not self.sinks
                       and 0 < kv_heads * longest <= (1 + PADDED_WASTE) * sum(self.kept))
        row_bytes = 2 * B * d * key_states.element_size()  # a position's key and value
        padded_to = {h: max(self.kept[g] for g in group) + 1
                     for group in pad_groups(self.kept, PART_BYTES / row_bytes) for h in group}
        G = len(self.query_windows) // kv_heads
        self.layout = HeadLayout.of([padded_to[h] for h in range(kv_heads) for _ in range(G)],
                                    key_states.device, G)
        self.groups = tuple(tuple(h // G for h in group.members[::G])
                            for group in self.layout.groups)  # their key/value heads

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        if self.padded:
            return super().update(key_states, value_states)
        seen = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        keys, self.keys = self._join(self.keys, key_states, seen)
        values, self.values = self._join(self.values, value_states, seen)
        handed = (min(self.sinks, self.cumulative_length), seen) if self.sinks else None
        B, d = keys.shape[0], keys.shape[-1]
        parts = tuple(Part(None if len(self.groups) == 1 else group,
                           *(t[:, first:last].view(B, len(heads), -1, d) for t in (keys, values)),
                           handed=handed)
                      for group, heads, (first, last) in zip(self.layout.groups, self.groups,
                                                             self._group_rows, strict=True))
        self.span.parts = (parts, self.layout.order)
        return self.keys, self.values

    def _join(self, held: Tensor, new: Tensor, seen: int) -> tuple[Tensor, Tensor]:
        """(the held positions and ``new`` per head, each group's heads padded to its longest,
        group after group: (B, rows, d); what each head keeps of them, side by side), by two
        index operations (:meth:`_indices`)."""
        B, H, M, d = new.shape
        lengths = tuple(min(n, seen) for n in self.kept)
        spread, keep = self._indices(lengths, seen, M, new.device)
        rows = H * min(self.sinks, seen) + sum(lengths)
        parts = [held, new.reshape(B, H * M, d)] if rows else [new.reshape(B, H * M, d)]
        joined = torch.cat(parts, dim=1).index_select(1, spread)
        return joined, joined.index_select(1, keep)

    def _indices(self, lengths: tuple[int, ...], seen: int, M: int, device: torch.device
                 ) -> tuple[Tensor, Tensor]:
        """Rows of [held; new] for each head's sinks + L + M positions, L its group's longest
        (held: every head's sinks, then each head's window; padding: a row of its own, finite,
        beyond every query's window), and the rows kept: the sinks, then those of the windows
        (the same every token once the windows are full, so kept from the last call, with each
        group's first and last row joined)."""
        before, after = min(self.sinks, seen), min(self.sinks, seen + M)
        key = (lengths, before, after, M, device)
        if self._index_cache[:1] != (key,):
            self._index_cache = (key, *_join_indices(lengths, self.kept, self.groups, seen,
                                                     before, after, M, device))
        return self._index_cache[1:3]

    @property
    def _group_rows(self) -> tuple[tuple[int, int], ...]:
        """Each group's first and last row in the last join."""
        return self._index_cache[3]

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("SpanCache keeps no positions to roll back to (assisted decoding): "
                        "use a DynamicCache")


def pad_groups(kept: list[int], part_rows: float) -> tuple[tuple[int, ...], ...]:
    """The key/value heads (their index, in order within a group) handed to the attention in one
    group, each group padded to its longest ``kept``: the split of the heads sorted by ``kept``
    into runs that reads the fewest positions, a group costing as many as ``part_rows`` more
    (handing the attention one more group of heads); groups in the order of their first head."""
    order = sorted(range(len(kept)), key=lambda g: -kept[g])
    best: list[tuple[float, int]] = [(0.0, 0)]  # (cost of the first i heads, start of the last)
    for i in range(1, len(order) + 1):
        best.append(min((best[j][0] + part_rows + (i - j) * kept[order[j]], j)
                        for j in range(i)))
    groups, i = [], len(order)
    while i:
        j = best[i][1]
        groups.append(tuple(sorted(order[j:i])))
        i = j
    return tuple(sorted(groups))


def _join_indices(lengths: tuple[int, ...], kept: list[int], groups: tuple[tuple[int, ...], ...],
                  seen: int, before: int, after: int, M: int, device: torch.device
                  ) -> tuple[Tensor, Tensor, tuple[tuple[int, int], ...]]:
    """:meth:`SpanLayer._indices` for heads holding ``lengths`` positions of their windows
    (``kept``) after ``seen``, ``before`` sinks held and ``after`` once the ``M`` new
    positions are in, joined group by group (``groups``): a few tensor operations per head,
    so that a layer whose windows are still filling (its lengths change every token) pays
    little for them."""
    H = len(lengths)
    held = H * before + sum(lengths)
    windows = list(itertools.accumulate(lengths, initial=H * before))  # each head's first row
    spread, bounds, first, width = [], [], [0] * H, [0] * H
    p = torch.arange(after, device=device)
    row = 0
    for heads in groups:
        L, start = max(lengths[g] for g in heads), row
        for g in heads:
            n, first_new = lengths[g], held + g * M
            spread += [torch.where(p < before, g * before + p, first_new + p - seen),
                       torch.full((L - n,), first_new, device=device),
                       torch.arange(windows[g], windows[g] + n, device=device),
                       torch.arange(first_new, first_new + M, device=device)]
            first[g], width[g] = row, after + L + M
            row += width[g]
        bounds.append((start, row))
    keep = [torch.arange(first[g], first[g] + after, device=device) for g in range(H)]
    keep += [torch.arange(first[g] + after + max(0, width[g] - after - kept[g]),
                          first[g] + width[g], device=device) for g in range(H)]
    return torch.cat(spread), torch.cat(keep), tuple(bounds)


class SpanCache(DynamicCache):
    """``DynamicCache`` whose layers are :class:`SpanLayer` of the model's spans
    (:func:`head_windows`, and the spans' sinks). Built for the spans of the moment: build a
    new one after the spans change."""

    def __init__(self, model: nn.Module) -> None:
        layers = [SpanLayer(w, span) for w, span in zip(head_windows(model),
                                                         attached_spans(model), strict=True)]
        Cache.__init__(self, layers=layers)


def kv_bytes(cache: DynamicCache) -> int:
    """Bytes of keys and values a cache holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)
