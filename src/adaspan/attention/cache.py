"""What a layer carries from one block to the next.

Training carries hidden states (the paper's cache; their keys are recomputed with the current
weights every step): one tensor (B, C, D) per layer, gathered for all the training streams in a
:class:`StreamCache`. Inference carries projected keys and values in a :class:`KeyValueCache`,
written in place into a buffer with room for the next blocks, so that a step neither projects
nor copies the whole history.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

HEADROOM = 256  # least positions allocated beyond a block's needs, so that appends rarely copy


def fit_cache(cache: Tensor, length: int) -> Tensor:
    """The last ``length`` cached states of ``cache`` (B, C, D); missing history is left-padded
    with zeros (zero states, whose keys and values are zero too: the projections have no bias)."""
    have = cache.shape[1]
    if have >= length:
        return cache[:, have - length :]
    return F.pad(cache, (0, 0, length - have, 0))


def advance(past: Tensor, block: Tensor, length: int) -> Tensor:
    """The hidden-state cache for the next block: the last ``length`` states of ``past`` followed
    by ``block`` (detached: the next step recomputes their keys, no gradient flows back)."""
    keep = max(0, length - block.shape[1])  # states of the past still inside the new cache
    return torch.cat([past[:, max(0, past.shape[1] - keep) :], block.detach()], dim=1)[:, -length:]


@dataclass(frozen=True)
class StreamCache:
    """The training cache: per layer, the hidden states (B, C_l, D) that each of the B streams
    carries to its next block (C_l: what that layer's heads can still see)."""

    layers: list[Tensor]

    def rows(self, rows: slice) -> StreamCache:
        """The cache of streams ``rows`` (a slice of the batch)."""
        return StreamCache([layer[rows] for layer in self.layers])

    @classmethod
    def merge(cls, parts: Sequence[StreamCache]) -> StreamCache:
        """Caches of consecutive groups of streams joined into one (rows in order).

        Shorter caches are left-padded with zeros, which the model reads exactly as missing
        history."""
        if len(parts) == 1:
            return parts[0]
        merged = []
        for layers in zip(*(part.layers for part in parts), strict=True):
            length = max(layer.shape[1] for layer in layers)
            merged.append(torch.cat([fit_cache(layer, length) for layer in layers]))
        return cls(merged)

    def to(self, device: torch.device | str) -> StreamCache:
        """The same states on ``device``, detached (``cpu`` before saving or gathering)."""
        return StreamCache([layer.detach().to(device) for layer in self.layers])


class _Buffers:
    """Keys and values of one stream, shared by its successive caches: slot ``i`` of the buffers
    (B, H, capacity, d_head) holds position ``offset + i``; positions up to ``written`` were
    written, each once. ``caches`` are the live caches reading them."""

    def __init__(self, keys: Tensor, values: Tensor, offset: int, written: int) -> None:
        self.keys, self.values, self.offset, self.written = keys, values, offset, written
        self.caches: weakref.WeakSet[KeyValueCache] = weakref.WeakSet()

    @classmethod
    def starting_with(cls, keys: Tensor, values: Tensor, end: int, history: int,
                      block: Tensor) -> _Buffers:
        """New buffers (of ``block``'s dtype and device) holding the last ``history`` positions
        before ``end`` (``keys``/``values`` (B, H, <= history, d_head), left-padded with zeros)
        and room for the ``block`` (B, H, M, d_head) and at least ``history``, ``HEADROOM`` and
        one block more, so that the history is moved at most once every ``history / M``
        blocks. The room is left unset: it is written before it is read."""
        B, H, M, d_head = block.shape
        capacity = history + M + max(M, HEADROOM, history)
        buffers = []
        for kept in (keys, values):
            buffer = block.new_empty(B, H, capacity, d_head)
            kept = kept[:, :, max(0, kept.shape[2] - history) :]
            buffer[:, :, : history - kept.shape[2]] = 0
            buffer[:, :, history - kept.shape[2] : history] = kept
            buffers.append(buffer)
        return cls(*buffers, offset=end - history, written=end)

    def window(self, start: int, end: int) -> tuple[Tensor, Tensor]:
        """Keys and values of positions ``start`` to ``end`` (views)."""
        rows = slice(start - self.offset, end - self.offset)
        return self.keys[:, :, rows], self.values[:, :, rows]

    def make_room(self, history: int, block: int) -> bool:
        """Room for ``block`` positions after ``written`` by moving the last ``history`` of them
        to the front, in place, so that no memory is allocated (fresh memory is slow to touch).
        False when a live cache reads a position that would be dropped, or the moved positions
        would overlap their target: new buffers are needed."""
        if self.written + block - self.offset <= self.keys.shape[2]:
            return True
        offset = self.written - history
        if (offset - self.offset < history or history + block > self.keys.shape[2]
                or any(cache.start < offset for cache in self.caches)):
            return False
        for buffer in (self.keys, self.values):
            buffer[:, :, :history] = buffer[:, :, offset - self.offset : self.written - self.offset]
        self.offset = offset
        return True


@dataclass(frozen=True, eq=False)
class KeyValueCache:
    """Keys and values of the cached positions ``start`` to ``end``, per head (inference only,
    weights fixed).

    They live in buffers shared by the successive caches of a stream. :meth:`extend` writes
    the next block after ``end`` in place; when the buffers are full, the history is moved to
    their front, unless a live cache still reads what that drops. A cache stays valid and can
    be extended more than once (e.g. to sample several continuations): a cache that is not the
    last of its buffers continues in new ones.
    """

    buffers: _Buffers
    start: int = 0
    end: int = 0

    def __post_init__(self) -> None:
        self.buffers.caches.add(self)

    @classmethod
    def empty(cls, like: Tensor) -> KeyValueCache:
        """No history; ``like`` (B, H, 0, d_head) gives shape, dtype and device."""
        return cls(_Buffers(like, like, offset=0, written=0))

    @property
    def keys(self) -> Tensor:
        return self.buffers.window(self.start, self.end)[0]

    @property
    def values(self) -> Tensor:
        return self.buffers.window(self.start, self.end)[1]

    def extend(
        self, keys: Tensor, values: Tensor, history: int
    ) -> tuple[Tensor, Tensor, KeyValueCache]:
        """Keys and values of the last ``history`` cached positions (zeros where there is no
        history) followed by the block's ``keys``/``values`` (B, H, M, d_head), and the cache of
        the last ``history`` positions of that."""
        M, end = keys.shape[2], self.end
        buffers = self.buffers
        if not (self._is_last(keys, history) and buffers.make_room(history, M)):
            buffers = _Buffers.starting_with(*buffers.window(self.start, end), end, history, keys)
        rows = slice(end - buffers.offset, end + M - buffers.offset)
        buffers.keys[:, :, rows] = keys
        buffers.values[:, :, rows] = values
        buffers.written = end + M
        return (*buffers.window(end - history, end + M),
                KeyValueCache(buffers, end + M - history, end + M))

    def _is_last(self, keys: Tensor, history: int) -> bool:
        """Whether the block can follow in this cache's buffers: nothing was written after it,
        it holds the history and the buffers hold its dtype and device."""
        buffer = self.buffers.keys
        return (self.end == self.buffers.written and self.end - self.start >= history
                and buffer.dtype == keys.dtype and buffer.device == keys.device)


Cache = list[Tensor | KeyValueCache]  # what SpanLM.forward takes and returns: one per layer
