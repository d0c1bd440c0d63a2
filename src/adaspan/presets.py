"""Named configurations and how a run's configuration is put together.

:func:`resolve_config` starts from the dataclass defaults (or a saved run's configurations)
and applies, in order, a preset from :data:`PRESETS`, a TOML file with ``[model]`` and
``[train]`` tables, and ``key=value`` overrides (``model.d_model=256``, ``train.lr=0.01``, or
``lr=0.01`` when the name is unique).
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .config import SECTIONS, ConfigError, ModelConfig, Options, TrainConfig


def _paper(model: dict, train: dict, description: str) -> dict:
    """A preset following the paper's recipe (§3): Adagrad lr 0.07, 32k warm-up steps,
    clipping at 0.03 per tensor (as the authors' trainer), 64 streams of 512-character blocks,
    R=32, S=8192 with lambda 0.5e-6."""
    return {
        "description": description,
        "model": {"n_heads": 8, "max_span": 8192, "ramp": 32, "span_loss_coef": 0.5e-6,
                  "attention": "adaptive", **model},
        "train": {"batch_size": 64, "block_size": 512, "optimizer": "adagrad", "lr": 0.07,
                  "warmup": 32_000, "clip": 0.03, "clip_mode": "per-tensor-lr",
                  "eval_interval": 1000,
                  "eval_chars": 5_000_000, "checkpoint_interval": 1000, **train},
    }


_SMALL = {"n_layers": 12, "d_model": 512, "d_inner": 2048, "dropout": 0.3}
_LARGE = {"n_layers": 24, "d_model": 768, "d_inner": 4096, "dropout": 0.4}

# Measured on a 2-core CPU (README): with the authors' per-tensor clipping the paper's Adagrad
# recipe learns as fast per step as AdamW (with the global norm clipped at 0.03 it stays at
# unigram level); the CPU presets keep AdamW, slightly ahead after 10 minutes.
_CPU_MODEL = {"n_heads": 4, "dropout": 0.1, "ramp": 32, "span_loss_coef": 2e-6}
_CPU_TRAIN = {"data": "kjv", "optimizer": "adamw", "lr": 3e-3, "clip": 1.0, "clip_mode": "global",
              "weight_decay": 0.01}


def _cpu(model: dict, steps: int, batch: tuple[int, int], warmup: int, every: int, log: int,
         eval_chars: int, description: str) -> dict:
    """A preset with the CPU recipe above: ``steps`` of ``batch`` (streams, block size), with
    validation and a checkpoint ``every`` steps, a log line every ``log`` steps."""
    schedule = {"batch_size": batch[0], "block_size": batch[1], "steps": steps,
                "warmup": warmup, "eval_interval": every, "checkpoint_interval": every,
                "log_interval": log, "eval_chars": eval_chars}
    return {"description": description, "model": {**_CPU_MODEL, **model},
            "train": {**_CPU_TRAIN, **schedule}}


PRESETS: dict[str, dict] = {
    "text8-small": _paper(_SMALL, {"data": "text8", "steps": 900_000},
                          "paper's small model on text8 (Table 1): 12 layers, S=8192"),
    "enwik8-small": _paper(_SMALL, {"data": "enwik8", "steps": 900_000},
                           "paper's small model on enwik8 (Table 2): 12 layers, S=8192"),
    "text8-large": _paper(_LARGE, {"data": "text8", "steps": 270_000, "lr_drop_steps": 20_000},
                          "paper's large model on text8 (Table 1): 24 layers, 250k steps "
                          "+ 20k at lr/10"),
    "enwik8-large": _paper(_LARGE, {"data": "enwik8", "steps": 170_000, "lr_drop_steps": 20_000},
                           "paper's large model on enwik8 (Table 2): 24 layers, 150k steps "
                           "+ 20k at lr/10"),
    "enwik8-8layer": _paper(
        {**_SMALL, "n_layers": 8}, {"data": "enwik8", "steps": 600_000, "batch_split": 2},
        "adaspan's single-GPU configuration (not a paper table row): the small enwik8 model "
        "with 8 layers, the batch of 64 processed in 2 slices",
    ),
    "cpu-small": _cpu(
        {"n_layers": 4, "d_model": 256, "d_inner": 1024, "max_span": 1024},
        steps=2500, batch=(16, 128), warmup=200, every=250, log=50, eval_chars=65_536,
        description="4-layer model for a 2-core CPU, ~40 minutes (bundled King James Bible)",
    ),
    "demo": _cpu(
        {"n_layers": 3, "d_model": 192, "d_inner": 768, "max_span": 512},
        steps=2400, batch=(8, 64), warmup=100, every=400, log=100, eval_chars=16_384,
        description="3-layer model trained for ~4.5 minutes on a CPU (bundled King James Bible)",
    ),
}

def resolve_config(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    base: tuple[ModelConfig, TrainConfig] | None = None,
) -> tuple[ModelConfig, TrainConfig]:
    """Model and train configurations: ``base`` (default: the dataclass defaults) < ``preset``
    < ``config_file`` < ``overrides``. Pass a saved run's configs as ``base`` to resume it."""
    values: dict[str, dict] = {"model": {}, "train": {}}
    if base is not None:
        values = {"model": base[0].to_dict(), "train": base[1].to_dict()}
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}{_suggest(preset, PRESETS)}; "
                             f"available: {', '.join(PRESETS)}")
        for section in SECTIONS:
            values[section].update(PRESETS[preset][section])
    if config_file is not None:
        try:
            for section, key, value in _read_toml(Path(config_file)):
                values[section][key] = _coerce(section, key, value)
        except ConfigError as exc:
            raise ConfigError(f"config file {config_file}: {exc}") from None
    for item in overrides:
        section, key, text = _parse_override(item)
        values[section][key] = _coerce(section, key, text, item.partition("=")[0].strip())
    return ModelConfig(**values["model"]), TrainConfig(**values["train"])


