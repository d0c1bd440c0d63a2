"""Tokenizers: exact round trips and byte offsets, vocabularies, files, errors and the cache."""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter

import numpy as np
import pytest
import tokenizers as hf

from adaspan.data import tokenizer as tk
from adaspan.data.corpora import load_corpus
from adaspan.data.tokenizer import (
    EOS,
    UNK,
    BPETokenizer,
    ByteTokenizer,
    TokenizerError,
    WordTokenizer,
    build,
    load,
    tokenize_splits,
)

ODD = [  # texts every tokenizer must survive
    b"",
    b"no final newline",
    "h\u00e9llo \u20ac \u65e5\u672c \U0001f389 caf\u00e9\n".encode(),
    b"\xff\xfe not utf-8 \xc3\n\xe2\x82 cut \xf0\x9f\n\x80",
    b"  lead  and\ttabs \r\nblank\n\n\n  \n trailing   ",
    "nbsp\u00a0and\u2028line sep\x1cfs\x85nel\n".encode(),
]


@pytest.fixture(scope="module")
def text() -> np.ndarray:
    return load_corpus("kjv", progress=False).train[:200_000]


@pytest.fixture(scope="module")
def words(text) -> WordTokenizer:
    return build("words", text, min_count=3)


@pytest.fixture(scope="module")
def bpe(text) -> BPETokenizer:
    return build("bpe", text, vocab_size=600)


def byte_lengths(ends: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0], ends]))


def assert_ends(encoded: tk.Encoded, data: bytes) -> None:
    assert encoded.ends.dtype == np.int64 and len(encoded.ends) == len(encoded.ids)
    assert (byte_lengths(encoded.ends) >= 0).all()
    assert int(byte_lengths(encoded.ends).sum()) == len(data)


def one_line_error(match: str):
    """pytest.raises(TokenizerError) whose message must also fit on one line."""

    class Check:
        def __enter__(self):
            self.raises = pytest.raises(TokenizerError, match=match)
            self.info = self.raises.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.raises.__exit__(*exc)
            assert "\n" not in str(self.info.value)
            return handled

    return Check()


def test_bytes_is_the_text_itself(text):
    tokenizer = build("bytes", text)
    encoded = tokenizer.encode(text)
    assert encoded.ids is text and encoded.ends is None and tokenizer.vocab_size == 256
    for data in ODD:
        ids = tokenizer.encode(data).ids
        assert ids.dtype == np.uint8 and tokenizer.decode(ids) == data
        assert b"".join(tokenizer.pieces(ids)) == data
    assert tokenizer.token_text(32) == "␣" and tokenizer.token_text(10) == "\\n"
    assert tokenize_splits({"train": text}, tokenizer, None, False)["train"].ids is text
    with one_line_error("outside"):
        tokenizer.decode([300])


def test_bpe_round_trips_every_byte_exactly(bpe, text):
    assert bpe.vocab_size == 600 and bpe.unit == "token"
    for data in [*ODD, text.tobytes()[:20_000], bytes(range(256)) * 2]:
        encoded = bpe.encode(data)
        assert encoded.ids.dtype == np.int32
        assert bpe.decode(encoded.ids) == data
        pieces = list(bpe.pieces(encoded.ids))
        assert b"".join(pieces) == data
        assert_ends(encoded, data)
        assert byte_lengths(encoded.ends).tolist() == [len(piece) for piece in pieces]
    assert len(bpe.encode(text).ids) < len(text) / 2  # it did learn merges


def test_bpe_uses_the_fast_batch_and_real_merges(bpe):
    ids = bpe.encode(b" the LORD said unto Moses,\n").ids
    assert [bpe.token_text(int(i)) for i in ids][:2] == ["␣the", "␣LORD"]


def random_texts(count: int, seed: int = 0) -> list[bytes]:
    """Texts of known and unseen words, odd whitespace, and bytes that are not UTF-8."""
    rng = np.random.default_rng(seed)
    parts = [b"the", b"LORD", b"said", b"zyzzyva", b"\xff", b"\xc3", "\u00e9".encode(), b"<eos>",
             b"<unk>", b"<0x41>", b" ", b"  ", b"\t", b"\n", b"\r\n", "\u00a0".encode(),
             "\u3000".encode(), b"\x0b", b"\x1c", b"\x85"]
    return [b"".join(parts[i] for i in rng.integers(0, len(parts), rng.integers(0, 25)))
            for _ in range(count)]


