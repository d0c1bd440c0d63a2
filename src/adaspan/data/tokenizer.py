"""Tokenizers: what one token of a model is (a byte, a word, a BPE token), by name.

:data:`TOKENIZERS` maps each name to its class (filled by :func:`register`); :func:`build` makes
one from a training text, :func:`load` reads one back from the ``tokenizer.json`` that
:meth:`Tokenizer.save` writes: ``{"adaspan_tokenizer": NAME, "version": 1, ...}`` (words: its
``symbols`` by id, version 2 with ``"byte_fallback": true``, version 1 the vocabularies with
``<unk>`` of adaspan 0.8 and earlier; bpe: Hugging Face's own serialisation under ``"hf"``);
:func:`load` also reads a plain Hugging Face ``tokenizer.json``.

:meth:`Tokenizer.encode` gives the ids of a text and, per token, the byte offset where it ends
in the text (:class:`Encoded`): every byte belongs to exactly one token, so scores per byte of
the original text stay exact whatever the tokenizer. :func:`tokenize_splits` caches the ids of
a corpus under ``<cache_root>/tokens/<key>/{ids,ends}.npy``; :func:`build` caches trained
tokenizers under ``<cache_root>/tokenizers/<key>.json``. Texts are UTF-8; bytes that are not
valid UTF-8 are kept exactly (words without byte fallback: as parts of words).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from itertools import chain
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import tokenizers as hf
from tqdm.auto import tqdm

from ..config import register_check, register_choices
from ..errors import UserError, one_line, require
from .files import atomic_write

EOS, UNK = "<eos>", "<unk>"  # end of line and unknown word (the authors' words convention)
BYTE_SYMBOLS = [f"<0x{b:02X}>" for b in range(256)]  # words' byte fallback, as SentencePiece
DEFAULT_MIN_COUNT = 3
DEFAULT_BPE_SIZE = 4096
DEFAULT_WORDS_SIZE = 8192
CHUNK = 1 << 20  # bytes of text encoded at a time, cut at a line end
SAMPLE = 1 << 16  # bytes of text a user's tokenizer file must reproduce, else a warning
_FORMAT = 2  # part of every cache key: bump when encoding changes
_SURROGATES = re.compile("([\udc80-\udcff]+)")  # invalid UTF-8 bytes, as surrogateescape
_SPACES = np.array([chr(c).isspace() for c in range(0x3002)])  # str.isspace; none above 0x3000
_VISIBLE = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
_extra = iter(range(256, 512))  # byte-level BPE's stand-in characters (GPT-2's): a visible
_BYTE_CHARS = [chr(b) if b in _VISIBLE else chr(next(_extra)) for b in range(256)]  # latin-1
_CHAR_BYTES = {c: b for b, c in enumerate(_BYTE_CHARS)}  # character is itself, others 256...
_SINGLE = [bytes([b]) for b in range(256)]


class TokenizerError(UserError, ValueError):
    """An unknown tokenizer, an unreadable tokenizer file, or a text it cannot be built on."""


class Encoded(NamedTuple):
    """Token ids of a text, and where each token ends in it: ``ends[i]`` is the byte offset just
    past token i (non-decreasing, ``ends[-1]`` = the text's length); None: one byte a token."""

    ids: np.ndarray
    ends: np.ndarray | None


TOKENIZERS: dict[str, type[Tokenizer]] = {}


def register(cls: type[Tokenizer]) -> type[Tokenizer]:
    """Class decorator: make ``cls`` known by ``cls.name``."""
    TOKENIZERS[cls.name] = cls
    return cls


def check_config(config: Any) -> None:
    """A ``TrainConfig``'s ``tokenizer_file`` is for a tokenizer that learns its vocabulary."""
    require("tokenizer_file", config.tokenizer_file,
            lambda v: v is None or TOKENIZERS[config.tokenizer].learned,
            f"None for tokenizer={config.tokenizer}, which learns nothing")


register_choices("tokenizer", TOKENIZERS.keys())
register_check("train", check_config)


class Tokenizer(ABC):
    """Text (bytes) to token ids and back."""

    name: ClassVar[str]
    unit: ClassVar[str]  # what one token is, for labels: "character" (a byte), "word" or "token"
    learned: ClassVar[bool] = True  # its vocabulary comes from a text (and its ids are cached)
    default_size: ClassVar[int]  # the vocabulary a run gets when it sets none for this tokenizer

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    def unk_id(self) -> int | None:
        """The id of ``<unk>``, where text outside the vocabulary becomes it (its bytes are
        then not scored one by one); None: the tokenizer keeps every byte."""
        return None

    @property
    def fallback_ids(self) -> np.ndarray:
        """Ids that spell text outside the vocabulary one byte a token (none: empty)."""
        return np.zeros(0, np.int32)

    def fits(self, model_vocab: int) -> bool:
        """Whether a model of ``model_vocab`` tokens is this tokenizer's: exactly its size."""
        return model_vocab == self.vocab_size

    @classmethod
    @abstractmethod
    def train(cls, text: bytes | np.ndarray, *, vocab_size: int | None, min_count: int,
              progress: bool = False) -> Tokenizer:
        """A tokenizer learned from ``text``."""

    @classmethod
    @abstractmethod
    def from_json(cls, spec: dict[str, Any]) -> Tokenizer:
        """The tokenizer that :meth:`to_json` described."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """Everything that defines this tokenizer, as JSON values."""

    @abstractmethod
    def _encode_chunk(self, chunk: bytes) -> tuple[np.ndarray, np.ndarray]:
        """Ids and ends (relative to the chunk) of whole lines of text."""

    @abstractmethod
    def pieces(self, ids: Iterable[int]) -> Iterator[bytes]:
        """The bytes of each token as it comes: ``b"".join(pieces(ids)) == decode(ids)``."""

    @abstractmethod
    def token_text(self, id: int) -> str:
        """A readable form of token ``id`` (for tables)."""

    def normalize(self, text: bytes | np.ndarray) -> bytes:
        """``decode(encode(text))`` when the tokenizer keeps the text: the text itself."""
        return bytes(_as_array(text))

    def encode(self, data: bytes | np.ndarray) -> Encoded:
        """The tokens of ``data`` (bytes or a uint8 array)."""
        array = _as_array(data)
        return _join(list(self._stream(array, "", progress=False)), len(array))

    def decode(self, ids: Iterable[int]) -> bytes:
        """The text of ``ids``."""
        return b"".join(self.pieces(ids))

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` (read back by :func:`load`)."""
        Path(path).write_text(json.dumps(self.to_json()) + "\n", encoding="utf-8")

    @cached_property
    def fingerprint(self) -> str:
        """A short stable hash of this tokenizer's definition (for cache keys)."""
        return _digest(json.dumps(self.to_json(), sort_keys=True))

    def _stream(self, array: np.ndarray, desc: str,
                progress: bool) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for start, chunk in _progress_chunks(array, desc, progress):
            ids, ends = self._encode_chunk(chunk)
            yield ids, ends + start

    def _check(self, id: int) -> int:
        if not 0 <= id < self.vocab_size:
            raise TokenizerError(f"token id {id} is outside the {self.name} vocabulary "
                                 f"(0 to {self.vocab_size - 1})")
        return id

    def __repr__(self) -> str:
        return f"<{self.name} tokenizer: {self.vocab_size} {self.unit}s>"


@register
class ByteTokenizer(Tokenizer):
    """One token per byte (256 symbols): the text itself, no copy."""

    name, unit, learned, default_size = "bytes", "character", False, 256

    @property
    def vocab_size(self) -> int:
        return 256

    def fits(self, model_vocab: int) -> bool:
        """Any vocabulary that holds the 256 bytes (more ids are never produced)."""
        return model_vocab >= 256

    @classmethod
    def train(cls, text: bytes | np.ndarray, *, vocab_size: int | None = None,
              min_count: int = DEFAULT_MIN_COUNT, progress: bool = False) -> ByteTokenizer:
        return cls()

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> ByteTokenizer:
        return cls()

    def to_json(self) -> dict[str, Any]:
        return {"adaspan_tokenizer": self.name, "version": 1}

    def encode(self, data: bytes | np.ndarray) -> Encoded:
        return Encoded(_as_array(data), None)

    def _encode_chunk(self, chunk: bytes) -> tuple[np.ndarray, np.ndarray]:
        return np.frombuffer(chunk, np.uint8), np.arange(1, len(chunk) + 1, dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> bytes:
        array = np.asarray(ids if hasattr(ids, "__array__") else list(ids)).ravel()
        bad = array[(array < 0) | (array > 255)]
        if bad.size:
            self._check(int(bad[0]))
        return array.astype(np.uint8).tobytes()

    def pieces(self, ids: Iterable[int]) -> Iterator[bytes]:
        for id in ids:
            yield _SINGLE[self._check(int(id))]

    def token_text(self, id: int) -> str:
        return _readable(_SINGLE[self._check(id)])


class _Index(dict):
    """Word -> id; any other word -> ``missing`` (the id of <unk>, or -1: spelled in bytes)."""

    def __init__(self, pairs: Iterable[tuple[str, int]], missing: int) -> None:
        super().__init__(pairs)
        self.missing = missing

    def __missing__(self, key: str) -> int:
        return self.missing


@register
class WordTokenizer(Tokenizer):
    """Transformer-XL's words (WikiText-103), made lossless: each line (ended by ``\\n``) is
    its whitespace-separated words (``str.split``) then ``<eos>``; a word outside the
    vocabulary is spelled with byte tokens (byte fallback, one token per byte of its UTF-8),
    and so is any whitespace other than one space between two words of the vocabulary. So
    ``decode(encode(text)) == text`` for any bytes (a last line without ``\\n`` has no
    ``<eos>``; bytes that are not UTF-8 are spelled). A word token follows a word token with
    one space. Ids go by how often the training text uses each symbol, bytes included (most
    frequent first, ties by first appearance). A word token's bytes in ``ends`` include the
    space before it.

    Without byte fallback (a vocabulary with ``<unk>``: the authors' word-level checkpoints,
    the tokenizer files of adaspan 0.8 and earlier), every word outside it is ``<unk>``, each
    line's whitespace becomes single spaces and a last line gets its ``<eos>``
    (:meth:`normalize`): the text does not come back."""

    name, unit, default_size = "words", "word", DEFAULT_WORDS_SIZE

    def __init__(self, symbols: Sequence[str], min_count: int = DEFAULT_MIN_COUNT,
                 max_size: int | None = None, byte_fallback: bool = False) -> None:
        needed = {EOS, *BYTE_SYMBOLS} if byte_fallback else {EOS, UNK}
        if len(set(symbols)) != len(symbols) or not needed <= set(symbols):
            wanted = f"{EOS} and the 256 bytes" if byte_fallback else f"{EOS} and {UNK}"
            raise TokenizerError(f"a words vocabulary needs distinct symbols, {wanted}")
        self.symbols, self.min_count, self.max_size = list(symbols), min_count, max_size
        self.byte_fallback = byte_fallback
        special = {EOS, UNK, *BYTE_SYMBOLS} if byte_fallback else set()
        self._index = _Index(((symbol, id) for id, symbol in enumerate(self.symbols)
                              if symbol not in special), -1 if byte_fallback else 0)
        self._eos = self.symbols.index(EOS)
        self._bytes = [symbol.encode("utf-8", "surrogateescape") for symbol in self.symbols]
        self._byte_ids = np.zeros(256, np.int32)
        self._kinds = np.zeros(len(self.symbols), np.int8)  # 0 word, 1 byte, 2 <eos>
        self._kinds[self._eos] = 2
        if byte_fallback:
            for byte, symbol in enumerate(BYTE_SYMBOLS):
                self._byte_ids[byte] = id = self.symbols.index(symbol)
                self._bytes[id], self._kinds[id] = _SINGLE[byte], 1
        else:
            self._index.missing = self.symbols.index(UNK)

    @property
    def vocab_size(self) -> int:
        return len(self.symbols)

    @property
    def unk_id(self) -> int | None:
        return None if self.byte_fallback else self._index.missing

    @property
    def fallback_ids(self) -> np.ndarray:
        return self._byte_ids if self.byte_fallback else np.zeros(0, np.int32)

    @classmethod
    def train(cls, text: bytes | np.ndarray, *, vocab_size: int | None = None,
              min_count: int = DEFAULT_MIN_COUNT, progress: bool = False) -> WordTokenizer:
        """The vocabulary of ``text``: ``<eos>``, the 256 bytes and the most frequent words
        seen at least ``min_count`` times, ``vocab_size`` symbols in all (None: every such
        word), ordered by how often ``text`` uses them."""
        array = _as_array(text)
        words = _top_words(_count_words(array, progress), min_count, vocab_size)
        first = cls([EOS, *BYTE_SYMBOLS, *words], min_count, vocab_size, byte_fallback=True)
        uses = np.zeros(first.vocab_size, np.int64)
        for ids, _ in first._stream(array, "counting tokens", progress):
            uses += np.bincount(ids, minlength=first.vocab_size)
        order = np.argsort(-uses, kind="stable")
        return cls([first.symbols[id] for id in order], min_count, vocab_size, True)

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> WordTokenizer:
        return cls(spec["symbols"], spec["min_count"], spec["max_size"],
                   spec.get("byte_fallback", False))

    def to_json(self) -> dict[str, Any]:
        return {"adaspan_tokenizer": self.name, "version": 2 if self.byte_fallback else 1,
                "min_count": self.min_count, "max_size": self.max_size, "symbols": self.symbols,
                **({"byte_fallback": True} if self.byte_fallback else {})}

    def normalize(self, text: bytes | np.ndarray) -> bytes:
        """``decode(encode(text))``: the text itself with byte fallback; without, each line's
        words, unknown ones as ``<unk>``, joined by one space and ended by ``\\n`` (also the
        last line if it had none); a word ``<eos>`` ends a line too. So whitespace runs inside
        a line become one space and spaces at either end of a line go."""
        if self.byte_fallback:
            return super().normalize(text)
        lines = bytes(_as_array(text)).decode("utf-8", "surrogateescape").split("\n")
        out = []
        for line in lines[:-1] if lines[-1] == "" else lines:
            groups: list[list[str]] = [[]]
            for word in line.split():
                if word == EOS:
                    groups.append([])
                else:
                    groups[-1].append(word if word in self._index else UNK)
            out.append("\n".join(" ".join(group) for group in groups) + "\n")
        return "".join(out).encode("utf-8", "surrogateescape")

    def _encode_chunk(self, chunk: bytes) -> tuple[np.ndarray, np.ndarray]:
        text = chunk.decode("utf-8", "surrogateescape")
        codes = _codepoints(text)
        space = _SPACES[np.minimum(codes, len(_SPACES) - 1)]
        newline = codes == 10
        last = np.flatnonzero(~space & np.append(space[1:], True))  # each word's last character
        words = text.split()
        ids = np.fromiter(map(self._index.__getitem__, words), np.int32, len(words))
        offsets = _byte_offsets(codes)
        if not self.byte_fallback:
            return self._unk_tokens(chunk, ids, offsets, newline, last)
        first = np.flatnonzero(~space & np.insert(space[:-1], 0, True))
        known = ids >= 0
        joined = np.zeros(len(words), bool)  # one space after a known word: the token's own
        joined[1:] = (known[1:] & known[:-1] & (first[1:] - last[:-1] == 2)
                      & (codes[np.maximum(first[1:] - 1, 0)] == 32))
        spelled = space & ~newline
        spelled[first[joined] - 1] = False
        word_of = np.cumsum(np.insert(space[:-1], 0, True) & ~space) - 1  # per character
        if len(words):
            spelled |= ~space & ~known[word_of]
        at = np.flatnonzero(np.repeat(spelled, np.diff(offsets)))  # bytes spelled one a token
        data = np.frombuffer(chunk, np.uint8)
        all_ids = np.concatenate([self._byte_ids[data[at]], ids[known],
                                  np.full(int(newline.sum()), self._eos, np.int32)])
        all_ends = np.concatenate([at + 1, offsets[last[known] + 1],
                                   offsets[np.flatnonzero(newline) + 1]])
        order = np.argsort(all_ends, kind="stable")
        return all_ids[order], all_ends[order]

    def _unk_tokens(self, chunk: bytes, ids: np.ndarray, offsets: np.ndarray,
                    newline: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Without byte fallback: words (unknown ones <unk>) and an <eos> at every line end,
        also after a last line without ``\\n``."""
        at = np.sort(np.append(last, np.flatnonzero(newline)))
        out, ends = np.full(len(at), self._eos, dtype=np.int32), offsets[at + 1]
        out[~newline[at]] = ids
        if chunk and not chunk.endswith(b"\n"):
            out, ends = np.append(out, self._eos), np.append(ends, len(chunk))
        return out, ends

    def pieces(self, ids: Iterable[int]) -> Iterator[bytes]:
        after_word = False
        for id in map(int, ids):
            kind = self._kinds[self._check(id)]
            if kind == 2:
                yield b"\n"
            else:
                yield b" " + self._bytes[id] if after_word and not kind else self._bytes[id]
            after_word = not kind

    def token_text(self, id: int) -> str:
        return _readable(self._bytes[self._check(id)])


@register
class BPETokenizer(Tokenizer):
    """Byte-level BPE (Hugging Face ``tokenizers``): trained here, or any ``tokenizer.json``.
    A byte-level file gives every token its exact bytes (text that is not UTF-8 included);
    another kind of file scores each token by its character offsets."""

    name, unit, default_size = "bpe", "token", DEFAULT_BPE_SIZE

    def __init__(self, model: hf.Tokenizer) -> None:
        self._hf, self._spec = model, json.loads(model.to_str())
        decoder = self._spec.get("decoder") or {}
        vocab = model.get_vocab(with_added_tokens=True)
        self._size = max(vocab.values(), default=-1) + 1
        self._byte_level = self._spec.get("normalizer") is None and \
            decoder.get("type") == "ByteLevel"
        self._bytes = [self._token_bytes(model.id_to_token(id), id) for id in range(self._size)]
        self._lengths = np.array([len(piece) for piece in self._bytes], dtype=np.int64)
        byte_ids = [vocab.get(char) for char in _BYTE_CHARS]
        self._byte_ids = byte_ids if None not in byte_ids and self._byte_level else None
        self._unk = vocab.get((self._spec.get("model") or {}).get("unk_token") or "")

    @property
    def vocab_size(self) -> int:
        return self._size

    @property
    def unk_id(self) -> int | None:
        """The id of the file's unknown token, if its model has one."""
        return self._unk

    @classmethod
    def train(cls, text: bytes | np.ndarray, *, vocab_size: int | None = None,
              min_count: int = DEFAULT_MIN_COUNT, progress: bool = False) -> BPETokenizer:
        """BPE merges learned from ``text`` up to ``vocab_size`` tokens (the 256 bytes
        included; ``min_count`` does not apply)."""
        size = DEFAULT_BPE_SIZE if vocab_size is None else vocab_size
        if size < 256:
            raise TokenizerError(f"bpe needs vocab_size >= 256 (one token per byte), got {size}")
        model = hf.Tokenizer(hf.models.BPE())
        model.pre_tokenizer = hf.pre_tokenizers.ByteLevel(add_prefix_space=False)
        model.decoder = hf.decoders.ByteLevel()
        trainer = hf.trainers.BpeTrainer(vocab_size=size, show_progress=False, special_tokens=[],
                                         initial_alphabet=hf.pre_tokenizers.ByteLevel.alphabet())
        lines = (line for _, chunk in _progress_chunks(_as_array(text), "training bpe", progress)
                 for line in _lines(_SURROGATES.sub("", chunk.decode("utf-8", "surrogateescape"))))
        model.train_from_iterator(lines, trainer=trainer)
        if model.get_vocab_size() < size:
            raise TokenizerError(f"the training text yields only {model.get_vocab_size()} BPE "
                                 f"tokens; ask for at most {model.get_vocab_size()}")
        return cls(model)

    @classmethod
    def from_file(cls, path: str | Path) -> BPETokenizer:
        """The tokenizer of any Hugging Face ``tokenizer.json``."""
        try:
            return cls(hf.Tokenizer.from_file(str(path)))
        except Exception as exc:  # tokenizers raises plain Exception
            raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json: "
                                 f"{one_line(exc)}") from None

    @classmethod
    def from_json(cls, spec: dict[str, Any]) -> BPETokenizer:
        return cls(hf.Tokenizer.from_str(json.dumps(spec["hf"])))

    def to_json(self) -> dict[str, Any]:
        return {"adaspan_tokenizer": self.name, "version": 1, "hf": self._spec}

    def _token_bytes(self, token: str | None, id: int) -> bytes:
        if token is None:
            return b""
        if self._byte_level and all(char in _CHAR_BYTES for char in token):
            return bytes(_CHAR_BYTES[char] for char in token)
        return self._hf.decode([id], skip_special_tokens=False).encode("utf-8")

    def _encode_chunk(self, chunk: bytes) -> tuple[np.ndarray, np.ndarray]:
        try:
            text, clean = chunk.decode("utf-8"), True
        except UnicodeDecodeError:
            text, clean = chunk.decode("utf-8", "surrogateescape"), False
        lines = _lines(text)
        line_ends = np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + 1
        if chunk and chunk[-1] != 10:
            line_ends = np.append(line_ends, len(chunk))
        if self._byte_level and (clean or self._byte_ids is not None):
            encode_batch = getattr(self._hf, "encode_batch_fast", self._hf.encode_batch)
            per_line = ([encoding.ids for encoding in encode_batch(lines, add_special_tokens=False)]
                        if clean else [self._mixed_ids(line) for line in lines])
            ids, counts = _flatten(per_line)
            ends = np.cumsum(self._lengths[ids])
            last, has = np.cumsum(counts) - 1, counts > 0
            if np.array_equal(ends[last[has]], line_ends[has]):
                return ids, ends
        return self._offset_ends(text, lines, line_ends, clean)

    def _mixed_ids(self, line: str) -> list[int]:
        """Ids of a line holding bytes that are not UTF-8: those take their byte's token."""
        ids: list[int] = []
        for k, part in enumerate(_SURROGATES.split(line)):
            if k % 2:
                ids += [self._byte_ids[b] for b in part.encode("utf-8", "surrogateescape")]
            elif part:
                ids += self._hf.encode(part, add_special_tokens=False).ids
        return ids

    def _offset_ends(self, text: str, lines: list[str], line_ends: np.ndarray,
                     clean: bool) -> tuple[np.ndarray, np.ndarray]:
        """Ids, and ends from the tokens' character offsets; the last token of a line ends at
        the end of the line."""
        safe = lines if clean else [_SURROGATES.sub(lambda m: "\ufffd" * len(m[0]), line)
                                    for line in lines]
        encodings = self._hf.encode_batch(safe, add_special_tokens=False)
        ids, counts = _flatten([encoding.ids for encoding in encodings])
        char_ends = np.fromiter((end for encoding in encodings for _, end in encoding.offsets),
                                np.int64, len(ids))
        starts = np.cumsum([0, *map(len, lines)])[:-1]
        ends = _byte_offsets(_codepoints(text))[np.repeat(starts, counts) + char_ends]
        last, has = np.cumsum(counts) - 1, counts > 0
        ends[last[has]] = line_ends[has]
        return ids, np.maximum.accumulate(ends) if len(ends) else ends

    def pieces(self, ids: Iterable[int]) -> Iterator[bytes]:
        for id in ids:
            yield self._bytes[self._check(int(id))]

    def token_text(self, id: int) -> str:
        return _readable(self._bytes[self._check(id)])


def build(name: str, train_text: bytes | np.ndarray, *, vocab_size: int | None = None,
          min_count: int = DEFAULT_MIN_COUNT, file: str | Path | None = None,
          cache_root: str | Path | None = None, progress: bool = False) -> Tokenizer:
    """The tokenizer ``name`` learned from ``train_text``, cached as
    ``<cache_root>/tokenizers/<key>.json`` (None: not cached); or read from ``file`` (see
    :func:`load`), with a warning if it does not reproduce the start of ``train_text``."""
    if name not in TOKENIZERS:
        close = difflib.get_close_matches(name, TOKENIZERS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise TokenizerError(f"unknown tokenizer {name!r}{hint} (known: {', '.join(TOKENIZERS)})")
    cls = TOKENIZERS[name]
    if file is not None:
        return _read_for(cls, file, train_text)
    array = _as_array(train_text)
    path = None
    if cls.learned and cache_root is not None:
        key = _digest(f"{_FORMAT}:{name}:{vocab_size}:{min_count}:{_content(array)}")
        path = Path(cache_root) / "tokenizers" / f"{key}.json"
        if path.is_file():
            try:
                return load(path)
            except TokenizerError:
                pass  # a damaged cache file: learned again below
    tokenizer = cls.train(array, vocab_size=vocab_size, min_count=min_count, progress=progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write({path: tokenizer.save})
    return tokenizer


def load(path: str | Path) -> Tokenizer:
    """The tokenizer of a ``tokenizer.json`` written by :meth:`Tokenizer.save`, or of a
    Hugging Face ``tokenizer.json`` (as bpe)."""
    try:
        spec = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read tokenizer file {path}: {one_line(exc)}") from None
    if isinstance(spec, dict) and "adaspan_tokenizer" not in spec and "model" in spec:
        return BPETokenizer.from_file(path)
    name = spec.get("adaspan_tokenizer") if isinstance(spec, dict) else None
    if name not in TOKENIZERS:
        raise TokenizerError(f"{path} is not a tokenizer file (no known adaspan_tokenizer and "
                             "no Hugging Face model)")
    try:
        return TOKENIZERS[name].from_json(spec)
    except Exception as exc:  # a damaged file; tokenizers raises plain Exception
        raise TokenizerError(f"{path} is not a valid {name} tokenizer file: "
                             f"{one_line(exc)}") from None


def _read_for(cls: type[Tokenizer], path: str | Path, text: bytes | np.ndarray) -> Tokenizer:
    tokenizer = load(path)
    if not isinstance(tokenizer, cls):
        raise TokenizerError(f"{path} holds a {tokenizer.name} tokenizer, not {cls.name}")
    sample = next(_line_chunks(_as_array(text), SAMPLE), (0, b""))[1]
    if tokenizer.decode(tokenizer.encode(sample).ids) != tokenizer.normalize(sample):
        warnings.warn(f"{path} does not reproduce the text exactly (decode(encode(text)) "
                      "differs); using it anyway, scoring each byte of the text", stacklevel=3)
    return tokenizer


def tokenize_splits(splits: dict[str, np.ndarray], tokenizer: Tokenizer,
                    cache_root: str | Path | None = None,
                    progress: bool = True) -> dict[str, Encoded]:
    """Each split's :class:`Encoded`, with a progress bar. Bytes: the arrays themselves.
    Others: stored as ``<cache_root>/tokens/<key>/{ids,ends}.npy`` (key: the tokenizer's
    fingerprint and a hash of the split's bytes) and read back memory-mapped."""
    result = {}
    for name, data in splits.items():
        array = _as_array(data)
        if not tokenizer.learned:
            result[name] = tokenizer.encode(array)
            continue
        folder = None
        if cache_root is not None:
            key = _digest(f"{_FORMAT}:{tokenizer.fingerprint}:{_content(array)}")
            folder = Path(cache_root) / "tokens" / key
            cached = _load_cached(folder, len(array))
            if cached is not None:
                result[name] = cached
                continue
        parts = list(tokenizer._stream(array, f"tokenizing {name}", progress))
        result[name] = (_join(parts, len(array)) if folder is None
                        else _store(folder, parts, len(array)))
    return result


def _load_cached(folder: Path, size: int) -> Encoded | None:
    """The cached tokens in ``folder`` if both files are whole and fit a text of ``size``."""
    try:
        ids = np.load(folder / "ids.npy", mmap_mode="r")
        ends = np.load(folder / "ends.npy", mmap_mode="r")
    except (OSError, ValueError, EOFError):
        return None
    whole = ids.ndim == 1 and ends.shape == ids.shape and ends.dtype == np.int64 and len(ids)
    return Encoded(ids, ends) if whole and int(ends[-1]) == size else None


def _store(folder: Path, parts: list[tuple[np.ndarray, np.ndarray]], size: int) -> Encoded:
    _fix_last(parts, size)

    def writer(column: int, dtype: type) -> Any:
        def write(path: Path) -> None:
            total = sum(len(part[column]) for part in parts)
            with open(path, "wb") as out:
                np.lib.format.write_array_header_1_0(out, {
                    "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                    "fortran_order": False, "shape": (total,)})
                for part in parts:
                    out.write(part[column].astype(dtype, copy=False).tobytes())
        return write

    folder.mkdir(parents=True, exist_ok=True)
    atomic_write({folder / "ids.npy": writer(0, np.int32),
                  folder / "ends.npy": writer(1, np.int64)})
    cached = _load_cached(folder, size)
    return cached if cached is not None else _join(parts, size)


def _join(parts: list[tuple[np.ndarray, np.ndarray]], size: int) -> Encoded:
    _fix_last(parts, size)
    if not parts:
        return Encoded(np.zeros(0, np.int32), np.zeros(0, np.int64))
    return Encoded(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))


def _fix_last(parts: list[tuple[np.ndarray, np.ndarray]], size: int) -> None:
    """The last token takes the text's end (lines that gave no token at all, at its end)."""
    for _, ends in reversed(parts):
        if len(ends):
            ends[-1] = size
            return


def _count_words(array: np.ndarray, progress: bool) -> Counter[str]:
    """Words and <eos> of a text, counted in order of first appearance."""
    if not len(array):
        raise TokenizerError("the training text is empty: the words tokenizer needs words")
    counts: Counter[str] = Counter()
    for _, chunk in _progress_chunks(array, "counting words", progress):
        text = chunk.decode("utf-8", "surrogateescape")
        if EOS not in counts:  # <eos> takes its place after the words of the first line
            head, _, text = text.partition("\n")
            counts.update(head.split())
            counts[EOS] += 1
        counts.update(text.split())
        counts[EOS] += text.count("\n") + (bool(text) and not text.endswith("\n"))
    if sum(counts.values()) <= 2 * counts[EOS]:
        raise TokenizerError("the training text has no whitespace inside its lines: the words "
                             "tokenizer splits on it; use bytes or bpe")
    return counts


def _top_words(counts: Counter[str], min_count: int, vocab_size: int | None) -> list[str]:
    """The ``vocab_size - 257`` words of ``counts`` seen most (at least ``min_count`` times;
    ties: first appearance; None: all of them), the 257 being <eos> and the 256 bytes."""
    special = {EOS, UNK, *BYTE_SYMBOLS}
    words = sorted((word for word, count in counts.items()
                    if count >= min_count and word not in special),
                   key=counts.__getitem__, reverse=True)  # stable: ties keep their order
    if vocab_size is None:
        return words
    fixed = 1 + len(BYTE_SYMBOLS)
    if vocab_size < fixed:
        raise TokenizerError(f"words needs vocab_size >= {fixed} ({EOS} and the 256 bytes that "
                             f"spell other words), got {vocab_size}")
    if vocab_size > len(words) + fixed:
        raise TokenizerError(
            f"the training split has only {len(words)} distinct words (min_count={min_count}); "
            f"ask for at most {len(words) + fixed} (with {EOS} and the 256 bytes)")
    return words[:vocab_size - fixed]


def _as_array(data: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TokenizerError(f"a text must be bytes or a 1-D uint8 array, not a {data.ndim}-D "
                                 f"{data.dtype} array")
        return data
    return np.frombuffer(data, dtype=np.uint8)


def _line_chunks(array: np.ndarray, size: int | None = None) -> Iterator[tuple[int, bytes]]:
    """``(offset, bytes)`` of about ``size`` (default CHUNK) bytes of whole lines (a longer
    line whole)."""
    start, total, size = 0, len(array), size or CHUNK
    while start < total:
        stop = min(start + size, total)
        chunk = array[start:stop].tobytes()
        cut = chunk.rfind(b"\n") + 1
        if stop < total:
            chunk = chunk[:cut] if cut else chunk + _rest_of_line(array, stop, size)
        yield start, chunk
        start += len(chunk)


def _rest_of_line(array: np.ndarray, start: int, size: int) -> bytes:
    """The bytes from ``start`` to the next line end (included) or the end of the text."""
    parts = []
    while start < len(array):
        window = array[start:start + size].tobytes()
        cut = window.find(b"\n") + 1
        parts.append(window[:cut] if cut else window)
        if cut:
            break
        start += len(window)
    return b"".join(parts)


def _progress_chunks(array: np.ndarray, desc: str, progress: bool) -> Iterator[tuple[int, bytes]]:
    with tqdm(total=len(array), unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        for start, chunk in _line_chunks(array):
            yield start, chunk
            bar.update(len(chunk))


def _codepoints(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def _byte_offsets(codes: np.ndarray) -> np.ndarray:
    """Byte offset in UTF-8 of each character boundary (0 first); a surrogate is one byte."""
    surrogate = (codes >= 0xD800) & (codes < 0xE000)
    size = 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000) - 2 * surrogate
    return np.concatenate([[0], np.cumsum(size, dtype=np.int64)])


def _flatten(per_line: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """All ids, and the number of each line's."""
    counts = np.fromiter(map(len, per_line), np.int64, len(per_line))
    return np.fromiter(chain.from_iterable(per_line), np.int32, int(counts.sum())), counts


def _lines(text: str) -> list[str]:
    """The lines of ``text``, each with its ``\\n`` (the last one may have none)."""
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def _content(array: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array).data, digest_size=16).hexdigest()


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _readable(piece: bytes) -> str:
    """A token's bytes for a table: UTF-8, a space as ␣, other invisible characters and bytes
    that are not UTF-8 escaped."""
    text = piece.decode("utf-8", "backslashreplace")
    return "".join("␣" if char == " " else char if char.isprintable()
                   else char.encode("unicode_escape").decode() for char in text)
