"""Span attention as a function of any queries, keys and values: the names this module had
before the span attention core (:mod:`adaspan.attention.core`), kept for code that imports
them from here."""

from __future__ import annotations

from torch import Tensor

from .core import span_attention, span_log_mask
from .rotary import rotate
from .span import key_window

__all__ = ["decode_attention", "key_window", "rotate", "span_attention", "span_log_mask"]


def decode_attention(q: Tensor, k: Tensor, v: Tensor, log_mask: Tensor,
                     pos: Tensor | None = None, scale: float | None = None) -> Tensor:
    """:func:`span_attention`'s decode backend (keys at offsets 0 .. W - 1, ``log_mask``
    (Hq, W) of :func:`span_log_mask`)."""
    max_span = log_mask.shape[1] if pos is None else pos.shape[0]
    return span_attention(q, k, v, None, max_span=max_span, ramp=1.0, pos=pos, scale=scale,
                          log_mask=log_mask, backend="decode")
