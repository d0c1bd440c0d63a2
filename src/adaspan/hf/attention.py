"""The ``adaptive_span`` attention of Hugging Face ``transformers``: eqs. 1-3 with the soft
mask m_z(x) in every attention layer that goes through ``AttentionInterface``.

Each attention module carries its span as the attribute ``adaptive_span`` (an
:class:`~adaspan.attention.span.AdaptiveSpan`); the function registered under
``"adaptive_span"`` reads it and calls the span attention core,
:func:`~adaspan.attention.core.span_attention`, on the queries, keys and values the layer hands
over (rotary applied, cache updated: the last queries' keys are the queries' own positions,
offset 0), with the log-mask its decode backend reads when generating. A batch is one sequence
per row: a padded batch (an attention mask with a zero) is refused, as is a prepared 4D mask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface
from transformers.utils import is_torchdynamo_compiling

from ..attention.core import HeadGroup, span_attention, span_log_mask
from ..attention.sinks import Sinks
from ..attention.span import AdaptiveSpan, key_window
from ..errors import UserError
from .support import mask_function

NAME = "adaptive_span"  # the attention implementation, and the attribute holding the span

_probe: list[tuple[nn.Module, int | None]] | None = None  # modules met by a probing forward


def span_of(module: nn.Module) -> AdaptiveSpan | None:
    """The span attached to an attention module, or None."""
    return getattr(module, NAME, None)


def span_modules(model: nn.Module) -> list[AdaptiveSpan]:
    """The spans of a model's attention modules, in layer order."""
    return [span for module in model.modules() if (span := span_of(module)) is not None]


def attached_spans(model: nn.Module) -> list[AdaptiveSpan]:
    """:func:`span_modules`, refusing a model that has none."""
    spans = span_modules(model)
    if not spans:
        raise UserError("the model has no spans: attach them with adaspan.hf.add_spans(model)")
    return spans


@dataclass(frozen=True)
class Part:
    """Keys and values a cache hands the attention for some of the query heads: ``group``'s
    (None: every head), (B, h, T, d) each; a ``SpanStaticCache`` step's ring offsets (T,)
    (``key_offsets``), else None (the keys in order, the queries' own last); how many sinks
    lead and the first query's position (``handed``), else None."""

    group: HeadGroup | None
    key: Tensor
    value: Tensor
    key_offsets: Tensor | None = None
    handed: tuple[int, int | Tensor] | None = None


