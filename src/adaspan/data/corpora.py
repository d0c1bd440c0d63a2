"""Byte-level corpora and the block batching used to train on them.

Every corpus is raw bytes (vocabulary of 256), stored as 1-D ``numpy.uint8`` arrays.
Sources:

* ``"kjv"``: the King James Bible shipped inside the package (the default);
* ``"enwik8"`` / ``"text8"``: the Large Text Compression Benchmark files of Matt Mahoney,
  fetched and verified by :mod:`adaspan.data.download`, then memory-mapped;
* ``"synthetic:copy"`` / ``"synthetic:words"`` (with parameters after a ``?``): texts with
  long-range structure generated from a seed by :mod:`adaspan.data.synthetic`;
* any local file (plain, ``.gz`` or single-member ``.zip``) or a directory of split files.
"""

from __future__ import annotations

import gzip
import math
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from .download import BENCHMARKS, MIN_SPLIT_BYTES, Benchmark, DataError, fetch
from .synthetic import NAMES, is_synthetic, synthesize

VOCAB_SIZE = 256
DEFAULT_CORPUS = "kjv"
DEFAULT_SPLIT = (0.9, 0.05)
SPLITS = ("train", "valid", "test")
EMBEDDED = {"kjv": "kjv.txt.gz"}  # corpus name -> gzip file in the adaspan.corpus package data


class ShortDataError(DataError, ValueError):
    """Too few tokens for the streams or the blocks a :class:`BlockStream` is asked for."""