def _read_toml(path: Path) -> list[tuple[str, str, object]]:
    """(section, key, value) of every option of a TOML file with [model] and [train] tables."""
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))  # as TOML requires
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read it: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"not valid TOML: {exc}") from exc
    options = []
    for section, table in document.items():
        if section not in SECTIONS or not isinstance(table, dict):
            raise ConfigError(f"unexpected {section!r}{_suggest(section, SECTIONS)}; "
                             "options go in [model] and [train] tables")
        options += [(section, key, value) for key, value in table.items()]
    return options


def _parse_override(item: str) -> tuple[str, str, str]:
    """``model.key=value``, ``train.key=value`` or ``key=value`` as (section, key, value)."""
    name, sep, text = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ConfigError(f"override {item!r} must look like key=value (e.g. train.lr=0.01)")
    section, dot, key = name.rpartition(".")
    if dot:
        return section, key, text.strip()
    owners = Options.sections_of(key)
    if len(owners) > 1:
        raise ConfigError(f"option {key!r} is ambiguous: write "
                         f"{' or '.join(f'{s}.{key}' for s in owners)}")
    if not owners:
        known = [k for cls in SECTIONS.values() for k in _field_names(cls)]
        raise ConfigError(f"unknown option {key!r}{_suggest(key, known)}")
    return owners[0], key, text.strip()


def _field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _field_type(section: str, key: str) -> object:
    """Type annotation of option ``key`` of ``section``; ConfigError naming close matches."""
    if section not in SECTIONS:
        raise ConfigError(f"unknown section {section!r} in {section}.{key}"
                         f"{_suggest(section, SECTIONS)}; use model or train")
    hints = typing.get_type_hints(SECTIONS[section])
    if key not in _field_names(SECTIONS[section]):
        raise ConfigError(f"unknown {section} option {key!r}"
                         f"{_suggest(key, _field_names(SECTIONS[section]))}")
    return hints[key]


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=3)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


_BOOLS = {"true": True, "1": True, "false": False, "0": False}
_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _coerce(section: str, key: str, value: object, name: str | None = None) -> object:
    """``value`` (a string from the command line or a TOML value) as the option's type;
    ``name``: the option as the user wrote it (default: ``section.key``)."""
    kind = _field_type(section, key)
    optional = isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind)
    if optional:
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        if isinstance(value, str) and value.strip().lower() in ("none", "null", ""):
            return None
    try:
        if isinstance(value, str) and kind is not str:
            return _parse(value.strip(), kind)
        if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, kind) and isinstance(value, bool) == (kind is bool):
            return value
    except (KeyError, ValueError):
        pass
    expected = _KINDS[kind] + (" or none" if optional else "")
    raise ConfigError(f"{name or f'{section}.{key}'} must be {expected}, got {value!r}")


def _parse(text: str, kind: type) -> object:
    """``text`` as a bool (true/false/1/0), an int (also ``1e6``) or a float."""
    if kind is bool:
        return _BOOLS[text.lower()]
    if kind is int:
        try:
            return int(text)
        except ValueError:
            number = float(text)
            if not number.is_integer():
                raise
            return int(number)
    return float(text)
