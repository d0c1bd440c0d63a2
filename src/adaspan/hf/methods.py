"""What ``adaspan retrofit`` trains, by name (``RetrofitConfig.method``): the pieces the
training loop calls, registered where each method is defined. ``spans`` (here): an adaptive
span per head (or per key/value head), the penalty lambda / M sum z or, per byte, ln 2 lambda
times the bytes of cache the spans hold (:func:`adaspan.hf.budget.cache_loss`); ``duo``:
DuoAttention's gates (:mod:`adaspan.hf.duo`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor, nn

from ..attention.span import clamp_spans, span_loss
from ..config import RetrofitConfig, register_choices
from .attention import span_modules
from .budget import cache_loss
from .spans import add_spans, save_model

BYTES_PER_ELEMENT = 2  # the penalty per byte counts keys and values held in bf16


@dataclass(frozen=True)
class Method:
    """How a retrofit attaches what it trains (at its start: the model unchanged), lists the
    trained tensors (in layer order), penalises them, projects them after a step and writes
    them (``report``: whether ``adaspan retrofit``'s report measures the result)."""

    attach: Callable[[nn.Module, RetrofitConfig], None]
    parameters: Callable[[nn.Module], list[nn.Parameter]]
    penalty: Callable[[nn.Module, RetrofitConfig], Tensor]
    clamp: Callable[[nn.Module], None]
    save: Callable[[nn.Module, Path], None]
    report: bool = True


METHODS: dict[str, Method] = {}
register_choices("retrofit_method", METHODS)


def register_method(name: str, method: Method) -> None:
    """Make ``method`` the retrofit method ``name`` (``--method name``)."""
    METHODS[name] = method


def attach_spans(model: nn.Module, config: RetrofitConfig) -> None:
    """The spans of ``config`` attached to ``model`` at z' = 1 (the model unchanged)."""
    add_spans(model, config.span_limit, config.ramp, init=1.0, per_kv_head=config.per_kv_head,
              sinks=config.sinks)


def span_parameters(model: nn.Module) -> list[nn.Parameter]:
    """z' of every layer, in layer order."""
    return [span.z_frac for span in span_modules(model)]


def span_penalty(model: nn.Module, config: RetrofitConfig) -> Tensor:
    """lambda / M sum z, or per byte of cache (``penalty="byte"``, keys and values in bf16)."""
    if config.penalty == "byte":
        return cache_loss(model, config.span_loss, BYTES_PER_ELEMENT)
    return span_loss(model, config.span_loss)


register_method("spans", Method(attach_spans, span_parameters, span_penalty, clamp_spans,
                                save_model))