def test_words_round_trip_any_text_exactly(words, text):
    data = text.tobytes()
    for sample in [data, *ODD, *random_texts(2000)]:
        encoded = words.encode(sample)
        assert words.decode(encoded.ids) == sample == words.normalize(sample)
        assert [len(piece) for piece in words.pieces(encoded.ids)] == \
            byte_lengths(encoded.ends).tolist()
        if sample:
            assert_ends(encoded, sample)
            assert (byte_lengths(encoded.ends) > 0).all()  # every token holds bytes


def test_words_spell_what_the_vocabulary_lacks(words):
    data = b"  And   the\tLORD  \n\nzyzzyva said <eos> unto \nhim"
    encoded = words.encode(data)
    assert [words.token_text(int(i)) for i in encoded.ids] == [
        "␣", "␣", "And", "␣", "␣", "␣", "the", "\\t", "LORD", "␣", "␣", EOS, EOS,
        "z", "y", "z", "z", "y", "v", "a", "␣", "said", "␣", "<", "e", "o", "s", ">", "␣",
        "unto", "␣", EOS, "him"]
    # a word holds the single space before it after a word; <eos> its newline
    assert encoded.ends.tolist() == [1, 2, 5, 6, 7, 8, 11, 12, 16, 17, 18, 19, 20, 21, 22, 23,
                                     24, 25, 26, 27, 28, 32, 33, 34, 35, 36, 37, 38, 39, 43, 44,
                                     45, 48]
    assert words.unk_id is None and len(words.fallback_ids) == 256


def legacy_words(symbols: list[str], tmp_path) -> WordTokenizer:
    """A words tokenizer as adaspan 0.8 saved it (every unknown word <unk>)."""
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"adaspan_tokenizer": "words", "version": 1, "min_count": 3,
                                "max_size": None, "symbols": symbols}))
    return load(path)


def test_old_words_files_behave_as_before(tmp_path):
    old = legacy_words(["the", "And", "LORD", EOS, "said", "unto", "him", UNK], tmp_path)
    data = b"  And   the\tLORD  \n\nzyzzyva said <eos> unto \nhim"
    assert old.normalize(data) == b"And the LORD\n\n<unk> said\nunto\nhim\n"
    encoded = old.encode(data)
    assert [old.token_text(int(i)) for i in encoded.ids] == [
        "And", "the", "LORD", EOS, EOS, UNK, "said", EOS, "unto", EOS, "him", EOS]
    # a word holds the whitespace before it; <eos> the rest of its line and the newline
    assert encoded.ends.tolist() == [5, 11, 16, 19, 20, 27, 32, 38, 43, 45, 48, 48]
    assert old.unk_id == 7 and not len(old.fallback_ids)
    for sample in ODD:
        assert old.decode(old.encode(sample).ids) == old.normalize(sample)


def test_words_vocabulary_is_by_use_then_first_appearance(text, words):
    data = text.tobytes()
    counts = Counter(data.decode().split())
    kept = [symbol for symbol in words.symbols if symbol not in tk.BYTE_SYMBOLS and symbol != EOS]
    assert set(kept) == {word for word, count in counts.items() if count >= 3}
    uses = np.bincount(words.encode(data).ids, minlength=words.vocab_size)
    assert (np.diff(uses) <= 0).all()  # ids by use in the training text
    small = build("words", b"y z y x z y\nx w\n", min_count=1)
    assert small.symbols[:5] == ["y", EOS, "z", "x", "w"] and small.vocab_size == 261
    capped = build("words", b"y z y x z y\nx w\n", min_count=1, vocab_size=259)
    # x and w spelled: the space before a spelled word and after it is a byte token too
    assert capped.symbols[:6] == ["<0x20>", "y", EOS, "<0x78>", "z", "<0x77>"]
    assert capped.decode(capped.encode(b"w y x\n").ids) == b"w y x\n"


