"""The registry of attention variants: the package registers every variant it defines, names
are unique, what a variant declares (span type, option checks, its span alone) holds for what it
builds, and a variant registered later is built and checked like the others."""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
from helpers import span_variants, tiny_config

from adaspan.attention import baselines
from adaspan.attention import span_attention as attention
from adaspan.attention.registry import ATTENTIONS, name_of, register_attention
from adaspan.attention.span import AdaptiveSpan, DynamicSpan, FixedSpan
from adaspan.attention.span_attention import Attention, SpanAttention, fixed_span
from adaspan.config import ConfigError, ModelConfig


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
    build = ATTENTIONS[name].build
    with pytest.raises(ValueError, match=f"'{name}' is already registered by "
                                         f"{build.__module__}.{build.__qualname__}"):
        register_attention(name)(lambda config: None)
    before = ATTENTIONS[name]
    assert before.build is build
    assert register_attention(name)(build) is build  # the same builder again: no change
    assert ATTENTIONS[name] is before


def test_registering_adds_the_variant_and_the_fixture_removes_it(toy_attention):
    assert list(ATTENTIONS)[-1] == toy_attention
    assert type(built(toy_attention)).__name__ == "PreviousToken"


def test_name_of_a_builder_is_its_registered_name():
    for name, variant in ATTENTIONS.items():
        assert name_of(variant.build) == name
    with pytest.raises(KeyError, match="not a registered"):
        name_of(lambda config: None)


@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_the_declared_span_type_is_the_span_built(name):
    config = tiny_config(name)
    assert type(built(name).span) is ATTENTIONS[name].span_type(config)
    if name == "persistent":  # the span of its persistent_span, whatever that is
        for span in ("fixed", "dynamic"):
            changed = replace(config, persistent_span=span)
            assert ATTENTIONS[name].span_type(changed) is ATTENTIONS[span].span_type(changed)


def test_a_span_attention_builds_its_span_alone():
    for name in span_variants():
        config = tiny_config(name)
        assert type(ATTENTIONS[name].span_of(config)) is type(built(name).span)
    assert set(ModelConfig.__dataclass_fields__["persistent_span"].metadata["choices"]) == set(
        span_variants())


def test_a_variant_defined_elsewhere_brings_its_own_option_checks():
    def at_most_two_layers(config: ModelConfig) -> None:
        if config.n_layers > 2:
            raise ValueError(f"n_layers must be at most 2, got {config.n_layers}")

    name = "toy-checked"
    register_attention(name, check=at_most_two_layers)(
        lambda config: SpanAttention(config, fixed_span(config)))
    try:
        assert ModelConfig(attention=name, n_layers=2).n_layers == 2
        with pytest.raises(ConfigError, match=f"^attention={name}: n_layers must be at most 2, "
                                              "got 3$"):
            ModelConfig(attention=name, n_layers=3)
        assert ATTENTIONS[name].span_type(ModelConfig(attention=name, n_layers=1)) is FixedSpan
    finally:
        ATTENTIONS.pop(name)


def test_a_built_in_check_refuses_what_the_variant_cannot_take():
    with pytest.raises(ConfigError, match="n_heads must be >= 2 for factorized attention"):
        ModelConfig(attention="factorized", n_heads=1, d_model=64)
