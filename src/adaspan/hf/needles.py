"""Synthetic long-context retrieval prompts: statements (needles) hidden in a haystack text.

Every task writes an instruction, one or more statements and a question; the haystack's
sentences fill the prompt up to a length in tokens of a given tokenizer, and the first
statement asked about sits at a depth in [0, 1] of the haystack's tokens (at the sentence
boundary nearest to it). Everything is drawn from the seed: the same seed gives the same
statements and the same stretch of haystack at every length and depth.

* ``passkey``: a pass key (5 digits) hidden in the text (Mohtashami & Jaggi 2023);
* ``single_needle``: one special magic number (7 digits) for a key;
* ``multi_key``: four magic numbers for four keys, one of them asked for;
* ``multi_value``: four magic numbers for one key, all of them asked for;
* ``variable_tracking``: a chain of assignments (VAR A = 12345, VAR B = A, ...) and a second
  chain of another value; every variable of the first chain asked for;
* ``word_passkey``: a pass key of 8 words of the NATO alphabet, written once (DuoAttention's
  training prompts hide such keys, of 32 words).

A value is found in a model's continuation when its words are words of it in a row, a word
being a maximal run of letters and digits (:func:`found`); a prompt is answered when every value
is found.
"""

from __future__ import annotations

import itertools
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import UserError

MAX_WORDS = 40  # a sentence or clause of the haystack longer than this is cut into pieces
ROUNDS = 4  # exact measurements of a prompt while fitting its haystack to the length
MULTI = 4  # keys of multi_key, values of multi_value, variables per chain of variable_tracking

_ADJECTIVES = ("amber", "brisk", "copper", "dusty", "early", "faint", "gentle", "hollow",
               "idle", "jolly", "kind", "lunar", "misty", "noble", "olive", "plain", "quiet",
               "rapid", "silver", "tidy", "upper", "vivid", "wild", "young")
_NOUNS = ("anchor", "badger", "candle", "delta", "ember", "falcon", "garden", "harbor",
          "island", "jacket", "kettle", "lantern", "meadow", "needle", "orchard", "pepper",
          "quarry", "river", "saddle", "thistle", "valley", "willow", "yard", "zephyr")


@dataclass(frozen=True)
class Needles:
    """What a task hides and asks: the instruction before the haystack, the question after it,
    the values expected, the statements asked about (the first at the depth, the others at
    random boundaries after it, in order) and other statements (each group in order at random
    boundaries anywhere)."""

    intro: str
    question: str
    answers: tuple[str, ...]
    asked: tuple[str, ...]
    others: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Sample:
    """One prompt: its text, its token ids as the model reads them (:meth:`Haystack.ids`), the
    values expected and the tokens allowed for the answer; ``needle`` is the statement at the
    depth."""

    task: str
    length: int
    depth: float
    seed: int
    prompt: str
    ids: tuple[int, ...] = field(repr=False)
    answers: tuple[str, ...]
    max_new_tokens: int
    needle: str


def sentences(text: str) -> list[str]:
    """The sentences and clauses of ``text`` (whitespace collapsed; cut after ``.``, ``!``,
    ``?``, ``;`` or ``:``), each longer than ``MAX_WORDS`` words cut into pieces of
    ``MAX_WORDS`` words."""
    pieces = []
    for sentence in re.split(r"(?<=[.!?;:]) ", " ".join(text.split())):
        words = sentence.split(" ")
        pieces += [" ".join(words[i : i + MAX_WORDS]) for i in range(0, len(words), MAX_WORDS)]
    return [piece for piece in pieces if piece]


class Haystack:
    """A text cut into sentences, and the tokenizer that measures prompts made of them."""

    def __init__(self, text: str, tokenizer) -> None:
        self.sentences = sentences(text)
        if not self.sentences:
            raise UserError("the haystack text holds no words")
        self.tokenizer = tokenizer
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        self.prefix = probe[: _find(probe, plain)]  # the tokens put before a text (BOS)
        self._counts: dict[int, int] = {}

    def ids(self, text: str) -> list[int]:
        """The token ids of a prompt: the special tokens the tokenizer puts before a text (a
        BOS, where it adds one), then the text's own; none after it (an end of text would
        end the prompt)."""
        return [*self.prefix, *self.count_ids(text)]

    def count_ids(self, text: str) -> list[int]:
        """The token ids of ``text`` alone, without special tokens."""
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def sentence(self, i: int) -> str:
        """Sentence ``i``, modulo the sentences (the text read again from its start)."""
        return self.sentences[i % len(self.sentences)]

    def tokens(self, i: int) -> int:
        """Tokens of :meth:`sentence` ``i`` alone."""
        i %= len(self.sentences)
        if i not in self._counts:
            self._counts[i] = len(self.count_ids(self.sentences[i]))
        return self._counts[i]


def _find(ids: list[int], part: list[int]) -> int:
    """Where ``part`` starts in ``ids`` (0 if it is not there)."""
    return next((i for i in range(len(ids)) if ids[i : i + len(part)] == part), 0)


