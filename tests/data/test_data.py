"""Tests for adaspan.data.corpora: encoding, corpus loading, splitting and batching."""

from __future__ import annotations

import gzip
import zipfile
from importlib import resources

import numpy as np
import pytest
import torch

from adaspan.data import corpora as data
from adaspan.data.corpora import (
    VOCAB_SIZE,
    BlockStream,
    Corpus,
    DataError,
    ShortDataError,
    decode,
    encode,
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
    """Arguments out of range are ValueErrors; data too short for the streams asked of it is
    also a DataError (the user's to fix: a smaller batch or block)."""
    tokens = np.arange(10, dtype=np.uint8)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        BlockStream(tokens, 0, 4)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        BlockStream(tokens, 2, 0)
    with pytest.raises(ShortDataError, match="at least 11 tokens"):
        BlockStream(tokens, 10, 4)
    with pytest.raises(ValueError, match="1-D integer"):
        BlockStream(np.zeros((2, 5), dtype=np.uint8), 1, 1)
    with pytest.raises(ShortDataError, match="drop_last"):
        BlockStream(tokens, 3, 4, drop_last=True)  # n = 3 < block 4