_SPLIT_STEMS = {"train": ("train",), "valid": ("valid", "val"), "test": ("test",)}
_SPLIT_SUFFIXES = (".txt", "", ".gz", ".txt.gz")


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as a ``uint8`` array."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: np.ndarray | torch.Tensor | Sequence[int]) -> str:
    """Text from byte tokens (array, tensor or list); invalid UTF-8 becomes U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    array = np.asarray(tokens).ravel()
    if array.size and (array.min() < 0 or array.max() >= VOCAB_SIZE):
        raise ValueError(
            f"tokens must be bytes in [0, {VOCAB_SIZE - 1}], got values in "
            f"[{array.min()}, {array.max()}]"
        )
    return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass
class Corpus:
    """A named corpus cut into contiguous train/valid/test byte arrays."""

    name: str
    train: np.ndarray
    valid: np.ndarray
    test: np.ndarray

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def split(self, name: str) -> np.ndarray:
        """The array of split ``name`` ("train", "valid" or "test")."""
        if name not in SPLITS:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(SPLITS)}")
        return getattr(self, name)

    def summary(self) -> dict[str, int | str]:
        """Name, vocabulary size and the byte count of each split."""
        sizes = {name: len(self.split(name)) for name in SPLITS}
        return {"name": self.name, "vocab_size": VOCAB_SIZE, **sizes, "total": sum(sizes.values())}


def resolve_data(spec: str) -> str:
    """``TrainConfig.data`` as stored in a run: a built-in corpus keeps its name, a path
    becomes absolute (so that the run can be evaluated and resumed from any directory)."""
    if spec in EMBEDDED or spec in BENCHMARKS or is_synthetic(spec):
        return spec
    return str(Path(spec).expanduser().resolve())


def load_corpus(
    spec: str | Path | Benchmark = DEFAULT_CORPUS,
    data_dir: str | Path | None = None,
    split: tuple[float, float] | None = None,
    progress: bool = True,
) -> Corpus:
    """Load a corpus by name ("kjv", "enwik8", "text8"), :class:`Benchmark` or path.

    A string naming a built-in corpus wins over a file of that name (write ``./kjv`` for the
    file). ``split`` = (train, valid) fractions, the test split taking the rest; the default is
    90/5/5, except for benchmarks, which use their standard byte counts. A file may be plain,
    ``.gz`` or a ``.zip`` with one member. A directory must hold one file per split, named
    ``train``, ``valid`` or ``val``, and ``test``, each with suffix ``.txt``, ``.gz``,
    ``.txt.gz`` or none.
    """
    if isinstance(spec, Benchmark):
        return _load_benchmark(spec, data_dir, split, progress)
    if isinstance(spec, str) and spec in EMBEDDED:
        return _split_corpus(spec, _read_embedded(EMBEDDED[spec]), split)
    if isinstance(spec, str) and spec in BENCHMARKS:
        return _load_benchmark(BENCHMARKS[spec], data_dir, split, progress)
    if is_synthetic(spec):
        return _split_corpus(spec, synthesize(spec).tokens, split)
    path = Path(spec).expanduser()
    if path.is_dir():
        if split is not None:
            raise ValueError(f"split fractions do not apply to {path}: it holds its own splits")
        return _load_directory(path)
    if path.is_file():
        return _split_corpus(path.name, _read_file(path), split)
    names = ", ".join([*EMBEDDED, *BENCHMARKS, *NAMES])
    raise DataError(
        f"no corpus {str(spec)!r}: not a built-in corpus ({names}) "
        f"and no file or directory at {path.absolute()}"
    )


def source_distance(spec: str, split_name: str,
                    split: tuple[float, float] | None = None) -> np.ndarray:
    """Per character of split ``split_name`` of synthetic corpus ``spec``: the distance back
    to the character it repeats (0: none; see :class:`adaspan.data.synthetic.Synthetic`)."""
    if not is_synthetic(spec):
        raise DataError(f"{spec!r} is not a synthetic corpus: only those know which "
                        "characters need long context")
    return _split_corpus(spec, synthesize(spec).distance, split).split(split_name)


def _load_benchmark(
    benchmark: Benchmark,
    data_dir: str | Path | None,
    split: tuple[float, float] | None,
    progress: bool,
) -> Corpus:
    tokens = np.memmap(fetch(benchmark, data_dir, progress=progress), dtype=np.uint8, mode="r")
    if split is not None:
        return _split_corpus(benchmark.name, tokens, split)
    valid_end = benchmark.train_size + benchmark.valid_size
    return Corpus(
        benchmark.name,
        tokens[: benchmark.train_size],
        tokens[benchmark.train_size : valid_end],
        tokens[valid_end:],
    )


def _read_embedded(filename: str) -> np.ndarray:
    packed = resources.files("adaspan").joinpath("corpus", filename).read_bytes()
    return np.frombuffer(gzip.decompress(packed), dtype=np.uint8)


def _read_file(path: Path) -> np.ndarray:
    """Bytes of a plain (memory-mapped), ``.gz`` or single-member ``.zip`` file."""
    if path.suffix == ".gz":
        try:
            with gzip.open(path, "rb") as src:
                data = src.read()
        except (OSError, EOFError, zlib.error) as exc:
            raise DataError(f"cannot read {path} as gzip: {exc}") from exc
    elif path.suffix == ".zip":
        data = _read_single_member(path)
    else:
        if path.stat().st_size == 0:
            raise DataError(f"corpus file {path} is empty")
        return np.memmap(path, dtype=np.uint8, mode="r")
    if not data:
        raise DataError(f"corpus file {path} is empty")
    return np.frombuffer(data, dtype=np.uint8)


def _read_single_member(path: Path) -> bytes:
    try:
        with zipfile.ZipFile(path) as zipped:
            members = [info for info in zipped.infolist() if not info.is_dir()]
            if len(members) != 1:
                listed = ", ".join(info.filename for info in members) or "no files"
                raise DataError(
                    f"{path} must contain exactly one file to be used as a corpus, "
                    f"it holds {listed}; unzip it and load the file you want"
                )
            return zipped.read(members[0])
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise DataError(f"cannot read {path} as a zip archive: {exc}") from exc


def _load_directory(folder: Path) -> Corpus:
    arrays = {}
    for split_name in SPLITS:
        path = _find_split_file(folder, split_name)
        arrays[split_name] = _read_file(path)
        if len(arrays[split_name]) < MIN_SPLIT_BYTES:
            raise DataError(f"{path} must hold at least {MIN_SPLIT_BYTES} bytes")
    return Corpus(folder.name, **arrays)


def _find_split_file(folder: Path, split_name: str) -> Path:
    candidates = [
        folder / (stem + suffix) for stem in _SPLIT_STEMS[split_name] for suffix in _SPLIT_SUFFIXES
    ]
    found = [path for path in candidates if path.is_file()]
    if not found:
        accepted = ", ".join(path.name for path in candidates)
        raise DataError(f"directory {folder} has no {split_name} file; expected one of {accepted}")
    if len(found) > 1:
        raise DataError(
            f"directory {folder} has several {split_name} files "
            f"({', '.join(path.name for path in found)}); keep only one"
        )
    return found[0]


def _split_corpus(name: str, tokens: np.ndarray, split: tuple[float, float] | None) -> Corpus:
    """Cut ``tokens`` contiguously: round(n*train) bytes, round(n*valid) bytes, the rest."""
    if split is None:
        split = DEFAULT_SPLIT
    if len(split) != 2 or not (split[0] > 0 and split[1] > 0 and split[0] + split[1] < 1):
        raise ValueError(
            f"split must be (train, valid) fractions > 0 whose sum is < 1, got {split!r}"
        )
    train_frac, valid_frac = split
    total = len(tokens)
    if total == 0:
        raise DataError(f"corpus {name!r} is empty")
    train_end = round(total * train_frac)
    valid_end = train_end + round(total * valid_frac)
    sizes = {"train": train_end, "valid": valid_end - train_end, "test": total - valid_end}
    short = [f"{split_name} {size}" for split_name, size in sizes.items() if size < MIN_SPLIT_BYTES]
    if short:
        raise DataError(
            f"corpus {name!r} has {total} bytes, too few for split {train_frac}/{valid_frac}: "
            f"{', '.join(short)} bytes (each split needs at least {MIN_SPLIT_BYTES})"
        )
    return Corpus(name, tokens[:train_end], tokens[train_end:valid_end], tokens[valid_end:])


class BlockStream:
    """A token array as ``batch_size`` parallel streams, read in consecutive blocks.

    With ``n = (len(tokens) - 1) // batch_size``, row ``b`` reads inputs
    ``tokens[b*n : b*n + n]`` and targets one position later, so block ``i`` holds columns
    ``i*block_size`` up to ``(i+1)*block_size`` of every row, and consecutive blocks continue
    each row where the previous block stopped (a cache can be carried over). The last block
    may be shorter unless ``drop_last`` is set; without it every target is predicted once.
    Blocks are converted to int64 tensors one at a time.
    """

    def __init__(
        self, tokens: np.ndarray, batch_size: int, block_size: int, *, drop_last: bool = False
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, got shape {tokens.shape} {tokens.dtype}"
            )
        n = (len(tokens) - 1) // batch_size
        if n < 1:
            raise ShortDataError(
                f"{len(tokens)} tokens are too few for batch_size {batch_size}: each stream "
                f"needs an input and a target, so at least {batch_size + 1} tokens"
            )
        if drop_last and n < block_size:
            raise ShortDataError(
                f"streams of {n} tokens are shorter than block_size {block_size}, so "
                "drop_last=True leaves no block; lower batch_size or block_size"
            )
        self.batch_size = batch_size
        self.block_size = block_size
        self.drop_last = drop_last
        self.stream_len = n
        self._inputs = tokens[: batch_size * n].reshape(batch_size, n)
        self._targets = tokens[1 : batch_size * n + 1].reshape(batch_size, n)

    def __len__(self) -> int:
        if self.drop_last:
            return self.stream_len // self.block_size
        return math.ceil(self.stream_len / self.block_size)

    @property
    def num_chars(self) -> int:
        """Number of targets over all blocks (``batch_size * n`` unless ``drop_last``)."""
        covered = min(self.stream_len, len(self) * self.block_size)
        return self.batch_size * covered

    def block(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of block ``i``: int64 tensors of shape (batch_size, m)."""
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} out of range for {len(self)} blocks")
        start = i * self.block_size
        stop = min(start + self.block_size, self.stream_len)
        x = torch.from_numpy(self._inputs[:, start:stop].astype(np.int64))
        y = torch.from_numpy(self._targets[:, start:stop].astype(np.int64))
        return x, y

    def blocks(self, start: int = 0) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(i, x, y)`` for blocks ``start``, ``start + 1``, ... to the end."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        for i in range(start, len(self)):
            yield (i, *self.block(i))

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        return self.blocks()
