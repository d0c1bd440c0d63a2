"""Download and verification of the enwik8/text8 benchmarks.

The Large Text Compression Benchmark files of Matt Mahoney are downloaded once (or taken from
a zip or file put in place by hand), checked against their published size and SHA-256, and
cached under :func:`data_dir`.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..errors import UserError

DATA_ENV = "ADASPAN_DATA"
MIRROR_ENV = "ADASPAN_MIRROR"
MAHONEY_URL = "http://mattmahoney.net/dc/"
DOWNLOAD_TIMEOUT = 60.0  # seconds without progress before a download is abandoned
MIN_SPLIT_BYTES = 2  # one input byte and its target

_CHUNK = 1 << 20


class DataError(UserError):
    """A corpus cannot be found, fetched, verified or read; the message says what to do."""


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


def _mahoney(name: str, zip_size: int, sha256: str) -> Benchmark:
    """A benchmark of mattmahoney.net: ``name``.zip holds ``name``, 10^8 bytes split 90M/5M/5M
    (train/valid/test), as in the paper and its predecessors."""
    return Benchmark(name=name, url=f"{MAHONEY_URL}{name}.zip", zip_size=zip_size, member=name,
                     size=100_000_000, sha256=sha256, train_size=90_000_000,
                     valid_size=5_000_000)


# Sizes and checksums of http://mattmahoney.net/dc/{enwik8,text8}.zip and their members.
# enwik8: md5 a1fa5ffddb56f4953e226637dabbb36a is the one published with the Hutter Prize.
# text8: md5 3bea1919949baf155f99411df5fada7e is the one published for the unzipped text8.
BENCHMARKS: dict[str, Benchmark] = {
    "enwik8": _mahoney("enwik8", 36_445_475,
                       "2b49720ec4d78c3c9fabaee6e4179a5e997302b3a70029f30f2d582218c024a8"),
    "text8": _mahoney("text8", 31_344_016,
                      "6e890197040d37d85beb962ae1f041ff1d9a9ca8d20c7d99c85027eebf51dca7"),
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