def test_chunks_do_not_change_the_tokens(words, bpe, text, monkeypatch):
    data = text.tobytes()[:30_000] + b"x" * 5000 + b" long line\n" + ODD[3] + ODD[4]
    whole = {tokenizer.name: tokenizer.encode(data) for tokenizer in (words, bpe)}
    monkeypatch.setattr(tk, "CHUNK", 1000)
    chunks = list(tk._line_chunks(np.frombuffer(data, np.uint8)))
    assert len(chunks) > 30 and b"".join(chunk for _, chunk in chunks) == data
    assert all(chunk.endswith(b"\n") for _, chunk in chunks[:-1])
    for tokenizer in (words, bpe):
        encoded = tokenizer.encode(data)
        assert np.array_equal(encoded.ids, whole[tokenizer.name].ids)
        assert np.array_equal(encoded.ends, whole[tokenizer.name].ends)


def test_save_and_load_give_the_same_tokens(words, bpe, text, tmp_path):
    sample = text[:20_000]
    for tokenizer in (ByteTokenizer(), words, bpe):
        path = tmp_path / f"{tokenizer.name}.json"
        tokenizer.save(path)
        assert json.loads(path.read_text())["adaspan_tokenizer"] == tokenizer.name
        again = load(path)
        assert type(again) is type(tokenizer) and again.fingerprint == tokenizer.fingerprint
        assert np.array_equal(again.encode(sample).ids, tokenizer.encode(sample).ids)
    assert len({ByteTokenizer().fingerprint, words.fingerprint, bpe.fingerprint}) == 3


def hf_bpe(text: np.ndarray, size: int) -> hf.Tokenizer:
    model = hf.Tokenizer(hf.models.BPE())
    model.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = hf.decoders.ByteLevel()
    trainer = hf.trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                     initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(text.tobytes().decode().splitlines(keepends=True), trainer)
    return model


