"""The key/value cache counted in bytes: what a model's spans hold, and a span penalty whose
coefficient reads as bits of loss per byte of cache.

A key/value head holds, per position, a key and a value of ``head_dim`` elements each. With
spans, it holds ``sinks`` + window - 1 positions, window = min(S, ceil(z + R)) of the longest
span among the query heads it serves (``SpanCache``); the cache of the full model holds every
position.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .attention import attached_spans
from .span_cache import head_windows
from .spans import key_value_heads


def head_dim(config) -> int:
    """Elements of one head's key (and value): ``head_dim``, else width / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def position_bytes(config, element_size: int) -> int:
    """Bytes one key/value head holds per position: a key and a value."""
    return 2 * head_dim(config) * element_size


def full_cache_bytes(config, context: int, element_size: int) -> int:
    """Bytes of every key and value of ``context`` positions in every layer."""
    return (config.num_hidden_layers * key_value_heads(config) * context
            * position_bytes(config, element_size))


def span_cache_bytes(model: nn.Module, context: int, element_size: int) -> int:
    """Bytes a ``SpanCache`` of the model's spans holds after ``context`` positions: per
    key/value head, its sinks and the window - 1 positions before the newest, each at most
    ``context`` (a sink within the window is held twice)."""
    config, kv = model.config, key_value_heads(model.config)
    sinks = [getattr(span, "sinks", 0) for span in attached_spans(model)]
    positions = 0
    for windows, n in zip(head_windows(model), sinks, strict=True):
        group = len(windows) // kv
        kept = [max(windows[g * group:(g + 1) * group]) - 1 for g in range(kv)]
        positions += sum(min(context, n) + min(context, w) for w in kept)
    return positions * position_bytes(config, element_size)


def cache_loss(model: nn.Module, bits_per_byte: float, element_size: int = 2) -> Tensor:
    """A span penalty in nats whose coefficient is bits of loss per byte of cache:
    ln 2 * ``bits_per_byte`` * the bytes the spans make each key/value head hold, z of the
    longest span among the query heads it serves, in every layer (keys and values of
    ``element_size`` bytes: 2 for bf16). Added to a loss in nats, minimising the sum trades
    ``bits_per_byte`` bits of loss per token for each byte of cache."""
    config = model.config
    kv, per_position = key_value_heads(config), position_bytes(config, element_size)
    positions = []
    for span in attached_spans(model):
        z = span.z()
        positions.append(z.view(kv, -1).amax(dim=1).sum() if z.numel() > kv else z.sum())
    return math.log(2) * bits_per_byte * per_position * torch.stack(positions).sum()
