"""Synthetic corpora with long-range structure, generated from a seed (``data=synthetic:...``).

Each corpus knows, for every character, the *distance* back to the character it repeats (0 where
it repeats nothing), so a model's bits per character can be read on the positions that only
context of that distance or more can predict. A spec reads ``synthetic:KIND?key=value&...``:

* ``copy``: random lowercase letters in which, after every ``gap`` fresh letters (drawn in
  ``[gap_min, gap_max]``), a segment of ``segment`` letters repeats the text found ``d``
  characters earlier, ``d`` drawn uniformly in ``[min, max]`` per segment. After its first few
  letters a segment is determined by the text ``d`` back (26^k strings of k letters make a chance
  match unlikely), so a model that sees ``max`` characters back can predict ~all of it.
* ``words``: words of a random vocabulary of ``vocab`` words (2-8 letters) separated by spaces,
  drawn with Zipf frequencies (exponent ``skew``): a word of rank r recurs every ~r times the
  most frequent word's interval, so the distance to a word's previous occurrence spreads from
  tens to thousands of characters. A word's letters after its first repeat its previous
  occurrence, at that distance.

Both take ``seed`` and ``length`` (characters, default 2,000,000); the same spec always gives
the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UserError

PREFIX = "synthetic:"
LETTERS = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
SPACE = ord(" ")
# kind -> parameter -> default (int parameters, except the words' skew)
DEFAULTS: dict[str, dict[str, float]] = {
    "copy": {"min": 200, "max": 800, "segment": 32, "gap_min": 32, "gap_max": 96,
             "seed": 0, "length": 2_000_000},
    "words": {"vocab": 5000, "skew": 1.0, "seed": 0, "length": 2_000_000},
}

NAMES = tuple(PREFIX + kind for kind in DEFAULTS)


class SyntheticSpecError(UserError, ValueError):
    """A ``synthetic:`` spec with an unknown kind or parameter, or a value out of range."""


@dataclass(frozen=True)
class Synthetic:
    """A generated text and, per character, the distance to the character it repeats (0:
    none)."""

    tokens: np.ndarray  # uint8
    distance: np.ndarray  # int64, same length

    def needs(self, at_least: int) -> np.ndarray:
        """Mask of the characters predictable only from context ``at_least`` or more back."""
        return self.distance >= at_least


def is_synthetic(spec: object) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def parse(spec: str) -> tuple[str, dict[str, float]]:
    """Kind and parameters (defaults filled in) of ``synthetic:KIND?key=value&...``."""
    kind, _, query = spec.removeprefix(PREFIX).partition("?")
    if kind not in DEFAULTS:
        raise SyntheticSpecError(f"{spec!r}: unknown synthetic corpus {kind!r}; "
                                 f"expected one of {', '.join(NAMES)}")
    params = dict(DEFAULTS[kind])
    for field in filter(None, query.split("&")):
        key, equals, text = field.partition("=")
        if not equals:
            raise SyntheticSpecError(f"{spec!r}: {field!r} is not key=value")
        if key not in params:
            raise SyntheticSpecError(f"{spec!r}: {PREFIX}{kind} has no parameter {key!r}; "
                                     f"it takes {', '.join(params)}")
        params[key] = _number(spec, key, text, float if key == "skew" else int)
    _check(spec, kind, params)
    return kind, params


def _number(spec: str, key: str, text: str, kind: type) -> float:
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise SyntheticSpecError(f"{spec!r}: {key}={text!r} is not {what}") from None


def _check(spec: str, kind: str, p: dict[str, float]) -> None:
    rules = [("length", p["length"] >= 1000, ">= 1000")]
    if kind == "copy":
        rules += [("min", 1 <= p["min"] <= p["max"], "in [1, max]"),
                  ("segment", 1 <= p["segment"] <= p["min"], "in [1, min]"),
                  ("gap_min", 1 <= p["gap_min"] <= p["gap_max"], "in [1, gap_max]")]
    else:
        rules += [("vocab", p["vocab"] >= 2, ">= 2"), ("skew", p["skew"] >= 0, ">= 0")]
    for key, ok, what in rules:
        if not ok:
            raise SyntheticSpecError(f"{spec!r}: {key} must be {what}, got {p[key]:g}")


def synthesize(spec: str) -> Synthetic:
    """The text of ``spec`` and its distances (deterministic in the spec)."""
    kind, p = parse(spec)
    rng = np.random.default_rng(int(p["seed"]))
    return (_copy if kind == "copy" else _words)(rng, p)


def _copy(rng: np.random.Generator, p: dict[str, float]) -> Synthetic:
    n = int(p["length"])
    tokens = LETTERS[rng.integers(0, len(LETTERS), n)]
    distance = np.zeros(n, dtype=np.int64)
    t = int(p["max"])  # the first copy needs max characters before it
    while True:
        t += int(rng.integers(p["gap_min"], p["gap_max"] + 1))
        d = int(rng.integers(p["min"], p["max"] + 1))
        end = min(t + int(p["segment"]), n)
        if t >= n:
            return Synthetic(tokens, distance)
        tokens[t:end] = tokens[t - d : end - d]  # d >= min >= segment: no overlap
        distance[t:end] = d
        t = end


def _words(rng: np.random.Generator, p: dict[str, float]) -> Synthetic:
    n, vocab = int(p["length"]), int(p["vocab"])
    words = [bytes(LETTERS[rng.integers(0, 26, int(rng.integers(2, 9)))]) for _ in range(vocab)]
    weights = np.arange(1, vocab + 1, dtype=np.float64) ** -p["skew"]
    drawn = rng.choice(vocab, size=n // 3 + 1, p=weights / weights.sum())  # >= n chars
    tokens = np.empty(n, dtype=np.uint8)
    distance = np.zeros(n, dtype=np.int64)
    last_start: dict[int, int] = {}
    t = 0
    for w in drawn:
        word = words[w] + b" "
        end = min(t + len(word), n)
        tokens[t:end] = np.frombuffer(word[: end - t], dtype=np.uint8)
        if w in last_start:  # letters after the first, and the space, repeat the last occurrence
            distance[t + 1 : end] = t - last_start[w]
        last_start[w] = t
        t = end
        if t == n:
            return Synthetic(tokens, distance)
    raise AssertionError("drew too few words")  # every word has >= 3 bytes with its space
