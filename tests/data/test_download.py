"""Tests for adaspan.data.download: the benchmark registry, cache, download and verification."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import os
import socket
import threading
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from adaspan.data import corpora as data
from adaspan.data import download
from adaspan.data.corpora import load_corpus
from adaspan.data.download import BENCHMARKS, Benchmark, DataError, download_benchmark, fetch

# ---------------------------------------------------------------------------- registry


def test_registry_holds_the_standard_benchmarks():
    assert set(BENCHMARKS) == {"enwik8", "text8"}
    for name, bench in BENCHMARKS.items():
        assert bench.name == bench.member == name
        assert bench.url == f"http://mattmahoney.net/dc/{name}.zip"
        assert bench.zip_name == f"{name}.zip"
        assert (bench.size, bench.train_size, bench.valid_size) == (10**8, 9 * 10**7, 5 * 10**6)
        assert bench.test_size == 5 * 10**6
    assert BENCHMARKS["enwik8"].sha256 == (  # of the unzipped files, as published
        "2b49720ec4d78c3c9fabaee6e4179a5e997302b3a70029f30f2d582218c024a8")
    assert BENCHMARKS["text8"].sha256 == (
        "6e890197040d37d85beb962ae1f041ff1d9a9ca8d20c7d99c85027eebf51dca7")
    assert BENCHMARKS["enwik8"].zip_size == 36_445_475
    assert BENCHMARKS["text8"].zip_size == 31_344_016


def test_benchmark_rejects_impossible_split():
    with pytest.raises(ValueError, match="at least 2 bytes"):
        Benchmark("b", "http://x/b.zip", 10, "b", 100, "0" * 64, 99, 1)


def test_download_benchmark_rejects_unknown_name():
    with pytest.raises(DataError, match="enwik8, text8"):
        download_benchmark("enwik9")


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("ADASPAN_DATA", str(tmp_path / "env"))
    assert download.data_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert download.data_dir() == tmp_path / "env"
    monkeypatch.delenv("ADASPAN_DATA")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert download.data_dir() == tmp_path / "home" / ".cache" / "adaspan"


# ---------------------------------------------------------------------------- fetch

MEMBER_SIZE = 20_000


class _Server:
    """A local HTTP server over a directory that counts the requests it gets."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[str] = []
        server = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        handler = functools.partial(Handler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def server(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    srv = _Server(root)
    yield srv
    srv.close()


@pytest.fixture(autouse=True)
def _short_timeout(monkeypatch):
    monkeypatch.setattr(download, "DOWNLOAD_TIMEOUT", 5.0)


@pytest.fixture
def member() -> bytes:
    return np.random.default_rng(0).integers(0, 256, MEMBER_SIZE, dtype=np.uint8).tobytes()


def _zip_bytes(name: str, payload: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(name, payload)
    return buffer.getvalue()


def _benchmark(url: str, packed: bytes, payload: bytes, **changes) -> Benchmark:
    fields = {
        "name": "tiny",
        "url": url,
        "zip_size": len(packed),
        "member": "tiny",
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
        "train_size": 18_000,
        "valid_size": 1_000,
    }
    return Benchmark(**(fields | changes))


@pytest.fixture
def hosted(server, member):
    """A served ``tiny.zip`` and the matching test benchmark."""
    packed = _zip_bytes("tiny", member)
    (server.root / "tiny.zip").write_bytes(packed)
    return _benchmark(f"{server.base}/tiny.zip", packed, member)


def _cache_files(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "tiny").iterdir())


def test_fetch_downloads_verifies_and_caches(server, hosted, member, tmp_path):
    cache = tmp_path / "cache"
    path = fetch(hosted, cache, progress=True)
    assert path == cache / "tiny" / "tiny"
    assert path.read_bytes() == member
    assert server.requests == ["/tiny.zip"]
    assert _cache_files(cache) == ["tiny", "tiny.verified"]

    (server.root / "tiny.zip").unlink()  # the cache must not need the server any more
    assert fetch(hosted, cache, progress=False) == path
    assert server.requests == ["/tiny.zip"]


def test_verification_is_remembered_until_the_file_changes(hosted, tmp_path):
    cache = tmp_path / "cache"
    path = fetch(hosted, cache, progress=False)
    stat = path.stat()
    path.write_bytes(b"\0" * MEMBER_SIZE)  # same size, forged back to the same mtime
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fetch(hosted, cache, progress=False) == path  # trusted: verified once before
    (cache / "tiny" / "tiny.verified").unlink()
    with pytest.raises(DataError, match="checksum mismatch"):
        fetch(hosted, cache, progress=False)


def test_checksum_mismatch_leaves_nothing_in_cache(server, hosted, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="checksum mismatch") as info:
        fetch(replace(hosted, sha256="ab" * 32), cache, progress=False)
    assert "ab" * 32 in str(info.value) and hosted.sha256 in str(info.value)
    assert _cache_files(cache) == []
    assert server.requests == ["/tiny.zip"]


def test_wrong_zip_size_or_member_size_is_rejected(hosted, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=f"expected {hosted.zip_size + 1}"):
        fetch(replace(hosted, zip_size=hosted.zip_size + 1), cache, progress=False)
    assert _cache_files(cache) == []
    with pytest.raises(DataError, match=f"expected {MEMBER_SIZE - 1}"):
        fetch(replace(hosted, size=MEMBER_SIZE - 1), cache, progress=False)
    assert _cache_files(cache) == []


def test_corrupt_download_is_not_cached(server, hosted, tmp_path):
    packed = bytearray((server.root / "tiny.zip").read_bytes())
    packed[100:110] = b"\xff" * 10  # damage the compressed data, keep the size
    (server.root / "tiny.zip").write_bytes(bytes(packed))
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"zip|checksum"):
        fetch(hosted, cache, progress=False)
    assert _cache_files(cache) == []


def test_server_down_names_the_path_to_fill_by_hand(hosted, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as info:
        fetch(hosted, cache, url=f"http://127.0.0.1:{port}/tiny.zip", progress=False)
    message = str(info.value)
    assert f"http://127.0.0.1:{port}/tiny.zip" in message
    assert str(cache / "tiny" / "tiny.zip") in message
    assert str(cache / "tiny" / "tiny") in message
    assert _cache_files(cache) == []


def test_http_error_becomes_data_error(server, hosted, tmp_path):
    with pytest.raises(DataError, match="404"):
        fetch(hosted, tmp_path / "cache", url=f"{server.base}/missing.zip", progress=False)


def test_files_placed_by_hand_are_used_without_network(server, hosted, member, tmp_path):
    cache = tmp_path / "cache"
    (cache / "tiny").mkdir(parents=True)
    (cache / "tiny" / "tiny.zip").write_bytes((server.root / "tiny.zip").read_bytes())
    assert fetch(hosted, cache, progress=False).read_bytes() == member
    assert (cache / "tiny" / "tiny.zip").exists()  # the user's file is left alone

    other = tmp_path / "other"
    (other / "tiny").mkdir(parents=True)
    (other / "tiny" / "tiny").write_bytes(member)
    assert fetch(hosted, other, progress=False) == other / "tiny" / "tiny"
    assert (other / "tiny" / "tiny.verified").exists()
    assert server.requests == []


def test_bad_file_placed_by_hand_is_reported(server, hosted, member, tmp_path):
    cache = tmp_path / "cache"
    (cache / "tiny").mkdir(parents=True)
    (cache / "tiny" / "tiny").write_bytes(member[:-1])
    with pytest.raises(DataError, match=f"expected {MEMBER_SIZE}"):
        fetch(hosted, cache, progress=False)
    (cache / "tiny" / "tiny").unlink()
    (cache / "tiny" / "tiny.zip").write_bytes(_zip_bytes("wrong-name", member))
    with pytest.raises(DataError, match="no member 'tiny'"):
        fetch(hosted, cache, progress=False)
    assert server.requests == []


def test_data_dir_and_mirror_environment_variables(server, hosted, member, monkeypatch, tmp_path):
    monkeypatch.setenv("ADASPAN_DATA", str(tmp_path / "env-cache"))
    monkeypatch.setenv("ADASPAN_MIRROR", server.base + "/")
    offline = replace(hosted, url="http://127.0.0.1:9/unreachable/tiny.zip")
    path = fetch(offline, progress=False)
    assert path == tmp_path / "env-cache" / "tiny" / "tiny"
    assert path.read_bytes() == member
    assert server.requests == ["/tiny.zip"]


def test_download_benchmark_uses_registry(monkeypatch, server, member, tmp_path):
    packed = _zip_bytes("tiny", member)
    (server.root / "tiny.zip").write_bytes(packed)
    monkeypatch.setitem(BENCHMARKS, "tiny", _benchmark(f"{server.base}/tiny.zip", packed, member))
    path = download_benchmark("tiny", tmp_path / "cache", progress=False)
    assert path.read_bytes() == member


# ---------------------------------------------------------------------------- load_corpus


def test_loaded_benchmark_is_memory_mapped_and_split(hosted, member, tmp_path):
    corpus = load_corpus(hosted, data_dir=tmp_path / "cache", progress=False)
    assert corpus.name == "tiny"
    for split in data.SPLITS:
        assert isinstance(corpus.split(split), np.memmap)
        assert corpus.split(split).dtype == np.uint8
    assert (len(corpus.train), len(corpus.valid), len(corpus.test)) == (18_000, 1_000, 1_000)
    assert corpus.train.tobytes() + corpus.valid.tobytes() + corpus.test.tobytes() == member
    fractions = load_corpus(hosted, data_dir=tmp_path / "cache", split=(0.5, 0.25))
    assert (len(fractions.train), len(fractions.valid), len(fractions.test)) == (
        10_000,
        5_000,
        5_000,
    )
