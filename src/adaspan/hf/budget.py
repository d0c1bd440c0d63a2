"""The key/value cache counted in bytes: what a model's spans hold, a span penalty whose
coefficient reads as bits of loss per byte of cache, and spans held to a budget of bytes.

A key/value head holds, per position, a key and a value of ``head_dim`` elements each. With
spans, it holds ``sinks`` + window - 1 positions, window = min(S, ceil(z + R)) of the longest
span among the query heads it serves (``SpanCache``); the cache of the full model holds every
position.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..errors import UserError
from .attention import attached_spans
from .span_cache import head_windows
from .spans import key_value_heads

BISECTIONS = 32  # of the shared amount limit_cache lowers z' by: S / 2**32 tokens at the end


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


Masks = list[Tensor] | None  # per span module, 1 where a head's z' is lowered (None: all)


def _lower(model: nn.Module, amount: float, masks: Masks = None) -> None:
    """The model's z' lowered by ``amount`` (where ``masks`` say), then clamped to [0, 1]."""
    spans = attached_spans(model)
    for span, mask in zip(spans, masks or [None] * len(spans), strict=True):
        span.z_frac.sub_(amount if mask is None else amount * mask).clamp_(0.0, 1.0)


def z_snapshot(model: nn.Module) -> list[Tensor]:
    """A copy of every span's z' (for :func:`restore_z`)."""
    return [span.z_frac.detach().clone() for span in attached_spans(model)]


@torch.no_grad()
def restore_z(model: nn.Module, saved: list[Tensor]) -> None:
    """Every span's z' set back to ``saved`` (:func:`z_snapshot`)."""
    for span, z_frac in zip(attached_spans(model), saved, strict=True):
        span.z_frac.copy_(z_frac)


@torch.no_grad()
def lowered_cache_bytes(model: nn.Module, amount: float, context: int,
                        element_size: int = 2, masks: Masks = None) -> int:
    """:func:`span_cache_bytes` of the spans with z' lowered by ``amount`` (clamped at 0;
    where ``masks`` say); the spans themselves are left as they are."""
    saved = z_snapshot(model)
    _lower(model, amount, masks)
    try:
        return span_cache_bytes(model, context, element_size)
    finally:
        restore_z(model, saved)


def check_budget(model: nn.Module, budget: float, context: int, element_size: int = 2) -> None:
    """Refuse a budget of bytes below the least the spans can hold after ``context``
    positions: every z = 0, each key/value head its sinks and R - 1 positions."""
    least = lowered_cache_bytes(model, 1.0, context, element_size)
    if least > budget:
        full = full_cache_bytes(model.config, context, element_size)
        raise UserError(f"the spans hold at least {least} bytes after {context} positions "
                        f"(every z = 0: sinks and ramp), {full / least:.3g}x less than full "
                        f"attention; a budget of {budget:.0f} bytes ({full / budget:.3g}x) "
                        "cannot be met: ask for less, or a shorter ramp")


@torch.no_grad()
def limit_cache(model: nn.Module, budget: float, context: int, element_size: int = 2,
                spare_full: bool = False) -> float:
    """Hold the spans to ``budget`` bytes after ``context`` positions (:func:`span_cache_bytes`):
    lower every z' by the least shared amount that does it (found by bisection; z' clamped at
    0), the projection of z onto the budget of a sum of spans. With ``spare_full``, the heads
    at S or above (z' >= 1) are left whole where the others can meet the budget alone. Returns
    the amount (0: the spans were within the budget). A budget no spans can meet is
    :func:`check_budget`'s error."""
    if span_cache_bytes(model, context, element_size) <= budget:
        return 0.0
    check_budget(model, budget, context, element_size)
    masks = None
    if spare_full:
        below = [(span.z_frac < 1).to(span.z_frac.dtype) for span in attached_spans(model)]
        if lowered_cache_bytes(model, 1.0, context, element_size, below) <= budget:
            masks = below
    low, high = 0.0, 1.0  # held(low) > budget >= held(high)
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        if lowered_cache_bytes(model, middle, context, element_size, masks) <= budget:
            high = middle
        else:
            low = middle
    _lower(model, high, masks)
    return high
