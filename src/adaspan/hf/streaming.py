"""Hard windows on a Hugging Face model, as the baselines of learned spans hold them:
StreamingLLM (Xiao et al. 2024: the first ``sinks`` positions and the last ``window`` in every
head) and the deployed pattern of DuoAttention (Xiao et al. 2025: per key/value head, every
position, or sinks and a recent window).

A hard window of w positions is a span of ramp R = 1 and z = w - 1: m_z(x) = 1 for the
offsets x <= w - 1 and 0 from x = w on (eq. 2), so the span attention, ``SpanCache`` and the
byte accounting of :mod:`adaspan.hf.budget` serve these baselines unchanged. Within
:func:`hard_windows` the model reads its windows; after it, the model is as before (its own
spans, or none). The cache policy ``streaming`` of ``adaspan longeval`` is StreamingLLM's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ..attention.span import AdaptiveSpan, exact_fraction
from ..errors import UserError
from .attention import NAME, span_modules
from .budget import position_bytes
from .cache_policies import CachePolicy, register_policy, whole_option
from .span_cache import SpanCache
from .spans import add_spans, key_value_heads


def _window_span(windows: Sequence[int], max_span: int, sinks: int) -> AdaptiveSpan:
    """A span of ramp 1 per key/value head whose windows are ``windows`` (capped at S)."""
    span = AdaptiveSpan(len(windows), max_span, 1)
    with torch.no_grad():
        span.z_frac.copy_(torch.tensor([exact_fraction(min(w, max_span) - 1, max_span)
                                        for w in windows]))
    span.sinks = sinks
    return span


@contextmanager
def hard_windows(model: nn.Module, windows: Sequence[Sequence[int]], sinks: int = 0
                 ) -> Iterator[nn.Module]:
    """Within the block, key/value head g of layer l reads its last ``windows[l][g]``
    positions (every one weighed 1; S or more: every position up to S) and the sequence's
    first ``sinks``; SpanCache holds exactly those. The model's own spans, settings and
    attention come back after the block."""
    kv = key_value_heads(model.config)
    had_spans = bool(span_modules(model))
    previous = (model.config._attn_implementation, getattr(model.config, "adaptive_span", None))
    modules = _attention_modules(model) if had_spans else None
    old = [getattr(m, NAME) for m in modules] if had_spans else []
    if not had_spans:
        add_spans(model, ramp=1, per_kv_head=True, sinks=sinks)
        modules = _attention_modules(model)
    if len(windows) != len(modules) or any(len(w) != kv for w in windows):
        _restore(model, modules, old, previous)
        raise UserError(f"windows must give {len(modules)} layers of {kv} key/value heads")
    max_span = getattr(modules[0], NAME).max_span
    device = next(model.parameters()).device
    for module, row in zip(modules, windows, strict=True):
        setattr(module, NAME, _window_span(row, max_span, sinks).to(device))
    model.config.adaptive_span = {"max_span": max_span, "ramp": 1, "per_layer": False,
                                  "per_kv_head": True, "sinks": sinks}
    try:
        yield model
    finally:
        _restore(model, modules, old, previous)


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that carry a span, in layer order."""
    return [m for m in model.modules() if isinstance(getattr(m, NAME, None), AdaptiveSpan)]


def _restore(model: nn.Module, modules: list[nn.Module], old: list[nn.Module],
             previous: tuple) -> None:
    """Give the modules their spans back (``old``), or none; the config its settings."""
    for i, module in enumerate(modules):
        if old:
            setattr(module, NAME, old[i])
        else:
            delattr(module, NAME)
    implementation, settings = previous
    if settings is None:
        del model.config.adaptive_span
    else:
        model.config.adaptive_span = settings
    model.set_attn_implementation(implementation)


def streaming_windows(model: nn.Module, window: int) -> list[list[int]]:
    """StreamingLLM's windows: ``window`` in every key/value head of every layer."""
    layers = model.config.num_hidden_layers
    return [[window] * key_value_heads(model.config) for _ in range(layers)]


def budget_window(model: nn.Module, budget: int, sinks: int, element_size: int) -> int:
    """The longest window whose StreamingLLM cache (per key/value head of every layer: the
    sinks and window - 1 positions) holds at most ``budget`` bytes."""
    per_position = position_bytes(model.config, element_size)
    heads = model.config.num_hidden_layers * key_value_heads(model.config)
    window = budget // (heads * per_position) - sinks + 1
    if window < 1:
        raise UserError(f"a budget of {budget} bytes holds fewer than {sinks} sinks and one "
                        f"position per key/value head ({heads * per_position} bytes each)")
    return window


class StreamingPolicy(CachePolicy):
    """StreamingLLM: every key/value head holds the first ``sinks`` positions and the last
    ``window`` (its own included), in a ``SpanCache`` of hard windows; ``budget``, bytes of
    keys and values held after the prompt (in the model's dtype), gives the window instead."""

    def __init__(self, model: nn.Module, window: str | None = None, sinks: str = "4",
                 budget: str | None = None) -> None:
        super().__init__(model)
        if (window is None) == (budget is None):
            raise UserError("cache policy 'streaming' takes a window or a budget (bytes): "
                            "streaming:window=256 or streaming:budget=1000000")
        self.sinks = whole_option("streaming", "sinks", sinks, 0)
        if budget is not None:
            size = next(model.parameters()).element_size()
            budget = whole_option("streaming", "budget", budget, 1)
            window = budget_window(model, budget, self.sinks, size)
        self.window = whole_option("streaming", "window", window, 1)

    @contextmanager
    def applied(self, prompt_tokens: int) -> Iterator[SpanCache]:
        with hard_windows(self.model, streaming_windows(self.model, self.window), self.sinks):
            yield SpanCache(self.model)


register_policy("streaming", StreamingPolicy)
