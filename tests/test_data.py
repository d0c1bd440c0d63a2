"""Tests for adaspan.data: encoding, corpus loading, benchmark download/cache, batching."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import io
import os
import socket
import threading
import zipfile
from dataclasses import replace
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch

from adaspan import data
from adaspan.data import (
    BENCHMARKS,
    VOCAB_SIZE,
    Benchmark,
    BlockStream,
    Corpus,
    DataError,
    decode,
    download_benchmark,
    encode,
    fetch,
    load_corpus,
)

# ---------------------------------------------------------------------------- encode/decode


def test_encode_decode_roundtrip_non_ascii():
    text = "In the beginning — Ἐν ἀρχῇ, 太初 🌍\n\t\x00"
    tokens = encode(text)
    assert tokens.dtype == np.uint8
    assert tokens.tolist() == list(text.encode("utf-8"))
    assert decode(tokens) == text
    assert decode(tokens.tolist()) == text
    assert decode(torch.from_numpy(tokens.astype(np.int64))) == text


def test_decode_replaces_invalid_utf8_and_rejects_non_bytes():
    assert decode([0x61, 0xFF, 0x62]) == "a\ufffdb"
    with pytest.raises(ValueError, match="bytes"):
        decode([65, 256])
    with pytest.raises(ValueError, match="bytes"):
        decode(torch.tensor([-1]))


# ---------------------------------------------------------------------------- embedded corpus


def test_embedded_kjv_is_split_90_5_5_contiguously():
    packed = resources.files("adaspan").joinpath("corpus", "kjv.txt.gz").read_bytes()
    full = gzip.decompress(packed)
    corpus = load_corpus()
    assert corpus.name == "kjv" == data.DEFAULT_CORPUS
    assert corpus.vocab_size == VOCAB_SIZE == 256
    n = len(full)
    assert len(corpus.train) == round(0.9 * n)
    assert len(corpus.valid) == round(0.05 * n)
    assert len(corpus.train) + len(corpus.valid) + len(corpus.test) == n
    joined = np.concatenate([corpus.train, corpus.valid, corpus.test])
    assert joined.dtype == np.uint8
    assert joined.tobytes() == full
    assert decode(corpus.train[:7]) == full[:7].decode()
    summary = corpus.summary()
    assert summary == {
        "name": "kjv",
        "vocab_size": 256,
        "train": len(corpus.train),
        "valid": len(corpus.valid),
        "test": len(corpus.test),
        "total": n,
    }


def test_corpus_split_accessor():
    corpus = Corpus("c", encode("abcd"), encode("ef"), encode("gh"))
    assert decode(corpus.split("valid")) == "ef"
    assert corpus.split("test") is corpus.test
    with pytest.raises(ValueError, match="train, valid, test"):
        corpus.split("validation")


# ---------------------------------------------------------------------------- local corpora

TEXT = ("Ça commence ici. " * 40).encode("utf-8")  # 720 bytes, non-ASCII included


def _assert_default_split(corpus: Corpus, payload: bytes) -> None:
    n = len(payload)
    assert [len(corpus.train), len(corpus.valid)] == [round(0.9 * n), round(0.05 * n)]
    assert (corpus.train.tobytes() + corpus.valid.tobytes() + corpus.test.tobytes()) == payload


def test_load_plain_file_is_memory_mapped(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(TEXT)
    corpus = load_corpus(path)
    assert corpus.name == "book.txt"
    assert isinstance(corpus.train, np.memmap)
    _assert_default_split(corpus, TEXT)


def test_load_gzip_and_zip_files(tmp_path):
    gz = tmp_path / "book.txt.gz"
    gz.write_bytes(gzip.compress(TEXT))
    _assert_default_split(load_corpus(str(gz)), TEXT)

    zipped = tmp_path / "book.zip"
    with zipfile.ZipFile(zipped, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("folder/", "")
        archive.writestr("folder/book.txt", TEXT)
    _assert_default_split(load_corpus(zipped), TEXT)


def test_custom_split_fractions(tmp_path):
    path = tmp_path / "digits.txt"
    payload = bytes(range(100))
    path.write_bytes(payload)
    corpus = load_corpus(path, split=(0.5, 0.3))
    assert corpus.train.tolist() == list(range(50))
    assert corpus.valid.tolist() == list(range(50, 80))
    assert corpus.test.tolist() == list(range(80, 100))
    for bad in [(0.9, 0.1), (0.0, 0.5), (0.5, -0.1), (0.8,)]:
        with pytest.raises(ValueError, match="fractions"):
            load_corpus(path, split=bad)


def test_directory_layout_with_mixed_names_and_suffixes(tmp_path):
    (tmp_path / "train.txt").write_bytes(b"training text")
    (tmp_path / "val.gz").write_bytes(gzip.compress(b"valid text"))
    (tmp_path / "test").write_bytes(b"test text")
    corpus = load_corpus(tmp_path)
    assert corpus.name == tmp_path.name
    assert [decode(corpus.split(s)) for s in data.SPLITS] == [
        "training text",
        "valid text",
        "test text",
    ]
    with pytest.raises(ValueError, match="own splits"):
        load_corpus(tmp_path, split=(0.8, 0.1))


def test_directory_missing_or_ambiguous_split_file(tmp_path):
    (tmp_path / "train.txt").write_bytes(b"training text")
    (tmp_path / "test.txt").write_bytes(b"test text")
    with pytest.raises(DataError, match="no valid file") as info:
        load_corpus(tmp_path)
    assert "valid.txt" in str(info.value) and "val.txt" in str(info.value)
    (tmp_path / "valid.txt").write_bytes(b"valid")
    (tmp_path / "valid").write_bytes(b"valid")
    with pytest.raises(DataError, match="several valid files"):
        load_corpus(tmp_path)


def test_directory_split_too_short(tmp_path):
    (tmp_path / "train.txt").write_bytes(b"training text")
    (tmp_path / "valid.txt").write_bytes(b"v")
    (tmp_path / "test.txt").write_bytes(b"test text")
    with pytest.raises(DataError, match="at least 2 bytes"):
        load_corpus(tmp_path)


def test_missing_path_and_unknown_name(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError) as info:
        load_corpus(missing)
    assert str(missing) in str(info.value)
    with pytest.raises(DataError) as info:
        load_corpus("enwik9")
    message = str(info.value)
    assert all(name in message for name in ("kjv", "enwik8", "text8"))
    with pytest.raises(DataError, match="enwik8, text8"):
        download_benchmark("enwik9")


def test_empty_and_tiny_corpora(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="empty"):
        load_corpus(empty)
    empty_gz = tmp_path / "empty.gz"
    empty_gz.write_bytes(gzip.compress(b""))
    with pytest.raises(DataError, match="empty"):
        load_corpus(empty_gz)
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"0123456789")  # 9/0/1 bytes: valid and test too short
    with pytest.raises(DataError, match="too few") as info:
        load_corpus(tiny)
    assert "valid 0" in str(info.value) and "test 1" in str(info.value)


def test_corrupt_gzip_and_zip_files(tmp_path):
    bad_gz = tmp_path / "bad.gz"
    bad_gz.write_bytes(b"this is not gzip data")
    with pytest.raises(DataError, match="gzip"):
        load_corpus(bad_gz)
    truncated = tmp_path / "truncated.gz"
    truncated.write_bytes(gzip.compress(TEXT)[:-30])
    with pytest.raises(DataError, match="gzip"):
        load_corpus(truncated)
    bad_zip = tmp_path / "bad.zip"
    bad_zip.write_bytes(b"PK this is not a zip")
    with pytest.raises(DataError, match="zip"):
        load_corpus(bad_zip)


def test_zip_with_several_members_is_rejected(tmp_path):
    path = tmp_path / "two.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("a.txt", TEXT)
        archive.writestr("b.txt", TEXT)
    with pytest.raises(DataError, match="exactly one file") as info:
        load_corpus(path)
    assert "a.txt" in str(info.value) and "b.txt" in str(info.value)


# ---------------------------------------------------------------------------- BlockStream


@pytest.mark.parametrize(
    ("length", "batch", "block"),
    [(101, 4, 5), (100, 4, 5), (1000, 3, 7), (50, 1, 49), (50, 1, 100), (37, 6, 1)],
)
def test_block_stream_exact_positions_and_full_coverage(length, batch, block):
    tokens = (np.arange(length) % 256).astype(np.uint8)
    stream = BlockStream(tokens, batch, block)
    n = (length - 1) // batch
    assert stream.stream_len == n
    assert len(stream) == -(-n // block)
    assert stream.num_chars == batch * n
    seen = np.zeros(length, dtype=int)
    for i, x, y in stream:
        assert x.dtype == y.dtype == torch.int64
        m = x.shape[1]
        assert x.shape == y.shape == (batch, m)
        assert m == (block if i < len(stream) - 1 else n - block * (len(stream) - 1))
        for b in range(batch):
            pos = b * n + i * block + np.arange(m)
            assert x[b].tolist() == tokens[pos].tolist()
            assert y[b].tolist() == tokens[pos + 1].tolist()
            seen[pos + 1] += 1
    # Every target character of the streams is predicted exactly once.
    assert seen[1 : batch * n + 1].tolist() == [1] * (batch * n)
    assert seen.sum() == stream.num_chars


def test_block_stream_last_short_block_and_drop_last():
    tokens = np.arange(23, dtype=np.uint8)  # batch 2 -> n = 11 -> blocks of 4, 4, 3
    stream = BlockStream(tokens, 2, 4)
    assert len(stream) == 3
    x, y = stream.block(2)
    assert x.tolist() == [[8, 9, 10], [19, 20, 21]]
    assert y.tolist() == [[9, 10, 11], [20, 21, 22]]
    dropped = BlockStream(tokens, 2, 4, drop_last=True)
    assert len(dropped) == 2
    assert dropped.num_chars == 2 * 8
    assert [x.shape[1] for _, x, _ in dropped] == [4, 4]
    with pytest.raises(IndexError):
        dropped.block(2)


def test_block_stream_resumes_from_start_index():
    stream = BlockStream(np.arange(200, dtype=np.uint8), 3, 10)
    all_blocks = list(stream.blocks())
    resumed = list(stream.blocks(start=4))
    assert [i for i, _, _ in resumed] == list(range(4, len(stream)))
    for (i, x, y), (j, x2, y2) in zip(all_blocks[4:], resumed, strict=True):
        assert i == j and torch.equal(x, x2) and torch.equal(y, y2)
    _, y0 = stream.block(0)
    x1, _ = stream.block(1)
    # Block i+1 continues each row where block i stopped: its first input is the last target.
    assert torch.equal(x1[:, 0], y0[:, -1])
    with pytest.raises(ValueError, match="start"):
        next(stream.blocks(start=-1))


def test_block_stream_reads_memmap_without_copying_it(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(bytes(range(256)) * 4)
    tokens = np.memmap(path, dtype=np.uint8, mode="r")
    stream = BlockStream(tokens, 4, 16)
    assert np.shares_memory(stream._inputs, tokens)
    assert stream.block(0)[0][1, 0].item() == (1 * 255) % 256


def test_block_stream_validation_messages():
    tokens = np.arange(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BlockStream(tokens, 0, 4)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockStream(tokens, 2, 0)
    with pytest.raises(ValueError, match="at least 11 tokens"):
        BlockStream(tokens, 10, 4)
    with pytest.raises(ValueError, match="1-D integer"):
        BlockStream(np.zeros((2, 5), dtype=np.uint8), 1, 1)
    with pytest.raises(ValueError, match="drop_last"):
        BlockStream(tokens, 3, 4, drop_last=True)  # n = 3 < block 4


# ---------------------------------------------------------------------------- benchmarks


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


def test_data_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("ADASPAN_DATA", str(tmp_path / "env"))
    assert data.data_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert data.data_dir() == tmp_path / "env"
    monkeypatch.delenv("ADASPAN_DATA")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data.data_dir() == tmp_path / "home" / ".cache" / "adaspan"


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
    monkeypatch.setattr(data, "DOWNLOAD_TIMEOUT", 5.0)


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
