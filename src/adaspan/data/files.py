"""Files written atomically and tensor files read safely: what every module that writes a run's
files or reads a PyTorch checkpoint shares.

:func:`atomic_write` writes each file to a temporary file next to it (``.NAME.<hex>.tmp``),
flushed and fsynced, and only then renames them all into place: a reader sees the old file or
the new one, never a part of it. :func:`load_pickled_tensors` reads a PyTorch file without
letting it run code.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import UserError

TEMP_SUFFIX = ".tmp"  # the ending of atomic_write's temporary files


class CheckpointFileError(UserError, ValueError):
    """A file read as a PyTorch checkpoint that is not one, or holds more than tensors and
    plain values (which could run code): refused."""


def atomic_write(files: dict[Path, Callable[[Path], None]]) -> None:
    """Create or replace each path by calling its writer on a temporary file first.

    All temporary files are written and fsynced before any is renamed into place.
    """
    temps: dict[Path, Path] = {}
    mode = 0o666 & ~_umask()
    try:
        for path, write in files.items():
            temps[path] = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
            write(temps[path])
            os.chmod(temps[path], mode)  # as a plain open() would (safetensors writes 0600)
            with temps[path].open("rb+") as written:
                os.fsync(written.fileno())
        for path, temp in temps.items():
            os.replace(temp, path)
    finally:
        for temp in temps.values():
            temp.unlink(missing_ok=True)
    for folder in {path.parent for path in files}:
        _fsync_dir(folder)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def load_pickled_tensors(path: Path, device: str | torch.device = "cpu") -> object:
    """A PyTorch file (pickle) read with ``torch.load(weights_only=True)``: tensors and plain
    containers only, so that it cannot run code. Any other file is refused with
    :class:`CheckpointFileError`, whose message never suggests lifting the restriction."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "GLOBAL" in str(exc):  # torch refused to import something: code, or objects
            raise CheckpointFileError(f"{path} holds objects other than tensors and plain "
                                      "values; adaspan does not load it, as that could run "
                                      "code") from None
        raise CheckpointFileError(f"{path} is not a PyTorch file (it cannot be "
                                  "unpickled)") from None
    except (RuntimeError, EOFError, AttributeError, ImportError) as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointFileError(f"{path} is not a PyTorch file: {first_line}") from None


def existing_ancestor(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (where a folder not made yet will be)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
