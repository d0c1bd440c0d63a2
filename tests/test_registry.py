"""The registry of attention variants: the package registers every variant it defines, names
are unique, and a variant registered later is built like the others."""

from __future__ import annotations

import inspect

import pytest
from helpers import span_variants, tiny_config

from adaspan import attention, baselines
from adaspan.attention import Attention, SpanAttention
from adaspan.registry import ATTENTIONS, name_of, register_attention
from adaspan.span import AdaptiveSpan, DynamicSpan, FixedSpan


def built(name: str) -> Attention:
    return ATTENTIONS[name](tiny_config(name))


def test_every_variant_builds_an_attention():
    for name in ATTENTIONS:
        assert isinstance(built(name), Attention), name


def test_every_attention_class_of_the_package_is_registered():
    defined = {cls for module in (attention, baselines)
               for _, cls in inspect.getmembers(module, inspect.isclass)
               if issubclass(cls, Attention) and cls.__module__ == module.__name__}
    registered = {type(built(name)) for name in ATTENTIONS}
    assert defined - {Attention} <= registered  # SpanAttention: through the span variants


def test_every_span_type_has_a_variant():
    assert {type(built(name).span) for name in span_variants()} == {
        FixedSpan, AdaptiveSpan, DynamicSpan}
    assert all(type(built(name)) is SpanAttention for name in span_variants())


def test_a_name_is_registered_once():
    name = next(iter(ATTENTIONS))
    build = ATTENTIONS[name]
    with pytest.raises(ValueError, match=f"'{name}' is already registered by "
                                         f"{build.__module__}.{build.__qualname__}"):
        register_attention(name)(lambda config: None)
    assert ATTENTIONS[name] is build
    assert register_attention(name)(build) is build  # the same builder again: no change


def test_registering_adds_the_variant_and_the_fixture_removes_it(toy_attention):
    assert list(ATTENTIONS)[-1] == toy_attention
    assert type(built(toy_attention)).__name__ == "PreviousToken"


def test_name_of_a_builder_is_its_registered_name():
    for name, build in ATTENTIONS.items():
        assert name_of(build) == name
    with pytest.raises(KeyError, match="not a registered"):
        name_of(lambda config: None)
