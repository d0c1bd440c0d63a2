"""Expected failures. An error of this kind is the user's to fix (a bad option, a missing or
corrupt file, a run that diverged): the command line prints its message on one line and exits
with status 2, as it does for an OSError (the file system: a missing file, a full disk) and a
MemoryError. Any other exception is a bug and is reported as one (status 1).

``ConfigError`` (an invalid option) is here, below every part, because each part checks
its own options; each module defines the subclasses of its own other failures
(``run.checkpoint.RunDirError``, ``data.download.DataError``, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class UserError(Exception):
    """A failure the user can act on; its message says what to change."""


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (its type's name if it has none): for an error that
    quotes another."""
    return " ".join(str(exc).split()) or type(exc).__name__


class ConfigError(UserError, ValueError):
    """An invalid option: of a configuration, a preset, a TOML file, an override or a
    command."""


def require(name: str, value: object, ok: Callable[[Any], object], what: str) -> None:
    """Raise ``ConfigError("<name> must be <what>, got <value>")`` unless ``ok(value)``."""
    try:
        valid = bool(ok(value))
    except TypeError:
        valid = False
    if not valid:
        raise ConfigError(f"{name} must be {what}, got {value!r}")


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk is full: ENOSPC, also as quoted by a library (safetensors
    raises its own error with the OS's message)."""
    return getattr(exc, "errno", None) == 28 or "No space left on device" in str(exc)


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed allocation: MemoryError, CUDA's OutOfMemoryError, or the
    CPU allocator's RuntimeError."""
    return (isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"
            or "can't allocate memory" in str(exc))
