"""A key/value cache of fixed size for the spans: ``generate`` and ``torch.compile`` decode
over buffers allocated once.

Each layer of :class:`SpanStaticCache` holds, for every key/value head, the layer's longest
window W (a head of a shorter window sees keys beyond it, which its mask m_z weighs 0) and,
where the spans have sinks, the sequence's first k positions: keys and values (B, Hkv, k + W, d),
the sinks first, then the window as a ring: position q in slot k + q mod W. A decode step (one
token at position p) writes its key and value into its slot (and into its sink slot while
p < k), nothing else moves, and hands the attention the buffers themselves with each slot's
offset behind p (``span.key_offsets``; W, weight 0, for a slot that holds no position yet).
Every count is a tensor, so that a compiled step reads nothing from the device and does not
recompile from token to token. A prefill (several tokens) hands the positions held in order
and its own, of any length, as ``SpanCache`` does.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from ..errors import UserError
from .attention import attached_spans
from .budget import head_dim
from .span_cache import head_windows
from .spans import key_value_heads
from .support import RELATIVE_MASKS, layer_states, query_length


class SpanStaticLayer(StaticLayer):
    """One layer's keys and values in buffers (B, Hkv, sinks + W, d), W the longest of
    ``query_windows``: allocated at the first update (or by ``early_initialization``), then
    updated in place."""

    is_croppable = False  # the window has dropped the positions a rollback would need

    def __init__(self, query_windows: list[int], span: nn.Module) -> None:
        self.window, self.span, self.sinks = max(query_windows), span, getattr(span, "sinks", 0)
        super().__init__(max_cache_len=self.sinks + self.window)
        self.cumulative_length = torch.tensor(0)  # positions seen (StaticLayer's before 5.4: none)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor | None = None
                            ) -> None:
        super().lazy_initialization(*layer_states(key_states, value_states))
        self._slots = torch.arange(self.window, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            torch._dynamo.mark_static_address(self.cumulative_length)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 1:
            return self._step(key_states, value_states)
        return self._prefill(key_states, value_states)

    def _step(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """One token at position p (a tensor): its key and value into slot k + p mod W, the
        buffers handed with each slot's offset."""
        p, k, W = self.cumulative_length.clone(), self.sinks, self.window
        slot = (k + p % W).view(1)
        pairs = ((self.keys, key_states), (self.values, value_states))
        for buffer, new in pairs:
            buffer.index_copy_(2, slot, new)
        if k:  # while p < k, its sink slot too (past the sinks, its own slot again)
            sink = torch.where(p < k, p.view(1), slot)
            for buffer, new in pairs:
                buffer.index_copy_(2, sink, new)
            self.span.handed = (k, p)
        self.cumulative_length.add_(1)
        offsets = (p - self._slots) % W
        self.span.key_offsets = offsets.masked_fill(offsets > p, W)
        return self.keys, self.values

    def _prefill(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """M tokens after ``seen`` (read from the device): the sinks, the last W - 1 positions
        held (in order) and the M new ones handed; the last W of them kept in their slots,
        the new sinks in theirs."""
        seen, M, k, W = int(self.cumulative_length), key_states.shape[-2], self.sinks, self.window
        held, sinks, new_kept = min(seen, W - 1), min(k, seen + M), min(W, M)
        order = k + torch.arange(seen - held, seen, device=self.device) % W
        slots = k + torch.arange(seen + M - new_kept, seen + M, device=self.device) % W
        handed = []
        for buffer, new in ((self.keys, key_states), (self.values, value_states)):
            window = torch.cat([buffer.index_select(2, order), new], dim=2)
            buffer.index_copy_(2, slots, new[:, :, M - new_kept:])
            buffer[:, :, seen:sinks] = new[:, :, :max(0, sinks - seen)]
            handed.append(torch.cat([buffer[:, :, :k], window], dim=2))
        self.cumulative_length.add_(M)
        if k:
            self.span.handed = (k, seen)
        return handed[0], handed[1]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reordering of the rows, in place (the buffers keep their storage)."""
        if self.keys is not None:
            for buffer in (self.keys, self.values):
                buffer.copy_(buffer.index_select(0, beam_idx.to(buffer.device)))

    def get_seq_length(self) -> Tensor | int:
        """The positions seen (before 5.4, transformers' StaticLayer counts filled slots)."""
        return 0 if self.keys is None else self.cumulative_length

    def reset(self) -> None:
        """Empty for the next sequence: buffers and count zeroed in place (before 5.4,
        transformers' reset replaces the count by 0)."""
        if self.keys is not None:
            self.keys.zero_()
            self.values.zero_()
        self.cumulative_length.zero_()

    def get_mask_sizes(self, queries: int | Tensor) -> tuple[int, int]:
        """At most the W - 1 positions before the first query and the queries', the queries'
        own keys last: relative to the first query (:meth:`SpanStaticCache.get_query_offset`),
        or before transformers 5.14, which asks no cache for it, to position 0 (a tensor)."""
        first = 0 if RELATIVE_MASKS else self.cumulative_length
        return self.window - 1 + query_length(queries), first + 1 - self.window

    def crop(self, tokens_to_remove: int) -> None:
        raise UserError("SpanStaticCache keeps no positions to roll back to (assisted "
                        "decoding): use a DynamicCache")


class SpanStaticCache(Cache):
    """A cache of :class:`SpanStaticLayer` of the model's spans (:func:`head_windows`, and the
    spans' sinks), compileable: ``generate`` and ``torch.compile`` decode over it without
    recompiling. ``batch_size`` allocates the buffers now (in ``dtype`` on ``device``, by
    default the model's), else they are allocated at the first update. Built for the spans of
    the moment: build a new one after the spans change; ``reset()`` empties it for the next
    sequence, its buffers kept."""

    def __init__(self, model: nn.Module, batch_size: int | None = None,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None
                 ) -> None:
        layers = [SpanStaticLayer(w, span) for w, span in zip(head_windows(model),
                                                              attached_spans(model), strict=True)]
        super().__init__(layers=layers)
        if batch_size is not None:
            weight = next(model.parameters())
            self.early_initialization(batch_size, key_value_heads(model.config),
                                      head_dim(model.config), dtype or weight.dtype,
                                      device or weight.device)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """0: the mask sizes are relative to the first query (:meth:`SpanStaticLayer.
        get_mask_sizes`), so that they do not change from token to token."""
        return 0