def _words(text: str) -> list[str]:
    """The words of ``text``: its maximal runs of letters and digits."""
    return re.findall(r"[^\W_]+", text)


def found(continuation: str, answers: tuple[str, ...] | list[str]) -> bool:
    """Whether the words of every value of ``answers`` are words of ``continuation`` in a row
    (``12345`` is found in ``is 12345.``, not in ``123456``; ``kilo lima`` in ``kilo, lima``,
    not in ``lima kilo``)."""
    words = _words(continuation)

    def within(value: list[str]) -> bool:
        return any(words[i : i + len(value)] == value for i in range(len(words)))

    return all(within(_words(answer)) for answer in answers)


TASKS: dict[str, Callable[[Haystack, int, float, int], Sample]] = {}


def register_task(name: str, needles: Callable[[random.Random], Needles]) -> None:
    """Make task ``name`` of a function that draws its :class:`Needles` from a
    ``random.Random``: ``TASKS[name](haystack, length, depth, seed)`` gives its prompts."""

    def generate(haystack: Haystack, length: int, depth: float, seed: int) -> Sample:
        rng = random.Random(f"{name}/{seed}")
        return compose(name, needles(rng), haystack, length, depth, seed, rng)

    TASKS[name] = generate


def make(task: str, haystack: Haystack, length: int, depth: float, seed: int) -> Sample:
    """The prompt of ``task`` (a name of :data:`TASKS`) of at most ``length`` tokens,
    prompt and answer together, its first asked statement at ``depth``."""
    if task not in TASKS:
        raise UserError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    if not 0 <= depth <= 1:
        raise UserError(f"a depth is a fraction of the haystack in [0, 1], got {depth}")
    return TASKS[task](haystack, length, depth, seed)


FAR = 10  # a far needle's depth lies in the first 1/FAR of the haystack, farthest back


def draw_depth(rng, far: float = 0.0) -> float:
    """A needle's depth for training prompts: uniform in [0, 1], or with probability ``far``
    uniform in [0, 1/:data:`FAR`]. ``rng`` is a NumPy generator; without ``far`` it draws one
    number only (the draws of runs without it stay as they were)."""
    depth = float(rng.random())
    if far and rng.random() < far:
        depth /= FAR
    return depth


def compose(task: str, needles: Needles, haystack: Haystack, length: int, depth: float,
            seed: int, rng: random.Random) -> Sample:
    """The prompt of ``needles``: the haystack from a random sentence on, whole sentences
    then the first words of the next, as many as the prompt holds within ``length`` less the
    answer's tokens (:func:`answer_tokens`)."""
    new_tokens = answer_tokens(haystack, needles.answers)
    budget = length - new_tokens
    start = rng.randrange(len(haystack.sentences))
    after = sorted(rng.random() for _ in needles.asked[1:])
    others = [sorted(rng.random() for _ in group) for group in needles.others]
    filler: list[int] = []

    def build(tail: str = "") -> tuple[str, list[int]]:
        units = [haystack.sentence(i) for i in filler]
        counts = [haystack.tokens(i) for i in filler]
        if tail:
            units.append(tail)
            counts.append(len(haystack.count_ids(tail)))
        prompt = _prompt(needles, units, counts, depth, after, others)
        return prompt, haystack.ids(prompt)

    if (empty := len(build()[1])) > budget:
        raise UserError(f"{task} needs {empty + new_tokens} tokens without any haystack: "
                        f"a length of {length} is too short")
    for _ in range(ROUNDS):
        if not _fit(haystack, filler, start, budget - len(build()[1])):
            break
    while len(build()[1]) > budget:
        filler.pop()
    words = haystack.sentence(start + len(filler)).split(" ")
    k = _words_within(haystack, words, budget - len(build()[1]))
    while len((built := build(" ".join(words[:k])))[1]) > budget:
        k -= 1
    return Sample(task, length, depth, seed, built[0], tuple(built[1]), needles.answers,
                  new_tokens, needles.asked[0])


def answer_tokens(haystack: Haystack, answers: tuple[str, ...]) -> int:
    """Tokens a model may generate: those of the answers written out (``" a, b"``), half as
    many again and 4 more (room for its own wording)."""
    n = len(haystack.count_ids(" " + ", ".join(answers)))
    return n + n // 2 + 4


def _fit(haystack: Haystack, filler: list[int], start: int, gap: int) -> bool:
    """Add or remove sentences at the end of ``filler`` (sentence indices from ``start``) by
    about ``gap`` tokens, counting each sentence alone; whether it changed."""
    changed = False
    while gap < 0 and filler:
        gap += haystack.tokens(filler.pop())
        changed = True
    while haystack.tokens(start + len(filler)) <= gap:
        gap -= haystack.tokens(start + len(filler))
        filler.append(start + len(filler))
        changed = True
    return changed