def test_a_users_tokenizer_json_is_used(text, tmp_path):
    model = hf_bpe(text[:50_000], 300)
    path = tmp_path / "tokenizer.json"
    model.save(str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokenizer = build("bpe", text, vocab_size=4096, file=str(path))
    sample = text[:5000].tobytes()
    assert tokenizer.vocab_size == 300
    assert tokenizer.encode(sample).ids.tolist() == model.encode(sample.decode()).ids
    assert load(path).fingerprint == tokenizer.fingerprint


def test_a_tokenizer_that_loses_text_warns_but_counts_every_byte(text, tmp_path):
    model = hf.Tokenizer(hf.models.WordLevel({"[UNK]": 0, "the": 1, "and": 2}, "[UNK]"))
    model.pre_tokenizer = hf.pre_tokenizers.Whitespace()
    path = tmp_path / "words.json"
    model.save(str(path))
    with pytest.warns(UserWarning, match="does not reproduce"):
        tokenizer = build("bpe", text, file=path)
    data = text[:10_000].tobytes() + ODD[3] + b"\n \t \n"  # the last lines give no token
    encoded = tokenizer.encode(data)
    assert_ends(encoded, data)
    words = re.findall(r"\w+|[^\w\s]+", data.decode(errors="replace"))  # as Whitespace splits
    assert encoded.ids.tolist().count(1) == words.count("the") > 10


@pytest.mark.parametrize(("call", "match"), [
    (lambda: build("bpf", b"a b"), "unknown tokenizer 'bpf'; did you mean 'bpe'"),
    (lambda: build("words", b"x" * 10_000), "no whitespace .*use bytes or bpe"),
    (lambda: build("words", b"a\nb\nc\n", min_count=1), "no whitespace"),
    (lambda: build("words", b""), "empty"),
    (lambda: build("words", b"a b a b c\n", min_count=2, vocab_size=300),
     r"only 2 distinct words \(min_count=2\); ask for at most 259"),
    (lambda: build("words", b"a b a b c\n", vocab_size=256), ">= 257"),
    (lambda: build("bpe", b"abc abd\n", vocab_size=1000), "yields only 2.. BPE tokens"),
    (lambda: build("bpe", b"abc abd\n", vocab_size=100), ">= 256"),
    (lambda: ByteTokenizer().encode(np.zeros(3, np.int64)), "1-D uint8"),
])
def test_user_errors_are_one_line(call, match):
    with one_line_error(match):
        call()


@pytest.mark.parametrize(("content", "match"), [
    (None, "cannot read"),
    ("{not json", "cannot read"),
    ('{"adaspan_tokenizer": "sentencepiece"}', "not a tokenizer file"),
    ("[1, 2]", "not a tokenizer file"),
    ('{"adaspan_tokenizer": "words", "symbols": ["a"], "min_count": 1, "max_size": null}',
     "not a valid words tokenizer"),
    ('{"adaspan_tokenizer": "bpe", "hf": {"model": 3}}', "not a valid bpe tokenizer"),
    ('{"model": {"type": "BPE", "vocab": 7}}', "not a Hugging Face tokenizer.json"),
])
def test_bad_tokenizer_files_are_one_line_errors(tmp_path, content, match):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_text(content)
    with one_line_error(match) as info:
        load(path)
    assert str(path) in str(info.value)
    with one_line_error(match):
        build("bpe", b"a b\n", file=path)


def test_a_file_of_another_kind_is_refused(words, tmp_path):
    words.save(tmp_path / "words.json")
    with one_line_error("words.json holds a words tokenizer, not bpe"):
        build("bpe", b"a b\n", file=tmp_path / "words.json")
    assert build("words", b"", file=tmp_path / "words.json").symbols == words.symbols


def cached(folder_root, tokenizer, data):
    return tokenize_splits({"train": data}, tokenizer, folder_root, progress=False)["train"]


def test_the_cache_is_read_back_and_keyed(words, bpe, text, tmp_path, monkeypatch):
    first = cached(tmp_path, words, text)
    (folder,) = (tmp_path / "tokens").iterdir()
    assert sorted(p.name for p in folder.iterdir()) == ["ends.npy", "ids.npy"]

    def fail(self, chunk):
        raise AssertionError("encoded again instead of read from the cache")

    with monkeypatch.context() as patch:
        patch.setattr(WordTokenizer, "_encode_chunk", fail)
        again = cached(tmp_path, words, text)
    assert isinstance(again.ids, np.memmap) and isinstance(again.ends, np.memmap)
    assert np.array_equal(again.ids, first.ids) and np.array_equal(again.ends, first.ends)
    cached(tmp_path, bpe, text)
    cached(tmp_path, words, text[:-1])
    assert len(list((tmp_path / "tokens").iterdir())) == 3
    assert {f.name for f in (tmp_path / "tokens").rglob("*") if f.is_file()} == {
        "ids.npy", "ends.npy"}  # no temporary file left


def test_progress_is_shown_in_bytes(words, text, capsys):
    tokenize_splits({"valid": text[:1000]}, words, None, progress=True)
    assert "tokenizing valid" in capsys.readouterr().err
    tokenize_splits({"valid": text[:1000]}, words, None, progress=False)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("damage", ["truncate", "remove", "garbage"])
def test_a_damaged_cache_entry_is_not_used(words, text, tmp_path, damage):
    first = [np.array(array) for array in cached(tmp_path, words, text)]  # not memory-mapped
    (folder,) = (tmp_path / "tokens").iterdir()
    ids = folder / "ids.npy"
    whole = ids.read_bytes()
    ids.unlink()
    if damage == "truncate":
        ids.write_bytes(whole[: len(whole) // 2])
    elif damage == "remove":
        (folder / "ends.npy").unlink()
    else:
        ids.write_bytes(b"not numpy")
    again = cached(tmp_path, words, text)
    assert np.array_equal(again.ids, first[0]) and np.array_equal(again.ends, first[1])
    assert np.array_equal(np.load(ids), first[0])  # and it was written again


def test_trained_tokenizers_are_cached(text, tmp_path, monkeypatch):
    first = build("words", text, min_count=2, cache_root=tmp_path)
    monkeypatch.setattr(WordTokenizer, "train", classmethod(lambda *a, **k: 1 / 0))
    assert build("words", text, min_count=2, cache_root=tmp_path).symbols == first.symbols
    with pytest.raises(ZeroDivisionError):
        build("words", text, min_count=3, cache_root=tmp_path)
    (path,) = (tmp_path / "tokenizers").iterdir()
    path.write_text("{damaged")
    with pytest.raises(ZeroDivisionError):  # a damaged file is learned again
        build("words", text, min_count=2, cache_root=tmp_path)