def attention_function(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, scaling: float | None = None,
                       dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """``AttentionInterface`` function: query (B, Hq, M, d), key and value (B, Hkv, T, d);
    returns the output (B, M, Hq, d) and no weights. A cache that holds each group of heads
    apart hands those (``span.parts``: :class:`Part` s and the order putting their query heads
    back, or None) in place of ``key`` and ``value``."""
    if _probe is not None:  # add_spans is finding the attention modules: plain causal attention
        _probe.append((module, kwargs.get("sliding_window")))
        out = span_attention(query, key, value, None, max_span=key.shape[2], ramp=1.0,
                             scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    span = span_of(module)
    if span is None:
        raise UserError(f"{type(module).__name__} has no span: attach them with "
                        "adaspan.hf.add_spans(model) (or load with adaspan.hf.load_pretrained)")
    parts, order = span.__dict__.pop("parts", None) or ((Part(None, key, value),), None)
    log_mask = None if torch.is_grad_enabled() else decode_mask(span, query)
    outs = [_attend(module, span, query, part, log_mask, attention_mask, scaling, dropout,
                    kwargs) for part in parts]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
    if order is not None:
        out = out.index_select(1, order)
    return out.transpose(1, 2).contiguous(), None


def _attend(module: nn.Module, span: AdaptiveSpan, query: Tensor, part: Part,
            log_mask: Tensor | None, attention_mask: Tensor | None, scaling: float | None,
            dropout: float, kwargs: dict) -> Tensor:
    """Span attention of ``part``'s query heads over its keys: (B, h, M, d)."""
    if part.key_offsets is not None and log_mask is None:
        raise UserError("adaspan.hf.SpanStaticCache decodes without gradients: train with "
                        "adaspan.hf.SpanCache or no cache")
    heads, group = query.shape[1], part.group
    key_mask = _key_mask(attention_mask, part.key.shape[2], part.key_offsets)
    key, value, sinks = _sinks(span, part, query.shape[2], key_mask, kwargs)
    every_head = query
    if group is not None:
        query = query[:, group.heads]
        log_mask = None if log_mask is None else log_mask[group.heads]

    def z() -> Tensor:
        every = per_query_head(span(every_head), heads)
        return every if group is None else every[:, group.heads]

    def z_host() -> list[float]:
        every = per_query_head(span.host_z(), heads)
        return every if group is None else [every[h] for h in group.members]

    return span_attention(query, key, value, z, max_span=span.max_span, ramp=span.ramp,
                          scale=scaling, dropout=dropout, training=module.training,
                          z_host=z_host, log_mask=log_mask, key_mask=key_mask, sinks=sinks,
                          key_offsets=part.key_offsets)


def _sinks(span: AdaptiveSpan, part: Part, queries: int, key_mask: Tensor | None,
           kwargs: dict) -> tuple[Tensor, Tensor, Sinks | None]:
    """The keys and values of the span's sinks apart from the others: the first positions a
    cache handed (``part.handed``: how many, and the position of the first query), or the
    first of every position (a cache that keeps them all, or none)."""
    n, key, value = getattr(span, "sinks", 0), part.key, part.value
    if not n:
        return key, value, None
    if key_mask is not None:
        raise UserError("attention sinks take batches without padding")
    if part.handed is not None:
        held, first = part.handed
        sinks = Sinks(key[:, :, :held], value[:, :, :held], first, joined=(key, value))
        return key[:, :, held:], value[:, :, held:], sinks
    first = key.shape[2] - queries
    positions = kwargs.get("position_ids")
    if positions is not None and int(positions[..., -1].max()) != key.shape[2] - 1:
        raise UserError("attention sinks need every position's key, or adaspan.hf.SpanCache: "
                        "this cache dropped some")
    return key, value, Sinks(key[:, :, :n], value[:, :, :n], first)


def _key_mask(attention_mask: Tensor | None, keys: int, offsets: Tensor | None = None
              ) -> Tensor | None:
    """Which of the last ``keys`` positions are tokens, from the padding mask (B, positions
    seen) that :func:`adaptive_span_mask` hands on (slots before the first position, a static
    cache's, are not), in the order of a ring's ``offsets`` where given; None without
    padding. A prepared 4D mask, and padding with gradients (training takes unpadded
    windows), are refused."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise UserError("adaptive_span attention takes no prepared attention mask (a 4D mask "
                        "was given): pass the 2D padding mask, or none")
    if torch.is_grad_enabled():
        raise UserError("adaptive_span attention masks padding without gradients only "
                        "(generation, evaluation): train on unpadded windows")
    empty = max(0, keys - attention_mask.shape[1])  # a static cache's slots before the first
    mask = torch.nn.functional.pad(attention_mask, (empty, 0))[:, -keys:]
    return mask if offsets is None else mask[:, -1 - offsets.clamp(max=keys - 1)]


def per_query_head(z: Tensor | list[float], heads: int) -> Tensor | list[float]:
    """A span's z for ``heads`` query heads: as it is where it has one per query head, else one
    per key/value head (``add_spans(per_kv_head=True)``), each repeated for the query heads that
    read that key/value head. ``z``: (B|1, h, M|1) on the device, or h floats on the host."""
    if isinstance(z, Tensor):
        return z if z.shape[1] == heads else z.repeat_interleave(heads // z.shape[1], dim=1)
    return z if len(z) == heads else [x for x in z for _ in range(heads // len(z))]


def decode_mask(span: AdaptiveSpan, query: Tensor) -> Tensor:
    """The log-mask of :func:`span_log_mask` over the span's longest window, on the device of
    ``query``: built once per value of z' (its version) and device, then reused (no read of
    z); a compiled step takes the one of the last eager forward (its prefill), unchecked."""
    cached = getattr(span, "_decode_mask", None)
    if cached is not None and is_torchdynamo_compiling():
        return cached[1]
    version = (span.version(), query.device, query.shape[1])
    if cached is None or cached[0] != version:
        z = per_query_head(span.host_z(), query.shape[1])
        mask = span_log_mask(z, key_window(max(z), span.max_span, span.ramp), span.ramp)
        span._decode_mask = cached = (version, mask.to(query.device))
    return cached[1]


def adaptive_span_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                       kv_offset: int = 0, attention_mask: Tensor | None = None,
                       **kwargs) -> None:
    """``AttentionMaskInterface`` function: span attention is causal by the keys' distances,
    the queries' own keys last, so no mask is made; a padding mask (a 2D mask with a zero,
    over every position seen) is handed on as it is, each layer taking its last keys' part.
    A cache whose keys do not end at the queries (transformers' static caches) is refused
    by the eager forward that fills it (a compiled step reads no offset: tensors before
    transformers 5.14)."""
    if not is_torchdynamo_compiling() and int(q_offset) + q_length != int(kv_offset) + kv_length:
        raise UserError("adaptive_span attention needs the queries' keys last: use a "
                        "DynamicCache, adaspan.hf.SpanCache or adaspan.hf.SpanStaticCache, not "
                        "transformers' static cache")
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


def register() -> None:
    """Register ``"adaptive_span"`` with transformers' attention and mask interfaces."""
    AttentionInterface.register(NAME, attention_function)
    AttentionMaskInterface.register(NAME, mask_function(adaptive_span_mask))


@contextmanager
def probing() -> Iterator[list[tuple[nn.Module, int | None]]]:
    """Within the block, the attention function records each module it is called for (with
    its sliding window, if any) and computes plain causal attention."""
    global _probe
    _probe = found = []
    try:
        with torch.no_grad():
            yield found
    finally:
        _probe = None
