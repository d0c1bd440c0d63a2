"""The data format of the paper's authors' code (facebookresearch/adaptive-span).

A data directory holds ``train.txt``, ``valid.txt`` and ``test.txt``; each line is split on
whitespace and ends with the symbol ``<eos>``; the vocabulary lists the symbols in order of
first appearance over train, valid, then test (:func:`build_vocab`, :func:`encode_split`).
A vocabulary of decimal byte values and ``<eos>`` (their enwik8/text8 preparation) stands for
bytes (:func:`byte_codec`, :class:`ByteSymbols`); :func:`symbol_ends` says where each symbol
ends in the text. The converter of their checkpoints is :mod:`adaspan.training.official`.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..errors import UserError
from .tokenizer import Encoded

EOS = "<eos>"
SPLIT_FILES = {"train": "train.txt", "valid": "valid.txt", "test": "test.txt"}


class OfficialFormatError(UserError, ValueError):
    """A checkpoint or data directory of the authors' code that adaspan cannot read or
    convert, or bytes that a converted run's vocabulary has no symbol for."""


def read_symbols(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line number, symbols)`` of each line of a file in the authors' format: the line's
    whitespace-separated symbols followed by ``<eos>``."""
    try:
        with open(path, encoding="utf8") as lines:
            for number, line in enumerate(lines, 1):
                yield number, [*line.split(), EOS]
    except FileNotFoundError as exc:
        raise OfficialFormatError(
            f"{path} does not exist: the data directory must hold "
            f"{', '.join(SPLIT_FILES.values())}") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise OfficialFormatError(f"cannot read {path}: {exc}") from exc


def build_vocab(data_dir: str | Path) -> list[str]:
    """The authors' vocabulary of ``data_dir``: symbols in order of first appearance over
    train.txt, valid.txt, then test.txt."""
    seen: dict[str, None] = {}  # updating a key keeps its first position
    for name in SPLIT_FILES.values():
        for _, symbols in read_symbols(Path(data_dir) / name):
            seen.update(dict.fromkeys(symbols))
    return list(seen)


def encode_split(data_dir: str | Path, split: str, vocab: list[str]) -> np.ndarray:
    """Token ids (int32) of split ``split`` of ``data_dir`` under ``vocab``; an unknown symbol
    is an error naming it and its line."""
    if split not in SPLIT_FILES:
        raise OfficialFormatError(
            f"unknown split {split!r}; expected one of {', '.join(SPLIT_FILES)}")
    path = Path(data_dir) / SPLIT_FILES[split]
    index = {symbol: i for i, symbol in enumerate(vocab)}
    ids = array("i")
    for number, symbols in read_symbols(path):
        try:
            ids.extend([index[s] for s in symbols])
        except KeyError as exc:
            raise OfficialFormatError(
                f"{path}, line {number}: symbol {exc.args[0]!r} is not in the "
                "vocabulary of the converted run") from None
    return np.frombuffer(ids, dtype=np.int32)


def byte_codec(vocab: list[str]) -> tuple[dict[int, int], list[int]]:
    """``(byte -> token id, token id -> byte)`` for a vocabulary of decimal byte values and
    ``<eos>`` (the newline byte), as the authors' enwik8 preparation writes it."""
    to_byte = []
    for symbol in vocab:
        value = 10 if symbol == EOS else int(symbol) if re.fullmatch(r"\d{1,3}", symbol) else -1
        if not 0 <= value < 256:
            raise OfficialFormatError(
                f"generation needs a vocabulary of byte values (decimal 0-255) and "
                f"{EOS}; this run has the symbol {symbol!r}")
        to_byte.append(value)
    to_id = {byte: i for i, byte in enumerate(to_byte)}
    if len(to_id) != len(to_byte):
        raise OfficialFormatError(
            "generation needs one symbol per byte; this vocabulary has two for one "
            f"byte (e.g. both '10' and {EOS})")
    return to_id, to_byte


def encode_bytes(data: bytes, to_id: dict[int, int], what: str = "text") -> list[int]:
    """Token ids of the bytes ``data`` in a vocabulary of bytes (``to_id`` of
    :func:`byte_codec`); a byte without a symbol is an error naming it."""
    missing = sorted(set(data) - set(to_id))
    if missing:
        raise OfficialFormatError(f"the {what} has bytes outside this run's vocabulary: {missing}")
    return [to_id[b] for b in data]


@dataclass(frozen=True)
class ByteSymbols:
    """The text codec of a converted run whose vocabulary is byte values and ``<eos>`` (the
    authors' enwik8/text8 format): bytes to token ids and back, one token per byte."""

    to_id: dict[int, int]
    to_byte: list[int]
    unit: ClassVar[str] = "symbol"

    @property
    def vocab_size(self) -> int:
        return len(self.to_byte)

    def encode(self, data: bytes) -> Encoded:
        """The token ids of ``data``; a byte the run has no symbol for is an error."""
        return Encoded(np.asarray(encode_bytes(data, self.to_id), dtype=np.int32), None)

    def pieces(self, ids: Iterable[int]) -> Iterator[bytes]:
        """The byte of each token id, each as it comes."""
        return (bytes([self.to_byte[t]]) for t in ids)


def symbol_ends(ids: np.ndarray, vocab: list[str]) -> np.ndarray | None:
    """Where each symbol of ``ids`` ends in the text the authors' files stand for: None (one
    byte each) for a vocabulary of bytes; for words, each word and the space or line end after
    it (``<eos>``: the newline, counted with the word before it)."""
    try:
        byte_codec(vocab)
        return None
    except OfficialFormatError:
        lengths = np.array([0 if s == EOS else len(s.encode("utf8")) + 1 for s in vocab])
    return np.cumsum(lengths[ids], dtype=np.int64)
