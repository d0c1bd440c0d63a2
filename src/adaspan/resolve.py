"""How a run's configuration is put together from its sources.

:func:`resolve_config` starts from the dataclass defaults (or a saved run's configurations)
and applies, in order, a preset of :data:`adaspan.presets.PRESETS`, a TOML file with
``[model]`` and ``[train]`` tables, and ``key=value`` overrides (``model.d_model=256``,
``train.lr=0.01``, or ``lr=0.01`` when the name is unique), each value read as its option's
type.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable
from dataclasses import fields
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from .config import SECTIONS, ConfigError, ModelConfig, Options, TrainConfig
from .data.tokenizer import TOKENIZERS
from .presets import PRESETS


def resolve_config(
    preset: str | None = None,
    config_file: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    base: tuple[ModelConfig, TrainConfig] | None = None,
) -> tuple[ModelConfig, TrainConfig]:
    """Model and train configurations: ``base`` (default: the dataclass defaults) < ``preset``
    < ``config_file`` < ``overrides``. Pass a saved run's configs as ``base`` to resume it.

    A ``vocab_size`` set by an earlier source than the ``tokenizer`` (or by none) is not that
    tokenizer's: it becomes the tokenizer's own ``default_size`` (``--preset demo
    tokenizer=words`` gets a words vocabulary, not the 256 bytes)."""
    values: dict[str, dict] = {"model": {}, "train": {}}
    sources: list[dict[str, dict]] = []  # what each source sets, in order
    if base is not None:
        sources.append({"model": base[0].to_dict(), "train": base[1].to_dict()})
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}{_suggest(preset, PRESETS)}; "
                             f"available: {', '.join(PRESETS)}")
        sources.append({section: dict(PRESETS[preset][section]) for section in SECTIONS})
    if config_file is not None:
        try:
            sources.append(_sections((section, key, _coerce(section, key, value))
                                     for section, key, value in _read_toml(Path(config_file))))
        except ConfigError as exc:
            raise ConfigError(f"config file {config_file}: {exc}") from None
    sources.append(_sections(
        (section, key, _coerce(section, key, text, item.partition("=")[0].strip()))
        for item in overrides for section, key, text in [_parse_override(item)]))
    for source in sources:
        for section in SECTIONS:
            values[section].update(source[section])
    _vocabulary_of_the_tokenizer(values, sources)
    return ModelConfig(**values["model"]), TrainConfig(**values["train"])


def _sections(options: Iterable[tuple[str, str, object]]) -> dict[str, dict]:
    """``(section, key, value)`` triples as ``{section: {key: value}}``."""
    out: dict[str, dict] = {section: {} for section in SECTIONS}
    for section, key, value in options:
        out[section][key] = value
    return out


def _vocabulary_of_the_tokenizer(values: dict[str, dict], sources: list[dict[str, dict]]) -> None:
    """The tokenizer's ``default_size`` as ``vocab_size`` where the last source that sets the
    tokenizer comes after the last that sets the vocabulary (or none sets it)."""
    def last(section: str, key: str) -> int:
        return max((i for i, source in enumerate(sources) if key in source[section]), default=-1)

    name = values["train"].get("tokenizer")
    if name in TOKENIZERS and last("model", "vocab_size") < last("train", "tokenizer"):
        values["model"]["vocab_size"] = TOKENIZERS[name].default_size


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
