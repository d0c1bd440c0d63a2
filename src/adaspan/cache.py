"""What a layer carries from one block to the next.

Training carries hidden states (the paper's cache; their keys are recomputed with the current
weights every step): one tensor (B, C, D) per layer, gathered for all the training streams in a
:class:`StreamCache`. Inference carries projected keys and values in a :class:`KeyValueCache`,
written in place into a buffer with room for the next blocks, so that a step neither projects
nor copies the whole history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class KeyValueCache:
    """Keys and values of the cached positions, per head (inference only, weights fixed).

    They live in buffers (B, H, capacity, d_head) shared by the successive caches of a stream;
    this cache owns positions ``start`` to ``end``. :meth:`extend` writes the next block after
    ``end`` in place unless another cache already wrote there (``written``, shared by the caches
    of one buffer, records how far), in which case it copies into a new buffer: a cache stays
    valid and can be extended more than once (e.g. to sample several continuations).
    """

    key_buffer: Tensor
    value_buffer: Tensor
    start: int = 0
    end: int = 0
    written: list[int] = field(default_factory=lambda: [0])

    @classmethod
    def empty(cls, like: Tensor) -> KeyValueCache:
        """No history; ``like`` (B, H, 0, d_head) gives shape, dtype and device."""
        return cls(like, like)

    @property
    def keys(self) -> Tensor:
        return self.key_buffer[:, :, self.start : self.end]

    @property
    def values(self) -> Tensor:
        return self.value_buffer[:, :, self.start : self.end]

    def extend(
        self, keys: Tensor, values: Tensor, history: int
    ) -> tuple[Tensor, Tensor, KeyValueCache]:
        """Keys and values of the last ``history`` cached positions (zeros where there is no
        history) followed by the block's ``keys``/``values`` (B, H, M, d_head), and the cache of
        the last ``history`` positions of that."""
        M = keys.shape[2]
        if self._can_append(keys, history):
            key_buffer, value_buffer, end, written = (self.key_buffer, self.value_buffer,
                                                      self.end, self.written)
        else:
            key_buffer, value_buffer = (_copy_into_new_buffer(old, new, history)
                                        for old, new in ((self.keys, keys),
                                                         (self.values, values)))
            end, written = history, [history]
        key_buffer[:, :, end : end + M] = keys
        value_buffer[:, :, end : end + M] = values
        written[0] = end + M
        window = slice(end - history, end + M)
        following = KeyValueCache(key_buffer, value_buffer, end + M - history, end + M, written)
        return key_buffer[:, :, window], value_buffer[:, :, window], following

    def _can_append(self, keys: Tensor, history: int) -> bool:
        return (self.end == self.written[0] and self.end - self.start >= history
                and self.end + keys.shape[2] <= self.key_buffer.shape[2]
                and self.key_buffer.dtype == keys.dtype
                and self.key_buffer.device == keys.device)


Cache = list[Tensor | KeyValueCache]  # what SpanLM.forward takes and returns: one per layer


def _copy_into_new_buffer(old: Tensor, new: Tensor, history: int) -> Tensor:
    """A buffer with the last ``history`` positions of ``old`` ending at ``history`` (zeros
    before them where ``old`` is shorter) and room for ``new`` and at least ``history``,
    ``HEADROOM`` and one block more: copying the history is then amortised over at least
    ``history / M`` blocks. The room after ``history`` is left unset: it is written before
    it is read."""
    B, H, M, d_head = new.shape
    buffer = new.new_empty(B, H, history + M + max(M, HEADROOM, history), d_head)
    kept = old[:, :, max(0, old.shape[2] - history) :]
    buffer[:, :, : history - kept.shape[2]] = 0
    buffer[:, :, history - kept.shape[2] : history] = kept
    return buffer
