"""The tokens of a run: its tokenizer and its corpus as token ids.

A new run builds the tokenizer its :class:`~adaspan.config.TrainConfig` names on the train split
(:func:`run_tokenizer`) and saves it in the run directory (``tokenizer.json``); evaluating,
sampling and resuming read it back (:func:`saved_tokenizer`), so every command of a run uses
the same tokens. :func:`encode_corpus` turns the three splits into ids (cached on disk) with,
per token, where its bytes end in the text (:class:`~adaspan.data.tokenizer.Encoded`): scores per
byte of the original text (bits per byte, the bpc of a byte run) come from these.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..config import ConfigError, ModelConfig, TrainConfig
from ..data.authors_format import (
    ByteSymbols,
    OfficialFormatError,
    byte_codec,
    encode_split,
    symbol_ends,
)
from ..data.corpora import SPLITS, Corpus, load_corpus
from ..data.download import data_dir as data_root
from ..data.tokenizer import (
    TOKENIZERS,
    UNK,
    ByteTokenizer,
    Encoded,
    Tokenizer,
    TokenizerError,
    WordTokenizer,
    build,
    load,
    tokenize_splits,
)
from .checkpoint import RunDir, RunDirError


def read_vocab(run_dir: RunDir | str | Path) -> list[str] | None:
    """The symbols of a converted run (``vocab.json``), or None for an ordinary adaspan run."""
    path = RunDir.of(run_dir).vocab_file
    if not path.is_file():
        return None
    try:
        vocab = json.loads(path.read_text(encoding="utf8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise RunDirError(f"cannot read {path}: {exc}") from exc
    if not isinstance(vocab, list) or not all(isinstance(s, str) for s in vocab):
        raise RunDirError(f"{path} must hold a JSON list of symbols")
    return vocab


@dataclass(frozen=True)
class TokenCorpus:
    """A corpus as a tokenizer's ids: ``splits`` maps train/valid/test to their
    :class:`~adaspan.data.tokenizer.Encoded` (ids, and where each token ends in the text)."""

    name: str
    tokenizer: Tokenizer
    splits: dict[str, Encoded]

    def split(self, name: str) -> np.ndarray:
        """The token ids of split ``name``."""
        return self.splits[name].ids

    def ends(self, name: str) -> np.ndarray | None:
        """Where each token of split ``name`` ends in its text (None: one byte per token)."""
        return self.splits[name].ends

    @property
    def train(self) -> np.ndarray:
        return self.split("train")

    @property
    def valid(self) -> np.ndarray:
        return self.split("valid")

    def bytes_per_token(self, name: str = "train") -> float:
        """Average bytes of text per token of split ``name`` (1 for bytes)."""
        ends = self.ends(name)
        return 1.0 if ends is None or not len(ends) else float(ends[-1]) / len(ends)

    def outside(self, name: str = "train") -> tuple[float, float]:
        """Shares of the bytes of split ``name`` outside the vocabulary (:func:`outside`)."""
        return outside(self.tokenizer, self.split(name), self.ends(name))


def outside(tokenizer: Tokenizer, ids: np.ndarray, ends: np.ndarray | None) -> tuple[float, float]:
    """Shares of the bytes of a text (its tokens ``ids`` ending at ``ends``) outside the
    vocabulary of ``tokenizer``: under ``<unk>``, and spelled one byte a token
    (:attr:`~adaspan.data.tokenizer.Tokenizer.fallback_ids`); 0, 0 for bytes."""
    if ends is None or not len(ends):
        return 0.0, 0.0
    ids, lengths = np.asarray(ids), np.diff(np.asarray(ends), prepend=0)
    spelled = np.zeros(tokenizer.vocab_size, bool)
    spelled[tokenizer.fallback_ids] = True
    unk = tokenizer.unk_id
    under = int(lengths[ids == unk].sum()) if unk is not None else 0
    return under / float(ends[-1]), int(lengths[spelled[ids]].sum()) / float(ends[-1])


def run_tokenizer(config: TrainConfig, corpus: Corpus, vocab_size: int,
                  progress: bool = True) -> Tokenizer:
    """The tokenizer of a new run: ``config.tokenizer`` built on the train split of ``corpus``
    to ``vocab_size`` tokens (or read from ``config.tokenizer_file``), cached under the data
    root (``config.data_dir``)."""
    return build(config.tokenizer, corpus.train, vocab_size=vocab_size, min_count=1,
                 file=config.tokenizer_file, cache_root=data_root(config.data_dir),
                 progress=progress)


def check_vocab(model_config: ModelConfig, tokenizer: Tokenizer) -> None:
    """The model's ``vocab_size`` must be the tokenizer's (:meth:`Tokenizer.fits`)."""
    size, wanted = model_config.vocab_size, tokenizer.vocab_size
    if not tokenizer.fits(size):
        raise ConfigError(f"vocab_size={size} does not fit the {tokenizer.name} tokenizer, "
                          f"which has {wanted} tokens: set vocab_size={wanted}")


TOO_SMALL = 0.5  # share of the train split's bytes outside the vocabulary that warns


def vocab_warning(tokens: TokenCorpus) -> str | None:
    """One line where most of the train split's bytes are outside the vocabulary (spelled byte
    by byte, or under ``<unk>``): the vocabulary is too small for the text."""
    unk, spelled = tokens.outside("train")
    if unk + spelled <= TOO_SMALL:
        return None
    tokenizer = tokens.tokenizer
    return (f"warning: {unk + spelled:.0%} of the train split's bytes are outside the "
            f"{tokenizer.vocab_size:,}-token {tokenizer.name} vocabulary ({spelled:.0%} spelled "
            f"byte by byte, {unk:.0%} under <unk>): a larger vocab_size fits this text better")


def encode_corpus(corpus: Corpus, tokenizer: Tokenizer, data_dir: str | None = None,
                  progress: bool = True, splits: tuple[str, ...] = SPLITS) -> TokenCorpus:
    """``splits`` of ``corpus`` as ids of ``tokenizer``, cached under the data root (bytes:
    the corpus's own arrays, no copy)."""
    encoded = tokenize_splits({name: corpus.split(name) for name in splits}, tokenizer,
                              data_root(data_dir), progress)
    return TokenCorpus(corpus.name, tokenizer, encoded)


def saved_tokenizer(run_dir: str | Path | RunDir) -> Tokenizer:
    """The tokenizer saved in a run directory; bytes for a run saved without one (adaspan
    0.7 and earlier)."""
    path = RunDir.of(run_dir).tokenizer_file
    if not path.is_file():
        return ByteTokenizer()
    try:
        return load(path)
    except TokenizerError as exc:
        raise RunDirError(str(exc)) from None


class RunSplit(NamedTuple):
    """A split of a run's corpus as its tokens: ids, the corpus's name, what one token is,
    where each token ends in the text (None: one byte per token), and the id of ``<unk>``
    (None: the tokens keep every byte)."""

    tokens: np.ndarray
    name: str
    unit: str
    ends: np.ndarray | None
    unk: int | None


def run_split(run_dir: RunDir | str | Path, split: str, data: str | Path | None = None,
              data_dir: str | Path | None = None, progress: bool = True) -> RunSplit:
    """Split ``split`` of the corpus of ``run_dir``, or of ``data``, as the run's tokens (its
    saved tokenizer; ``data_dir``: where corpora and tokens are cached, default the run's), or
    for a converted run the symbol ids of a directory in the authors' format."""
    run = RunDir.of(run_dir)
    saved = run.load_config()[1]
    vocab = read_vocab(run)
    if vocab is not None:
        folder = data or saved.data
        ids = encode_split(folder, split, vocab)
        return RunSplit(ids, f"{folder} (authors' format)", "symbol", symbol_ends(ids, vocab),
                        vocab.index(UNK) if UNK in vocab else None)
    data_dir = data_dir or saved.data_dir
    corpus = load_corpus(data or saved.data, data_dir, progress=progress)
    tokens = encode_corpus(corpus, saved_tokenizer(run), data_dir and str(data_dir),
                           progress, (split,))
    return RunSplit(tokens.split(split), corpus.name, tokens.tokenizer.unit, tokens.ends(split),
                    tokens.tokenizer.unk_id)


def run_codec(run_dir: RunDir | str | Path) -> Tokenizer | ByteSymbols:
    """Text to the token ids of ``run_dir`` and back (``encode``, ``pieces``): its tokenizer,
    or for a converted run its vocabulary of symbols."""
    run = RunDir.of(run_dir)
    vocab = read_vocab(run)
    if vocab is None:
        return saved_tokenizer(run)
    try:
        return ByteSymbols(*byte_codec(vocab))
    except OfficialFormatError:
        pass
    try:  # words: the authors' symbols, in their order
        return WordTokenizer(vocab, min_count=1)
    except TokenizerError as exc:
        raise OfficialFormatError(f"{run.vocab_file}: {exc}") from None


UNK_NOTE = {"unk_share": "of the valid split's bytes under <unk>: one token for a whole word, "
                         "so the figures per byte are upper bounds"}


def per_byte(config: TrainConfig, model_config: ModelConfig, figures: dict,
             progress: bool = True) -> dict:
    """``figures`` of ``adaspan bench`` per token (``*_chars_per_s``, ``flops_per_char``) also
    per byte of text, for a tokenizer that learns its tokens: the corpus's valid split read
    as the tokens of ``config`` says how many bytes a token is on average (``unk_share``:
    the share of those bytes under ``<unk>``, where some are: each word of them counted as
    read in one token). Empty for bytes (the corpus is then not read)."""
    if not TOKENIZERS[config.tokenizer].learned:
        return {}
    corpus = load_corpus(config.data, config.data_dir, progress=progress)
    tokenizer = run_tokenizer(config, corpus, model_config.vocab_size, progress)
    check_vocab(model_config, tokenizer)
    tokens = encode_corpus(corpus, tokenizer, config.data_dir, progress, ("valid",))
    ratio, unk_share = tokens.bytes_per_token("valid"), tokens.outside("valid")[0]
    rates = {key.replace("_chars_per_s", "_bytes_per_s"): value * ratio
             for key, value in figures.items() if key.endswith("_chars_per_s")}
    return {"tokenizer": config.tokenizer, "bytes_per_token": ratio, **rates,
            "flops_per_byte": figures["flops_per_char"] / ratio,
            **({"unk_share": unk_share} if unk_share else {})}
