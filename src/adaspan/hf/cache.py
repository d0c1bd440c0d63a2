"""A key/value cache for Hugging Face ``generate`` that holds only what the heads can see.

A head with span parameter z gives weight m_z(x) = 0 to every key at distance x >= z + R
(eq. 2), so it needs only the keys and values of its last ``window`` positions, window =
min(S, ceil(z + R)): the current token and the window - 1 before it. A key/value head serves
a group of query heads: it keeps the window - 1 positions of the group's longest span. Each
layer of :class:`SpanCache` holds those, every head its own number of positions, and reports
every position it has seen as its length, so positions (rotary or learned) stay absolute.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from ..errors import UserError
from .attention import attached_spans


def head_windows(model: nn.Module) -> list[list[int]]:
    """Keys each query head needs, min(S, ceil(z + R)), per layer in layer order."""
    return [span.windows(None) for span in attached_spans(model)]


def windows(model: nn.Module) -> list[int]:
    """Keys each layer needs: its longest :func:`head_windows`."""
    return [max(heads) for heads in head_windows(model)]


class SpanLayer(DynamicSlidingWindowLayer):
    """The keys and values of one layer: key/value head g keeps its last ``kept[g]`` positions,
    all heads side by side in one tensor (B, sum of kept, d) so that transformers' batch
    operations (beam search's reordering, selecting rows) apply unchanged. ``update`` hands the
    attention (B, Hkv, L + M, d), L the longest kept, shorter heads padded at the front with
    zeros that no query reads (they lie beyond its window)."""

    def __init__(self, query_windows: list[int]) -> None:
        super().__init__(sliding_window=max(query_windows))
        self.query_windows = query_windows
        self.kept: list[int] = []  # positions kept per key/value head, set by the first update

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        kv_heads = key_states.shape[1]
        group = len(self.query_windows) // kv_heads
        self.kept = [max(self.query_windows[g * group:(g + 1) * group]) - 1
                     for g in range(kv_heads)]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        seen = self.cumulative_length
        self.cumulative_length += key_states.shape[-2]
        keys, self.keys = self._join(self.keys, key_states, seen)
        values, self.values = self._join(self.values, value_states, seen)
        return keys, values

    def _join(self, held: Tensor, new: Tensor, seen: int) -> tuple[Tensor, Tensor]:
        """(the held positions and ``new`` per head, padded: (B, Hkv, L + M, d); what each head
        keeps of them, side by side)."""
        B, H, M, d = new.shape
        lengths = [min(n, seen) for n in self.kept]
        L = max(lengths)
        joined = new.new_zeros(B, H, L + M, d)
        joined[:, :, L:] = new
        offset = 0
        for g, n in enumerate(lengths):
            if n:
                joined[:, g, L - n:L] = held[:, offset:offset + n]
                offset += n
        kept = [joined[:, g, max(0, L + M - n):] for g, n in enumerate(self.kept)]
        return joined, torch.cat(kept, dim=1)

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
