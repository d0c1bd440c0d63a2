"""Presets (presets.py) and the preset < config file < overrides resolution (resolve.py)."""

from __future__ import annotations

import dataclasses

import pytest

from adaspan import ModelConfig, TrainConfig
from adaspan.config import SECTIONS, ConfigError, Options
from adaspan.model.lm import parameter_count
from adaspan.presets import PRESETS
from adaspan.resolve import resolve_config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_valid_configs(name):
    model, train = resolve_config(name)  # raises if a value is invalid
    preset = PRESETS[name]
    assert preset.keys() == {"description", "model", "train"}
    assert preset["description"] and "\n" not in preset["description"]
    assert model.to_dict().items() >= preset["model"].items()
    assert train.to_dict().items() >= preset["train"].items()


@pytest.mark.parametrize(
    ("name", "layers", "d_model", "dropout", "steps", "lr_drop_steps"),
    [
        ("text8-small", 12, 512, 0.3, 900_000, 0),
        ("enwik8-small", 12, 512, 0.3, 900_000, 0),
        ("text8-large", 24, 768, 0.4, 270_000, 20_000),
        ("enwik8-large", 24, 768, 0.4, 170_000, 20_000),
    ],
)
def test_paper_presets_follow_section_3(name, layers, d_model, dropout, steps, lr_drop_steps):
    model, train = resolve_config(name)
    assert (model.n_layers, model.d_model, model.n_heads, model.dropout) == (
        layers, d_model, 8, dropout)
    assert (model.max_span, model.ramp, model.span_loss_coef) == (8192, 32, 0.5e-6)
    assert (train.optimizer, train.lr, train.warmup, train.clip) == ("adagrad", 0.07, 32_000, 0.03)
    assert (train.batch_size, train.block_size) == (64, 512)
    assert (train.steps, train.lr_drop_steps, train.lr_drop_factor) == (steps, lr_drop_steps, 0.1)
    assert train.data == name.split("-")[0]


@pytest.mark.parametrize(
    ("name", "paper_vocab", "paper_millions"),
    [("text8-small", 28, 38), ("text8-large", 28, 209), ("enwik8-small", 205, 39),
     ("enwik8-large", 205, 209)],
)
def test_paper_presets_have_the_papers_parameter_counts(name, paper_vocab, paper_millions):
    """Tables 1-2 round to the million and use the corpus's symbols (text8: 27 characters and
    end of line; enwik8: ~204 bytes and end of line); adaspan reads bytes (vocabulary 256),
    which adds (256 - V) embedding rows and output rows + biases, nothing else."""
    model = resolve_config(name)[0]
    paper_model = dataclasses.replace(model, vocab_size=paper_vocab)
    count = parameter_count(paper_model)
    assert round(count / 1e6) == paper_millions
    if name != "enwik8-small":  # 38.54M: within the table's rounding of 39M, 1.2% below it
        assert abs(count / (paper_millions * 1e6) - 1) < 0.01
    extra = (256 - paper_vocab) * (2 * model.d_model + 1)
    assert parameter_count(model) == count + extra


def test_cpu_presets_do_not_use_the_paper_optimizer():
    for name in ("cpu-small", "demo"):
        assert resolve_config(name)[1].optimizer == "adamw"


def test_no_preset_gives_the_defaults():
    assert resolve_config() == (ModelConfig(), TrainConfig())


def test_file_overrides_preset_and_overrides_win(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nd_model = 128\nn_layers = 2\n\n[train]\nlr = 1\nsteps = 50\n'
                    'time_budget = 60\n')
    model, train = resolve_config("demo", path, ["model.n_layers=5", "steps=7", "dropout=0",
                                                 "tensorboard=false", "data_dir=none"])
    assert model.d_model == 128  # file over preset
    assert model.n_layers == 5 and train.steps == 7  # overrides over file
    assert train.lr == 1.0 and isinstance(train.lr, float)
    assert train.time_budget == 60.0
    assert model.dropout == 0.0 and train.tensorboard is False and train.data_dir is None
    assert model.n_heads == PRESETS["demo"]["model"]["n_heads"]  # untouched preset value


def test_overrides_apply_to_a_base_such_as_a_saved_run():
    saved = resolve_config("demo", None, ["steps=100", "max_span=128"])
    model, train = resolve_config(base=saved, overrides=["steps=300"])
    assert train.steps == 300 and model.max_span == 128
    assert (model, train.lr) == (saved[0], saved[1].lr)


@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [("1", "bool", True), ("False", "bool", False), ("9e5", "int", 900_000),
     ("1_000", "int", 1000), ("3e-4", "float", 3e-4), ("none", "float", None)],
)
def test_override_values_are_parsed_by_field_type(text, kind, expected):
    key = {"bool": "tensorboard", "int": "steps", "float": "time_budget"}[kind]
    _, train = resolve_config(None, None, [f"{key}={text}", "lr_drop_steps=0"])
    assert getattr(train, key) == expected


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lrr=0.1", r"unknown train option 'lrr' \(did you mean lr\?\)"),
        ("d_modle=64", r"unknown option 'd_modle' \(did you mean d_model\b"),
        ("modle.d_model=64", r"unknown section 'modle'.*did you mean model"),
        ("steps=1.5", r"^steps must be an integer, got '1.5'$"),  # named as written
        ("train.steps=1.5", r"^train\.steps must be an integer"),
        ("tensorboard=maybe", r"^tensorboard must be true or false"),
        ("lr", r"key=value"),
    ],
)
def test_bad_overrides_explain_themselves(override, message):
    with pytest.raises(ConfigError, match=message):
        resolve_config(None, None, [override])


def test_bad_config_files_and_presets(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training]\nlr = 0.1\n")
    with pytest.raises(ConfigError, match=r"bad\.toml.*'training'.*did you mean train"):
        resolve_config(None, path)
    path.write_text('[train]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=r"train\.lr must be a number"):
        resolve_config(None, path)
    with pytest.raises(ConfigError, match=r"did you mean text8-small"):
        resolve_config("text8-smal")
    path.write_bytes(b"\xff\xfe[train]")
    for unreadable in (path, tmp_path / "missing.toml"):
        with pytest.raises(ConfigError, match=rf"{unreadable.name}: cannot read it"):
            resolve_config(None, unreadable)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["steps=0"], "steps must be a positive integer, got 0"),
        (["train.steps=0"], "steps must be a positive integer, got 0"),
        (["d_model=-8"], "d_model must be a positive integer, got -8"),
        (["threads=-1"], "threads must be an integer >= 0"),
    ],
)
def test_invalid_values_name_the_option_as_the_user_writes_it(overrides, message):
    with pytest.raises(ConfigError) as error:
        resolve_config("demo", None, overrides)
    assert str(error.value).startswith(message)  # not TrainConfig.steps


def test_an_option_name_of_two_sections_is_given_with_its_section(monkeypatch):
    @dataclasses.dataclass
    class Other(Options):
        section = "other"
        steps: int = 1

    assert TrainConfig.option_name("steps") == "steps"
    monkeypatch.setitem(SECTIONS, "other", Other)
    assert TrainConfig.option_name("steps") == "train.steps"
    with pytest.raises(ConfigError, match=r"^train\.steps must be a positive integer"):
        TrainConfig(steps=0)
    with pytest.raises(ConfigError, match=r"ambiguous: write train\.steps or other\.steps"):
        resolve_config(None, None, ["steps=5"])
