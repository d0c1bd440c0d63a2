"""A key/value cache for Hugging Face ``generate`` that holds only what the heads can see.

A head with span parameter z gives weight m_z(x) = 0 to every key at distance x >= z + R
(eq. 2), so a layer needs only the keys and values of its last ``window`` positions, window =
min(S, ceil(z + R)) of its longest-span head: the current token and the window - 1 before it.
Each layer of :class:`SpanCache` keeps those (transformers' sliding-window layer) and reports
every position it has seen as its length, so positions (rotary or learned) stay absolute.
"""

from __future__ import annotations

from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicSlidingWindowLayer

from .attention import attached_spans


def windows(model: nn.Module) -> list[int]:
    """Keys each layer needs: min(S, ceil(max z + R)) over its heads, in layer order."""
    return [max(span.windows(None)) for span in attached_spans(model)]


class SpanCache(DynamicCache):
    """``DynamicCache`` whose layer i keeps the keys and values of its last ``windows[i] - 1``
    positions between forward passes (:func:`windows` of ``model``). Built for the spans of
    the moment: build a new one after the spans change."""

    def __init__(self, model: nn.Module) -> None:
        layers = [DynamicSlidingWindowLayer(sliding_window=w) for w in windows(model)]
        Cache.__init__(self, layers=layers)


def kv_bytes(cache: DynamicCache) -> int:
    """Bytes of keys and values a cache holds."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values) if t is not None)
