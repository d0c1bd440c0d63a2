"""The configurations: validation that names the field, dict round trips, each option's help
and choices (field metadata), the options a resumed run must keep."""

from __future__ import annotations

import re
from dataclasses import MISSING, fields

import pytest
from helpers import tiny_config

from adaspan.attention.registry import ATTENTIONS
from adaspan.config import SECTIONS, ConfigError, ModelConfig, TrainConfig

# --- ModelConfig --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [("d_model", 30), ("n_heads", 0), ("ramp", 1), ("dropout", 1.0), ("attention", "sparse"),
     ("max_span", -5), ("span_init", 2.0), ("truncation", "some"), ("vocab_size", 2.5),
     ("n_layers", True), ("span_bucket", 0), ("position_table", "global"),
     ("span_loss_coef", -1e-6), ("span_per", "heads")],
)
def test_invalid_config_names_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"^{field} must be "):  # as the user writes it
        ModelConfig(**{field: value})


def test_unknown_attention_lists_every_registered_variant():
    with pytest.raises(ConfigError, match=re.escape(f"one of {', '.join(ATTENTIONS)}, got 'x'")):
        ModelConfig(attention="x")


def test_the_attention_choices_follow_the_registry(toy_attention):
    assert tiny_config(toy_attention).attention == toy_attention  # registered after import


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="unknown model option"):
        ModelConfig.from_dict({"d_model": 64, "heads": 4})


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_model_config_round_trips_through_a_dict(attention):
    config = tiny_config(attention, span_init=0.25, truncation="layer")
    assert ModelConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("field", "options"),
    [("factorized_stride", dict(factorized_stride=0)),
     ("factorized_c", dict(factorized_c=0)),
     ("factorized_c", dict(factorized_stride=8, factorized_c=16)),
     ("factorized_c", dict(factorized_c=2.5)),
     ("n_heads", dict(attention="factorized", n_heads=1)),
     ("max_span", dict(attention="factorized", max_span=64, factorized_stride=128))],
)
def test_invalid_factorized_config_names_the_field(field, options):
    with pytest.raises(ConfigError, match=rf"^{field} must be "):
        ModelConfig(**options)


def test_stride_limits_only_apply_to_factorized():
    ModelConfig(attention="xl", max_span=64, n_heads=1, d_model=16)
    cfg = ModelConfig(attention="factorized", max_span=256, factorized_stride=256,
                      factorized_c=32)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(("attention", "options"),
                         [("adaptive", dict(max_span=16)),
                          ("dynamic", dict(max_span=16, ramp=64)),
                          ("adaptive", dict(max_span=32, ramp=32))])
def test_learned_spans_that_could_not_adapt_are_refused(attention, options):
    message = (f"max_span={options['max_span']} must be larger than "
               f"ramp={options.get('ramp', 32)} for attention={attention}: every span would be "
               "pinned at max_span and nothing would adapt; raise max_span or lower ramp")
    with pytest.raises(ConfigError, match=re.escape(message)):
        ModelConfig(attention=attention, **options)


@pytest.mark.parametrize("attention", list(ATTENTIONS))
def test_one_span_per_layer_is_accepted_by_every_variant(attention):
    """As span_init: the variants without learned spans ignore it, so that one configuration
    (``adaspan compare span_per=layer``) builds every method."""
    config = tiny_config(attention, span_per="layer")
    assert ModelConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("attention", ["fixed", "vanilla", "xl"])
def test_spans_that_do_not_adapt_may_be_shorter_than_the_ramp(attention):
    assert ModelConfig(attention=attention, max_span=16).max_span == 16
    assert ModelConfig(attention="adaptive", max_span=33).max_span == 33  # z in [0, 1]


# --- TrainConfig --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 6, "batch_split": 4}, "batch_size"),
        ({"steps": 2.5}, "steps"),
        ({"lr": -1.0}, "lr"),
        ({"warmup": -1}, "warmup"),
        ({"clip": float("nan")}, "clip"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"clip_mode": "norm"}, "clip_mode"),
        ({"dtype": "float16"}, "dtype"),
        ({"kernel": "flash"}, "kernel"),
        ({"device": "gpu"}, "device"),
        ({"time_budget": 0}, "time_budget"),
        ({"lr_drop_steps": 2_000_000}, "lr_drop_steps"),
        ({"lr_schedule": "cos"}, "lr_schedule"),
        ({"lr_end_factor": 1.5}, "lr_end_factor"),
        ({"lr_end_factor": float("nan")}, "lr_end_factor"),
        ({"log_interval": True}, "log_interval"),
        ({"tensorboard": "yes"}, "tensorboard"),
    ],
)
def test_train_config_errors_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=rf"^{field} must be "):
        TrainConfig(**changes)


def test_train_config_round_trips_through_a_dict():
    config = TrainConfig(steps=10, time_budget=5.0, data_dir="/tmp")
    assert TrainConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ConfigError, match=r"unknown train option.*stepz"):
        TrainConfig.from_dict({"stepz": 1})


def test_a_resumed_run_keeps_the_options_of_its_data_stream_and_optimiser():
    assert sorted(TrainConfig.fixed_on_resume()) == sorted(
        ["data", "tokenizer", "tokenizer_file", "batch_size", "block_size", "optimizer", "lr",
         "warmup", "weight_decay"])


# --- both ---------------------------------------------------------------------------------------


def test_sections_name_their_classes():
    assert {"model": ModelConfig, "train": TrainConfig} == SECTIONS
    assert all(cls.section == name for name, cls in SECTIONS.items())


@pytest.mark.parametrize("section", list(SECTIONS))
def test_every_option_has_a_help_line_with_its_choices_and_default(section):
    cls = SECTIONS[section]
    for item in fields(cls):
        text, choices = item.metadata["help"], item.metadata["choices"]
        assert isinstance(text, str) and text.strip(), item.name
        line = cls.help(item)
        assert line.startswith(text) and "\n" not in line, item.name
        if choices is not None:
            assert f"({' | '.join(choices)})" in line, item.name
        assert item.default is not MISSING
        assert line.endswith(f"[default: {item.default}]") or "(default" in text  # said once


@pytest.mark.parametrize("options,message", [
    (dict(kv_heads=3), "kv_heads must be none or a positive divisor of n_heads=4"),
    (dict(kv_heads=0), "kv_heads must be"),
    (dict(position_table="rotary", d_model=12, n_heads=4), "d_head=3 is odd"),
    (dict(attention="xl", kv_heads=2), "attention=xl has neither kv_heads nor"),
    (dict(attention="persistent", position_table="rotary"), "for the span attentions"),
])
def test_grouped_query_and_rotary_options_are_checked(options, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        tiny_config(**{"attention": "adaptive", **options})


def test_grouped_query_and_rotary_options_are_accepted_by_the_span_attentions():
    for attention in ("fixed", "adaptive", "dynamic"):
        config = tiny_config(attention, kv_heads=2, position_table="rotary")
        assert config.key_value_heads == 2
    assert tiny_config().key_value_heads == tiny_config().n_heads  # kv_heads none: n_heads
