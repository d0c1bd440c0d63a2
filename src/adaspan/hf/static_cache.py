"""A key/value cache of fixed size for the spans: ``generate`` and ``torch.compile`` decode
over buffers allocated once.

Each key/value head of :class:`SpanStaticLayer` holds its own window W (the longest of its
query heads' windows) and, where the spans have sinks, the sequence's first k positions:
keys and values (k + W, d), the sinks first, then the window as a ring: position q in slot
k + q mod W. Heads of one window form a group (B, h, k + W, d); a layer's groups lie side by
side in one buffer. A decode step (one token at position p) writes its key and value into
each head's slot (and into its sink slot while p < k), nothing else moves, and hands the
attention each group's buffers with each slot's offset behind p (``span.parts``: a
:class:`~adaspan.hf.attention.Part` per group; an empty slot's offset is the layer's longest
window, weight 0). Every count is a tensor, so that a compiled step reads nothing from the
device and does not recompile from token to token. A prefill (several tokens) hands each
group the positions it holds in order and the new ones, of any length, as ``SpanCache``
does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from ..attention.core import HeadGroup, HeadLayout, head_index
from ..errors import UserError
from .attention import Part, attached_spans
from .budget import head_dim
from .span_cache import head_windows, kv_head_windows
from .spans import key_value_heads
from .support import RELATIVE_MASKS, layer_states, query_length


@dataclass(frozen=True)
class Ring:
    """The key/value heads of one window: their query heads (``group``), their index among the
    key/value heads (``kv``), their first row in the layer's buffer (``start``), their count,
    and the window's slots 0 .. W - 1 (on the buffer's device)."""

    group: HeadGroup
    kv: slice | Tensor
    start: int
    heads: int
    slots: Tensor

    @property
    def window(self) -> int:
        return self.group.window

    def views(self, buffer: Tensor, sinks: int) -> Tensor:
        """This group's part (B, heads, sinks + W, d) of a layer's buffer (B, 1, rows, d)."""
        rows = self.heads * (sinks + self.window)
        part = buffer[:, 0, self.start:self.start + rows]
        return part.view(buffer.shape[0], self.heads, sinks + self.window, buffer.shape[-1])


class SpanStaticLayer(StaticLayer):
    """One layer's keys and values: per key/value head its sinks and its own window W (the
    longest of its query heads' ``query_windows``), in buffers (B, 1, rows, d), rows the sum
    of every head's sinks + W, allocated at the first update (or by ``early_initialization``),
    then updated in place."""

    is_croppable = False  # the window has dropped the positions a rollback would need

    def __init__(self, query_windows: list[int], kv_heads: int, span: nn.Module) -> None:
        self.group_size = len(query_windows) // kv_heads
        self.kv_windows = kv_head_windows(query_windows, kv_heads)
        self.window, self.span, self.sinks = max(query_windows), span, getattr(span, "sinks", 0)
        super().__init__(max_cache_len=sum(self.sinks + w for w in self.kv_windows))
        self.cumulative_length = torch.tensor(0)  # positions seen (StaticLayer's before 5.4: none)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor | None = None
                            ) -> None:
        flat = [t.new_zeros(t.shape[0], 1, 0, t.shape[-1])
                for t in (key_states, key_states if value_states is None else value_states)]
        super().lazy_initialization(*layer_states(*flat))
        self._arrange()
        self.cumulative_length = self.cumulative_length.to(self.device)
        if not is_torchdynamo_compiling():
            torch._dynamo.mark_static_address(self.cumulative_length)

    def _arrange(self) -> None:
        """The groups of key/value heads of one window (``rings``, in the order of their first
        head; ``layout``), and each key/value head's first row and window (``first_rows``,
        ``head_windows``: (Hkv,))."""
        G, first = self.group_size, {}
        self.layout = HeadLayout.of([w for w in self.kv_windows for _ in range(G)],
                                    self.device, G)
        rings, start = [], 0
        for group in self.layout.groups:
            kv = [h // G for h in group.members[::G]]
            first.update({h: start + i * (self.sinks + group.window) for i, h in enumerate(kv)})
            rings.append(Ring(group, head_index(kv, self.device), start, len(kv),
                              torch.arange(group.window, device=self.device)))
            start += len(kv) * (self.sinks + group.window)
        self.first_rows = torch.tensor([first[h] for h in range(len(first))], device=self.device)
        self.head_windows = torch.tensor(self.kv_windows, device=self.device)
        self.rings = rings

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs
               ) -> tuple[Tensor, Tensor]:
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[-2] == 1:
            parts = self._step(key_states, value_states)
        else:
            parts = [self._prefill(ring, key_states[:, ring.kv], value_states[:, ring.kv])
                     for ring in self.rings]
        self.cumulative_length.add_(key_states.shape[-2])
        self.span.parts = (tuple(parts), self.layout.order)
        return self.keys, self.values

    def _step(self, key_states: Tensor, value_states: Tensor) -> list[Part]:
        """One token at position p (a tensor): each head's key and value into its slot
        k + p mod W, every head by one ``index_copy_`` of the layer's buffer (in place, also
        compiled); each ring's buffers handed with each slot's offset."""
        p, k = self.cumulative_length.clone(), self.sinks
        slots = k + p % self.head_windows
        rows = [self.first_rows + slots]
        if k:  # while p < k, its sink slot too (past the sinks, its own slot again)
            rows.append(self.first_rows + torch.where(p < k, p, slots))
        for buffer, new in ((self.keys, key_states), (self.values, value_states)):
            for index in rows:
                buffer.index_copy_(2, index, new.transpose(1, 2))
        parts = []
        for ring in self.rings:
            offsets = (p - ring.slots) % ring.window
            parts.append(Part(ring.group, ring.views(self.keys, k), ring.views(self.values, k),
                              offsets.masked_fill(offsets > p, self.window),
                              (k, p) if k else None))
        return parts

    def _prefill(self, ring: Ring, key_states: Tensor, value_states: Tensor) -> Part:
        """M tokens after ``seen`` (read from the device): the sinks, the last W - 1 positions
        the ring's heads hold (in order) and the M new ones handed; the last W of them kept in
        their slots, the new sinks in theirs."""
        seen, M, k, W = int(self.cumulative_length), key_states.shape[-2], self.sinks, ring.window
        held, sinks, new_kept = min(seen, W - 1), min(k, seen + M), min(W, M)
        order = k + torch.arange(seen - held, seen, device=self.device) % W
        slots = k + torch.arange(seen + M - new_kept, seen + M, device=self.device) % W
        handed = []
        for buffer, new in ((self.keys, key_states), (self.values, value_states)):
            buffer = ring.views(buffer, k)
            window = torch.cat([buffer.index_select(2, order), new], dim=2)
            buffer.index_copy_(2, slots, new[:, :, M - new_kept:])
            buffer[:, :, seen:sinks] = new[:, :, :max(0, sinks - seen)]
            handed.append(torch.cat([buffer[:, :, :k], window], dim=2))
        return Part(ring.group, *handed, None, (k, seen) if k else None)

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
        kv_heads = key_value_heads(model.config)
        layers = [SpanStaticLayer(w, kv_heads, span)
                  for w, span in zip(head_windows(model), attached_spans(model), strict=True)]
        super().__init__(layers=layers)
        if batch_size is not None:
            weight = next(model.parameters())
            self.early_initialization(batch_size, kv_heads,
                                      head_dim(model.config), dtype or weight.dtype,
                                      device or weight.device)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """0: the mask sizes are relative to the first query (:meth:`SpanStaticLayer.
        get_mask_sizes`), so that they do not change from token to token."""
        return 0
