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

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..errors import UserError
from .attention import attached_spans, per_query_head


def cache_argument(model: nn.Module, cache: Cache) -> dict[str, Cache]:
    """``{keyword: cache}`` for ``model``'s forward and ``generate``: the keyword is ``cache``
    where this transformers names it so (5.2x), ``past_key_values`` where it does not (5.17),
    which would ignore the other one."""
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


def windows(model: nn.Module) -> list[int]:
    """Keys each layer needs: its longest :func:`head_windows`."""
    return [max(heads) for heads in head_windows(model)]


PADDED_WASTE = 1 / 8  # the most padding, per position kept, of a layer held as one window


class SpanLayer(DynamicSlidingWindowLayer):
    """The keys and values of one layer: key/value head g keeps its last ``kept[g]`` positions,
    all heads side by side in one tensor (B, sum of kept, d) so that transformers' batch
    operations (beam search's reordering, selecting rows) apply unchanged. ``update`` hands the
    attention (B, Hkv, L + M, d), L the longest kept, shorter heads padded at the front with
    copies of their newest key (finite; beyond every window of the head, so weighed 0).

    Where padding every head to L holds at most ``PADDED_WASTE`` more positions than the heads
    keep (``padded``: key/value heads of near spans), the layer keeps (B, Hkv, L, d) instead,
    transformers' sliding window of L + 1: one concatenation per update, no join."""

    def __init__(self, query_windows: list[int]) -> None:
        super().__init__(sliding_window=max(query_windows))
        self.query_windows = query_windows
        self.kept: list[int] = []  # positions kept per key/value head, set by the first update
        self._index_cache: tuple = ()  # (lengths, M, device), then the indices of the last join

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        kv_heads = key_states.shape[1]
        group = len(self.query_windows) // kv_heads
        self.kept = [max(self.query_windows[g * group:(g + 1) * group]) - 1
                     for g in range(kv_heads)]
        longest = max(self.kept)
        self.padded = 0 < kv_heads * longest <= (1 + PADDED_WASTE) * sum(self.kept)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.padded:
            return super().update(key_states, value_states)
        seen = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        keys, self.keys = self._join(self.keys, key_states, seen)
        values, self.values = self._join(self.values, value_states, seen)
        return keys, values

    def _join(self, held: Tensor, new: Tensor, seen: int) -> tuple[Tensor, Tensor]:
        """(the held positions and ``new`` per head, padded: (B, Hkv, L + M, d); what each head
        keeps of them, side by side), by two index operations (:meth:`_indices`)."""
        B, H, M, d = new.shape
        lengths = tuple(min(n, seen) for n in self.kept)
        spread, keep = self._indices(lengths, M, new.device)
        parts = [held, new.reshape(B, H * M, d)] if sum(lengths) else [new.reshape(B, H * M, d)]
        joined = torch.cat(parts, dim=1).index_select(1, spread).view(B, H, -1, d)
        return joined, joined.view(B, -1, d).index_select(1, keep)

    def _indices(self, lengths: tuple[int, ...], M: int, device: torch.device
                 ) -> tuple[Tensor, Tensor]:
        """Rows of [held; new] for each head's L + M positions (padding: a row of its own,
        finite, beyond every query's window), and the positions each head keeps: those of the
        last call kept (the same every token once the windows are full)."""
        key = (lengths, M, device)
        if self._index_cache[:1] != (key,):
            L, held = max(lengths), sum(lengths)
            spread, keep, offset = [], [], 0
            for g, n in enumerate(lengths):
                first_new = held + g * M
                spread += [first_new] * (L - n) + list(range(offset, offset + n))
                spread += range(first_new, first_new + M)
                keep += range(g * (L + M) + max(0, L + M - self.kept[g]), (g + 1) * (L + M))
                offset += n
            self._index_cache = (key, *(torch.tensor(i, device=device) for i in (spread, keep)))
        return self._index_cache[1:]

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("SpanCache keeps no positions to roll back to (assisted decoding): "
                        "use a DynamicCache")


class SpanCache(DynamicCache):
    """``DynamicCache`` whose layers are :class:`SpanLayer` of the model's spans
    (:func:`head_windows`). Built for the spans of the moment: build a new one after the spans
    change."""

    def __init__(self, model: nn.Module) -> None:
        Cache.__init__(self, layers=[SpanLayer(w) for w in head_windows(model)])


def kv_bytes(cache: DynamicCache) -> int:
    """Bytes of keys and values a cache holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)
