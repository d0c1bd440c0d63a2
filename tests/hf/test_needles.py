"""The prompts of adaspan longeval (adaspan.hf.needles): lengths, depths, seeds, scoring."""

from __future__ import annotations

import re

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import ByT5Tokenizer, PreTrainedTokenizerFast

from adaspan.data.corpora import load_corpus
from adaspan.errors import UserError
from adaspan.hf.needles import (
    FAR,
    TASKS,
    Haystack,
    Needles,
    draw_depth,
    found,
    make,
    register_task,
    sentences,
)

# every statement a task hides, whatever its values (the templates of adaspan.hf.needles)
STATEMENT = re.compile(r"Here is the pass key: \d+\. Keep \d+ in mind\.|(The|One) special magic "
                       r"number for [a-z]+-[a-z]+ is \d+\.|VAR [A-Z]+ = \w+\.|"
                       r"Here is the pass key: [a-z ]+\. Keep it in mind\.")


@pytest.fixture(scope="module")
def text() -> str:
    return bytes(load_corpus("kjv", progress=False).test).decode()


def bpe(text: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE of 600 tokens learnt on ``text`` that puts <s> before every text."""
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    model.train_from_iterator([text[:100_000]], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()), length=100_000)
    model.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                         special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def haystack(request, text) -> Haystack:
    tokenizer = ByT5Tokenizer(extra_ids=0) if request.param == "bytes" else bpe(text)
    return Haystack(text, tokenizer)


def count(haystack: Haystack, text: str) -> int:
    return len(haystack.count_ids(text))


def test_the_six_tasks_are_registered():
    assert list(TASKS) == ["passkey", "single_needle", "multi_key", "multi_value",
                           "variable_tracking", "word_passkey"]


@pytest.mark.parametrize("length", [600, 2048])
@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_and_answer_fit_the_length_and_fill_it(haystack, task, length):
    sample = make(task, haystack, length, 0.5, 1)
    assert list(sample.ids) == haystack.ids(sample.prompt)
    assert sample.ids[: len(haystack.prefix)] == tuple(haystack.prefix)
    room = length - sample.max_new_tokens
    assert room - 16 <= len(sample.ids) <= room  # filled to the last words that fit
    assert sample.max_new_tokens >= count(haystack, " " + ", ".join(sample.answers))
    assert sample.needle in sample.prompt and all(a in sample.prompt for a in sample.answers)


def test_the_bpe_tokenizer_puts_its_bos_first_and_bytes_none(haystack):
    assert haystack.prefix == ([0] if isinstance(haystack.tokenizer, PreTrainedTokenizerFast)
                               else [])


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("task", list(TASKS))
def test_the_needle_sits_at_its_depth_of_the_haystack(haystack, task, depth):
    """Tokens of haystack (statements left out) before the needle: depth x the haystack's,
    within a sentence."""
    sample = make(task, haystack, 1500, depth, 2)
    body = sample.prompt.split("\n\n")[1]
    at = body.index(sample.needle)
    before, whole = (" ".join(STATEMENT.sub(" ", part).split()) for part in (body[:at], body))
    assert STATEMENT.search(whole) is None
    sentence = max(count(haystack, s) for s in sentences(whole))
    assert abs(count(haystack, before) - depth * count(haystack, whole)) <= sentence


def test_the_same_seed_gives_the_same_prompt_and_another_seed_another(haystack):
    for task in TASKS:
        first, again = make(task, haystack, 800, 0.4, 7), make(task, haystack, 800, 0.4, 7)
        assert first == again and first.ids == again.ids
        assert make(task, haystack, 800, 0.4, 8).prompt != first.prompt
        deeper = make(task, haystack, 800, 0.9, 7)  # the same statements, elsewhere
        assert deeper.answers == first.answers and deeper.prompt != first.prompt


def test_what_each_task_hides_and_asks(haystack):
    keys = make("multi_key", haystack, 1000, 0.5, 3)
    hidden = re.findall(r"magic number for ([a-z-]+) is (\d+)\.", keys.prompt)
    assert len(dict(hidden)) == len(set(dict(hidden).values())) == 4  # distinct keys, values
    assert keys.answers[0] in dict(hidden).values()
    asked = re.search(r"magic number for ([a-z-]+)\?", keys.prompt)[1]
    assert dict(hidden)[asked] == keys.answers[0]
    values = make("multi_value", haystack, 1000, 0.5, 3)
    assert len(values.answers) == 4 and all(f"is {v}." in values.prompt for v in values.answers)
    chain = make("variable_tracking", haystack, 1000, 0.5, 3)
    assignments = dict(re.findall(r"VAR ([A-Z]+) = (\w+)\.", chain.prompt))
    value = re.search(r"hold the value (\d+)\?", chain.prompt)[1]

    def holds(name: str) -> str:
        return name if name.isdigit() else holds(assignments[name])

    assert sorted(n for n in assignments if holds(n) == value) == sorted(chain.answers)
    assert len(assignments) == 8 and len(chain.answers) == 4
    passkey = make("passkey", haystack, 1000, 0.5, 3)
    assert re.fullmatch(r"\d{5}", passkey.answers[0]) and passkey.needle.count(
        passkey.answers[0]) == 2
    words = make("word_passkey", haystack, 1000, 0.5, 3)
    [key] = words.answers
    assert re.fullmatch(r"[a-z]+( [a-z]+){7}", key) and words.prompt.count(key) == 1
    assert words.needle == f"Here is the pass key: {key}. Keep it in mind."


def test_exact_scoring():
    assert found("The pass key is 12345.", ("12345",))
    assert found(" 12345\n", ("12345",))
    assert not found(" 54321", ("12345",))  # a wrong answer
    assert not found(" 123456 and 012345", ("12345",))  # the value inside a longer word
    assert found(" 4, 3; 2 and 1", ("1", "2", "3", "4"))  # every value, in any order
    assert not found(" 4, 3 and 2", ("1", "2", "3", "4"))  # a partial multi-value answer
    assert found("VAR ABCDE, VAR FGHIJ", ("FGHIJ", "ABCDE")) and not found("ABCDEF", ("ABCDE",))
    assert found(" kilo lima alpha.", ("kilo lima alpha",))  # a value of words: in a row
    assert found(" kilo, lima, alpha", ("kilo lima alpha",))
    assert not found(" kilo alpha lima", ("kilo lima alpha",))  # in another order
    assert not found(" kilo lima", ("kilo lima alpha",)) and not found("", ("kilo",))


def test_a_short_haystack_is_read_again_from_its_start(haystack):
    short = Haystack("One line. Another line! A third one?", haystack.tokenizer)
    assert short.sentences == ["One line.", "Another line!", "A third one?"]
    sample = make("single_needle", short, 700, 0.5, 0)
    assert sample.prompt.count("Another line!") > 5 and len(sample.ids) <= 700


def test_long_sentences_are_cut():
    assert [len(s.split()) for s in sentences("word " * 100)] == [40, 40, 20]


def test_bad_requests_are_one_line_errors(haystack):
    with pytest.raises(UserError, match="unknown task 'nope'; the tasks are passkey"):
        make("nope", haystack, 1000, 0.5, 0)
    with pytest.raises(UserError, match=r"depth is a fraction .* got 1.5"):
        make("passkey", haystack, 1000, 1.5, 0)
    with pytest.raises(UserError, match="a length of 100 is too short"):
        make("variable_tracking", haystack, 100, 0.5, 0)
    with pytest.raises(UserError, match="holds no words"):
        Haystack(" \n ", haystack.tokenizer)


def test_a_registered_task_is_made_like_the_others(haystack):
    def echo(rng) -> Needles:
        word = rng.choice(["alpha", "beta"])
        return Needles("Read this.", "Which word? The word is", (word,),
                       (f"The word is {word}.",))

    register_task("echo", echo)
    try:
        sample = make("echo", haystack, 500, 0.0, 0)
        assert sample.prompt.startswith(f"Read this.\n\nThe word is {sample.answers[0]}.")
    finally:
        del TASKS["echo"]


def test_draw_depth_without_far_is_one_uniform_draw():
    """Without ``far`` a depth is the generator's next number, so that training runs from before
    the choice draw the same prompts."""
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    assert [draw_depth(a) for _ in range(50)] == [float(b.random()) for _ in range(50)]


@pytest.mark.parametrize("far", [0.25, 1.0])
def test_draw_depth_puts_a_share_far_back(far):
    """A share ``far`` of the depths lies in the first 1/FAR of the haystack (the rest, uniform
    in [0, 1], fall there a tenth of the time): 2,000 draws within 4 standard deviations."""
    rng = np.random.default_rng(0)
    depths = np.array([draw_depth(rng, far) for _ in range(2000)])
    share = far + (1 - far) / FAR
    assert depths.min() >= 0 and depths.max() <= 1
    assert abs((depths <= 1 / FAR).mean() - share) <= 4 * (share * (1 - share) / 2000) ** 0.5
    assert far == 1 or depths.max() > 0.9