def _words_within(haystack: Haystack, words: list[str], gap: int) -> int:
    """How many of the first ``words`` take fewer than ``gap`` tokens alone (one is left for
    the space before them)."""
    k = 0
    while k < len(words) and len(haystack.count_ids(" ".join(words[: k + 1]))) < gap:
        k += 1
    return k


def _prompt(needles: Needles, units: list[str], counts: list[int], depth: float,
            after: list[float], others: list[list[float]]) -> str:
    """The instruction, the haystack's ``units`` (of ``counts`` tokens) with the statements
    inserted at their boundaries, then the question."""
    ends = list(itertools.accumulate(counts, initial=0))
    n, at = len(units), min(range(len(ends)), key=lambda j: abs(ends[j] - depth * ends[-1]))
    placed = [(at, 0, needles.asked[0])]
    placed += [(at + round(u * (n - at)), 0, s) for u, s in zip(after, needles.asked[1:],
                                                                  strict=True)]
    for group, (spots, statements) in enumerate(zip(others, needles.others, strict=True), 1):
        placed += [(round(u * n), group, s) for u, s in zip(spots, statements, strict=True)]
    placed.sort(key=lambda p: p[:2])
    body = []
    for j, unit in enumerate([*units, None]):
        body += [s for spot, _, s in placed if spot == j]
        body += [unit] if unit is not None else []
    return f"{needles.intro}\n\n{' '.join(body)}\n\n{needles.question}"


def _keys(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct keys such as ``amber-lantern``."""
    pairs = rng.sample(range(len(_ADJECTIVES) * len(_NOUNS)), n)
    return [f"{_ADJECTIVES[p // len(_NOUNS)]}-{_NOUNS[p % len(_NOUNS)]}" for p in pairs]


def _numbers(rng: random.Random, n: int, digits: int) -> list[str]:
    """``n`` distinct numbers of ``digits`` digits."""
    return [str(v) for v in rng.sample(range(10 ** (digits - 1), 10**digits), n)]


_MAGIC = ("Special magic numbers are hidden in the text below. Remember them: you will be "
          "asked about them after the text.")


def passkey(rng: random.Random) -> Needles:
    [key] = _numbers(rng, 1, 5)
    return Needles("A pass key is hidden in the long text below. Find it and remember it: you "
                   "will be asked for it after the text.",
                   "What is the pass key? The pass key is", (key,),
                   (f"Here is the pass key: {key}. Keep {key} in mind.",))


_NATO = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india",
         "juliett", "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo",
         "sierra", "tango", "uniform", "victor", "whiskey", "xray", "yankee", "zulu")
KEY_WORDS = 8  # words of a word_passkey


def word_passkey(rng: random.Random) -> Needles:
    key = " ".join(rng.choices(_NATO, k=KEY_WORDS))
    return Needles("A pass key of words is hidden in the long text below. Find it and remember "
                   "it: you will be asked for it after the text.",
                   "What is the pass key? The pass key is", (key,),
                   (f"Here is the pass key: {key}. Keep it in mind.",))


def single_needle(rng: random.Random) -> Needles:
    [key], [value] = _keys(rng, 1), _numbers(rng, 1, 7)
    return Needles(_MAGIC, f"What is the special magic number for {key}? The special magic "
                   f"number for {key} is", (value,),
                   (f"The special magic number for {key} is {value}.",))


def multi_key(rng: random.Random) -> Needles:
    keys, values = _keys(rng, MULTI), _numbers(rng, MULTI, 7)
    statements = [f"The special magic number for {k} is {v}." for k, v in zip(keys, values,
                                                                                strict=True)]
    return Needles(_MAGIC, f"What is the special magic number for {keys[0]}? The special "
                   f"magic number for {keys[0]} is", (values[0],), (statements[0],),
                   tuple((s,) for s in statements[1:]))


def multi_value(rng: random.Random) -> Needles:
    [key], values = _keys(rng, 1), _numbers(rng, MULTI, 7)
    return Needles(_MAGIC, f"What are all the special magic numbers for {key}? The special "
                   f"magic numbers for {key} are", tuple(values),
                   tuple(f"One special magic number for {key} is {v}." for v in values))


def variable_tracking(rng: random.Random) -> Needles:
    names: list[str] = []
    while len(names) < 2 * MULTI:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names += [name] if name not in names else []
    value, other = _numbers(rng, 2, 5)

    def chain(variables: list[str], number: str) -> tuple[str, ...]:
        return (f"VAR {variables[0]} = {number}.",
                *(f"VAR {b} = {a}." for a, b in itertools.pairwise(variables)))

    return Needles("Variables are assigned values in the text below. Follow the assignments: "
                   "you will be asked about them after the text.",
                   f"Which variables hold the value {value}? The variables that hold {value} "
                   "are", tuple(names[:MULTI]), chain(names[:MULTI], value),
                   (chain(names[MULTI:], other),))


for _task in (passkey, single_needle, multi_key, multi_value, variable_tracking, word_passkey):
    register_task(_task.__name__, _task)
