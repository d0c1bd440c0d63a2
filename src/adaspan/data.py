"""Byte-level corpora and the block batching used to train on them.

Every corpus is raw bytes (vocabulary of 256), stored as 1-D ``numpy.uint8`` arrays.
Sources:

* ``"kjv"``: the King James Bible shipped inside the package (the default);
* ``"enwik8"`` / ``"text8"``: the Large Text Compression Benchmark files of Matt Mahoney,
  downloaded once, verified and cached (see :func:`data_dir`), then memory-mapped;
* any local file (plain, ``.gz`` or single-member ``.zip``) or a directory of split files.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import math
import os
import tempfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

VOCAB_SIZE = 256
DEFAULT_CORPUS = "kjv"
DEFAULT_SPLIT = (0.9, 0.05)
SPLITS = ("train", "valid", "test")
DATA_ENV = "ADASPAN_DATA"
MIRROR_ENV = "ADASPAN_MIRROR"
MAHONEY_URL = "http://mattmahoney.net/dc/"
DOWNLOAD_TIMEOUT = 60.0  # seconds without progress before a download is abandoned
MIN_SPLIT_BYTES = 2  # one input byte and its target
EMBEDDED = {"kjv": "kjv.txt.gz"}  # corpus name -> gzip file in the adaspan.corpus package data

_CHUNK = 1 << 20
_SPLIT_STEMS = {"train": ("train",), "valid": ("valid", "val"), "test": ("test",)}
_SPLIT_SUFFIXES = (".txt", "", ".gz", ".txt.gz")


class DataError(Exception):
    """A corpus cannot be found, fetched, verified or read; the message says what to do."""


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


@dataclass(frozen=True)
class Benchmark:
    """A zip-packaged benchmark corpus: where to get it and how to check and split it.

    ``sha256`` and ``size`` describe the unzipped ``member``; the first ``train_size`` bytes
    are train, the next ``valid_size`` valid and the rest test.
    """

    name: str
    url: str
    zip_size: int
    member: str
    size: int
    sha256: str
    train_size: int
    valid_size: int

    def __post_init__(self) -> None:
        if min(self.train_size, self.valid_size, self.test_size) < MIN_SPLIT_BYTES:
            raise ValueError(
                f"benchmark {self.name!r}: train_size {self.train_size} and valid_size "
                f"{self.valid_size} must leave at least {MIN_SPLIT_BYTES} bytes for every "
                f"split of its {self.size} bytes"
            )

    @property
    def test_size(self) -> int:
        return self.size - self.train_size - self.valid_size

    @property
    def zip_name(self) -> str:
        return self.url.rsplit("/", 1)[-1]


# Sizes and checksums of http://mattmahoney.net/dc/{enwik8,text8}.zip and their members.
# enwik8: md5 a1fa5ffddb56f4953e226637dabbb36a is the one published with the Hutter Prize.
# text8: md5 3bea1919949baf155f99411df5fada7e is the one published for the unzipped text8.
BENCHMARKS: dict[str, Benchmark] = {
    "enwik8": Benchmark(
        name="enwik8",
        url=MAHONEY_URL + "enwik8.zip",
        zip_size=36_445_475,
        member="enwik8",
        size=100_000_000,
        sha256="2b49720ec4d78c3c9fabaee6e4179a5e997302b3a70029f30f2d582218c024a8",
        train_size=90_000_000,
        valid_size=5_000_000,
    ),
    "text8": Benchmark(
        name="text8",
        url=MAHONEY_URL + "text8.zip",
        zip_size=31_344_016,
        member="text8",
        size=100_000_000,
        sha256="6e890197040d37d85beb962ae1f041ff1d9a9ca8d20c7d99c85027eebf51dca7",
        train_size=90_000_000,
        valid_size=5_000_000,
    ),
}


def data_dir(explicit: str | Path | None = None) -> Path:
    """Benchmark cache root: ``explicit``, else ``$ADASPAN_DATA``, else ``~/.cache/adaspan``."""
    if explicit is None:
        explicit = os.environ.get(DATA_ENV) or Path.home() / ".cache" / "adaspan"
    return Path(explicit).expanduser()


_data_dir = data_dir  # for functions whose ``data_dir`` parameter shadows the function


def download_benchmark(
    name: str, data_dir: str | Path | None = None, *, url: str | None = None, progress: bool = True
) -> Path:
    """Path of the verified, unzipped benchmark ``name`` ("enwik8", "text8"); see :func:`fetch`."""
    if name not in BENCHMARKS:
        raise DataError(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
    return fetch(BENCHMARKS[name], data_dir, url=url, progress=progress)


def fetch(
    benchmark: Benchmark,
    data_dir: str | Path | None = None,
    *,
    url: str | None = None,
    progress: bool = True,
) -> Path:
    """Make ``<data_dir>/<name>/<member>`` exist and be verified, and return its path.

    Uses, in order: the member already there (its checksum is verified once, then remembered
    in ``<member>.verified``); a zip placed there by hand; a download from ``url``, else
    ``$ADASPAN_MIRROR/<zip>``, else ``benchmark.url``. Downloads and extraction go through
    temporary ``.part`` files that are removed on failure, so the cache is never left corrupt.
    """
    folder = _data_dir(data_dir) / benchmark.name
    target = folder / benchmark.member
    if target.exists():
        _check_cached(target, benchmark)
        return target
    folder.mkdir(parents=True, exist_ok=True)
    local_zip = folder / benchmark.zip_name
    if local_zip.exists():
        _install(local_zip, benchmark, target)
        return target
    source = _source_url(benchmark, url)
    download = _temp_path(folder, benchmark.zip_name)
    try:
        _download(source, download, benchmark, local_zip, progress)
        _install(download, benchmark, target)
    finally:
        download.unlink(missing_ok=True)
    return target


def _source_url(benchmark: Benchmark, url: str | None) -> str:
    if url:
        return url
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        return f"{mirror.rstrip('/')}/{benchmark.zip_name}"
    return benchmark.url


def _temp_path(folder: Path, name: str) -> Path:
    handle, path = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".part")
    os.close(handle)
    return Path(path)


def _download(url: str, dest: Path, benchmark: Benchmark, by_hand: Path, progress: bool) -> None:
    try:
        with (
            urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as response,
            dest.open("wb") as out,
            tqdm(
                total=int(response.headers.get("Content-Length") or benchmark.zip_size),
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"downloading {benchmark.zip_name}",
                disable=None if progress else True,
            ) as bar,
        ):
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                bar.update(len(chunk))
    except (OSError, http.client.HTTPException) as exc:
        raise DataError(
            f"could not download {benchmark.name} from {url}: {exc}.\n"
            f"Download it by other means and save it as {by_hand} "
            f"(or save the unzipped file as {by_hand.with_name(benchmark.member)}), "
            "then run again."
        ) from exc
    size = dest.stat().st_size
    if size != benchmark.zip_size:
        raise DataError(
            f"download of {url} is {size} bytes, expected {benchmark.zip_size} "
            "(interrupted transfer or wrong file); run again to retry"
        )


def _install(archive: Path, benchmark: Benchmark, target: Path) -> None:
    """Extract and verify ``benchmark.member`` from ``archive``, then move it to ``target``."""
    part = _temp_path(target.parent, benchmark.member)
    try:
        digest = _extract(archive, benchmark, part)
        _check_digest(digest, benchmark, archive)
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
    _mark_verified(target, benchmark)


def _extract(archive: Path, benchmark: Benchmark, dest: Path) -> str:
    """Copy the member to ``dest``, checking its size; return its SHA-256."""
    digest = hashlib.sha256()
    written = 0
    try:
        with zipfile.ZipFile(archive) as zipped:
            if benchmark.member not in zipped.namelist():
                raise DataError(
                    f"{archive} has no member {benchmark.member!r} "
                    f"(it holds {', '.join(zipped.namelist()) or 'nothing'})"
                )
            with zipped.open(benchmark.member) as src, dest.open("wb") as out:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        raise DataError(
            f"{archive} is not a readable zip archive ({exc}); delete it and run again"
        ) from exc
    if written != benchmark.size:
        raise DataError(
            f"{benchmark.member} in {archive} is {written} bytes, expected {benchmark.size}"
        )
    return digest.hexdigest()


def _check_digest(actual: str, benchmark: Benchmark, source: Path) -> None:
    if actual != benchmark.sha256:
        raise DataError(
            f"checksum mismatch for {benchmark.member} from {source}: "
            f"expected sha256 {benchmark.sha256}, got {actual}; delete it and run again"
        )


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _stamp(target: Path, benchmark: Benchmark) -> str:
    stat = target.stat()
    return f"{benchmark.sha256} {stat.st_size} {stat.st_mtime_ns}\n"


def _mark_verified(target: Path, benchmark: Benchmark) -> None:
    _marker(target).write_text(_stamp(target, benchmark))


def _check_cached(target: Path, benchmark: Benchmark) -> None:
    size = target.stat().st_size
    if size != benchmark.size:
        raise DataError(
            f"{target} is {size} bytes, expected {benchmark.size}; delete it and run again"
        )
    marker = _marker(target)
    if marker.is_file() and marker.read_text() == _stamp(target, benchmark):
        return
    _check_digest(_sha256_file(target), benchmark, target)
    _mark_verified(target, benchmark)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


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
    path = Path(spec).expanduser()
    if path.is_dir():
        if split is not None:
            raise ValueError(f"split fractions do not apply to {path}: it holds its own splits")
        return _load_directory(path)
    if path.is_file():
        return _split_corpus(path.name, _read_file(path), split)
    names = ", ".join([*EMBEDDED, *BENCHMARKS])
    raise DataError(
        f"no corpus {str(spec)!r}: not a built-in corpus ({names}) "
        f"and no file or directory at {path.absolute()}"
    )


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
            raise ValueError(
                f"{len(tokens)} tokens are too few for batch_size {batch_size}: each stream "
                f"needs an input and a target, so at least {batch_size + 1} tokens"
            )
        if drop_last and n < block_size:
            raise ValueError(
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
