"""Attention variants by name, each with what it declares. Each variant registers itself where
it is defined::

    @register_attention("vanilla", span=FixedSpan)
    class VanillaAttention(Attention): ...

An entry (:class:`Variant`) builds the variant's module from a ``ModelConfig`` and says what the
rest of the package asks about it without building it: its span type (a class of
:mod:`adaspan.attention.span`, whose ``learned`` and ``input_dependent`` say what its spans do),
its own checks of the options (called by ``ModelConfig``'s validation), and, for a span
attention, how to build its span alone (the spans ``attention=persistent`` can take).

Every list of variant names (``ModelConfig.attention``'s choices, the CLI's help, ``adaspan
compare --methods``, the tests' parametrisation) is read from :data:`ATTENTIONS`. Importing
:mod:`adaspan` registers the built-in variants; a variant defined elsewhere is available once
its module is imported. This module gives the configuration (a lower layer) the names and
checks it validates ``attention`` and ``persistent_span`` with (:func:`check_config`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from ..config import LiveNames, register_check, register_choices
from ..errors import ConfigError
from .span import FixedSpan, Span

Builder = TypeVar("Builder", bound=Callable[..., nn.Module])
# the Span class of a variant, or a function of the ModelConfig giving it
SpanType = type[Span] | Callable[[Any], type[Span]]


@dataclass(frozen=True)
class Variant:
    """A registered attention variant; calling it with a ``ModelConfig`` builds the module."""

    build: Callable[..., nn.Module]  # a class or a function of the ModelConfig
    span: SpanType = FixedSpan
    # raises ValueError (a ConfigError) with a one-line message for options it cannot take
    check: Callable[[Any], None] | None = None
    # builds its span alone, for a span attention: a span that persistent memory can take
    span_of: Callable[[Any], Span] | None = None

    def __call__(self, config: Any) -> nn.Module:
        return self.build(config)

    def span_type(self, config: Any) -> type[Span]:
        """The :class:`~adaspan.attention.span.Span` class of the variant's layers under
        ``config``."""
        return self.span if isinstance(self.span, type) else self.span(config)


# name -> Variant; this module sits below the configuration, which reads the names from it
ATTENTIONS: dict[str, Variant] = {}


def register_attention(name: str, *, span: SpanType = FixedSpan,
                       check: Callable[[Any], None] | None = None,
                       span_of: Callable[[Any], Span] | None = None
                       ) -> Callable[[Builder], Builder]:
    """Class or function decorator: ``ModelConfig(attention=name)`` builds layers with it.

    ``span``: the variant's :class:`~adaspan.attention.span.Span` class (a fixed span if not
    given), or a function of the ``ModelConfig`` giving it; ``check(config)``: the variant's own
    rules for the options, raising ValueError with a one-line message; ``span_of(config)``: its
    span alone, for a span attention. Registering the same builder again changes nothing."""
    def register(build: Builder) -> Builder:
        if name not in ATTENTIONS:
            ATTENTIONS[name] = Variant(build, span, check, span_of)
        elif (other := ATTENTIONS[name].build) is not build:
            raise ValueError(f"attention {name!r} is already registered by "
                             f"{other.__module__}.{other.__qualname__}")
        return build

    return register


def name_of(build: Callable[..., nn.Module]) -> str:
    """The name ``build`` is registered under (a variant is asked for by what it is, not by a
    name written elsewhere)."""
    for name, registered in ATTENTIONS.items():
        if registered.build is build:
            return name
    raise KeyError(f"{build.__qualname__} is not a registered attention variant")


class VariantNames(LiveNames):
    """The names of the registered variants that ``keep`` accepts, read from the registry when
    asked (a live list of choices)."""

    def __init__(self, keep: Callable[[Variant], bool]) -> None:
        self.keep = keep

    def _values(self) -> list[str]:
        return [name for name, variant in ATTENTIONS.items() if self.keep(variant)]


def check_config(config: Any) -> None:
    """What a ``ModelConfig`` must be for its attention variant: the variant's own checks
    (their ValueError a ConfigError), room beyond the ramp for learned spans (with S <= R every
    span ``min(S, z + R)`` is S whatever z), and ``kv_heads`` and rotary positions for the
    span attentions only."""
    variant = ATTENTIONS[config.attention]
    try:
        if variant.check is not None:
            variant.check(config)
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"attention={config.attention}: {exc}") from None
    if config.max_span <= config.ramp and variant.span_type(config).learned:
        raise ConfigError(
            f"max_span={config.max_span} must be larger than ramp={config.ramp} for "
            f"attention={config.attention}: every span would be pinned at max_span and "
            "nothing would adapt; raise max_span or lower ramp")
    if ((config.position_table == "rotary" or config.key_value_heads != config.n_heads)
            and variant.span_of is None):
        raise ConfigError(f"attention={config.attention} has neither kv_heads nor "
                          "position_table=rotary: they are for the span attentions ("
                          + ", ".join(VariantNames(lambda v: v.span_of is not None)) + ")")


register_choices("attention", ATTENTIONS.keys())
register_choices("persistent_span", VariantNames(lambda variant: variant.span_of is not None))
register_check("model", check_config)
