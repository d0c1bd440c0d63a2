"""Synthetic long-range corpora: the text is what the spec says, each character's distance to
what it repeats is right, and a model sees the copies only with a span that reaches them."""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest

from adaspan.cli import main
from adaspan.config import ModelConfig, TrainConfig
from adaspan.data.corpora import BlockStream, load_corpus, source_distance
from adaspan.data.synthetic import DEFAULTS, parse, synthesize
from adaspan.errors import UserError
from adaspan.run.checkpoint import load_model
from adaspan.training.evaluate import bpc_by_distance, evaluate
from adaspan.training.train import train

COPY = "synthetic:copy?min=40&max=60&segment=8&gap_min=5&gap_max=9&length=20000&seed=3"
WORDS = "synthetic:words?vocab=300&skew=1.1&length=20000&seed=4"


def test_same_spec_same_text_other_seed_other_text():
    for spec in (COPY, WORDS):
        first, again = synthesize(spec), synthesize(spec)
        assert np.array_equal(first.tokens, again.tokens)
        assert np.array_equal(first.distance, again.distance)
        assert not np.array_equal(first.tokens, synthesize(spec.replace("seed=", "seed=1")).tokens)
        assert len(first.tokens) == len(first.distance) == 20000


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of every run of True in ``mask``."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1), strict=True))


def test_copy_segments_repeat_the_text_their_distance_back():
    corpus = synthesize(COPY)
    tokens, distance = corpus.tokens, corpus.distance
    assert set(tokens.tobytes()) <= set(b"abcdefghijklmnopqrstuvwxyz")
    where = np.flatnonzero(distance)
    assert np.array_equal(tokens[where], tokens[where - distance[where]])
    segments = _runs(distance > 0)
    assert len(segments) > 200
    for start, end in segments[:-1]:  # the last may be cut by the end of the text
        assert end - start == 8 and len(set(distance[start:end])) == 1
        assert 40 <= distance[start] <= 60
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(segments)]
    assert min(gaps) >= 5 and max(gaps) <= 9
    assert segments[0][0] >= 60 + 5  # the first copy has max characters before it
    assert corpus.needs(50).sum() == (distance >= 50).sum() > 0


def test_words_repeat_their_previous_occurrence():
    corpus = synthesize(WORDS)
    text = corpus.tokens.tobytes().decode()
    assert re.fullmatch(r"[a-z ]+", text)
    # independently: each whole word's letters after the first, and its space, repeat the
    # previous occurrence of that word, at the distance between the two starts
    expected = np.zeros(len(text), dtype=np.int64)
    last: dict[str, int] = {}
    for match in re.finditer(r"[a-z]+ ?", text):
        word, start = match.group().strip(), match.start()
        if word in last and match.end() <= len(text):
            expected[start + 1 : match.end()] = start - last[word]
        last[word] = start
    whole = text.rindex(" ") + 1  # the last word may be cut by the end of the text
    assert np.array_equal(corpus.distance[:whole], expected[:whole])
    spread = corpus.distance[corpus.distance > 0]
    assert spread.min() < 20 and np.percentile(spread, 90) > 1000  # tens to thousands


def test_splits_carry_their_distances():
    corpus = load_corpus(COPY)
    assert corpus.name == COPY and len(corpus.train) == 18000
    distance = source_distance(COPY, "valid")
    assert len(distance) == len(corpus.valid)
    assert np.array_equal(distance, synthesize(COPY).distance[18000:19000])
    with pytest.raises(UserError, match="not a synthetic corpus"):
        source_distance("kjv", "valid")


@pytest.mark.parametrize("spec, message", [
    ("synthetic:cpy", "unknown synthetic corpus 'cpy'; expected one of synthetic:copy, "
                      "synthetic:words"),
    ("synthetic:copy?mn=3", "has no parameter 'mn'; it takes min, max"),
    ("synthetic:copy?min=x", "min='x' is not an integer"),
    ("synthetic:copy?min=900", "min must be in [1, max], got 900"),
    ("synthetic:copy?segment=300", "segment must be in [1, min], got 300"),
    ("synthetic:words?skew=-1", "skew must be >= 0, got -1"),
    ("synthetic:words?length=10", "length must be >= 1000"),
    ("synthetic:words?vocab", "'vocab' is not key=value"),
    ("synthetic:words?vocab=", "vocab='' is not an integer"),
])
def test_bad_specs_are_refused_by_name(spec, message):
    with pytest.raises(UserError) as error:
        load_corpus(spec)
    assert message in str(error.value)


def test_defaults_are_documented_and_valid():
    for kind, params in DEFAULTS.items():
        assert parse(f"synthetic:{kind}") == (kind, params)
    assert parse("synthetic:copy?min=5&max=7&segment=5")[1]["max"] == 7


def test_cli_trains_on_a_synthetic_corpus_and_refuses_a_bad_one(tmp_path, capsys):
    assert main(["train", "--preset", "demo", f"data={COPY}", "n_layers=1", "d_model=16",
                 "n_heads=2", "d_inner=16", "max_span=64", "steps=2", "batch_size=2",
                 "block_size=16", "eval_chars=64", "tensorboard=false", "--run-dir",
                 str(tmp_path / "run"), "--no-progress"]) == 0
    assert "synthetic:copy?min=40" in capsys.readouterr().out
    assert main(["evaluate", str(tmp_path / "run"), "--no-progress"]) == 0  # spec kept as is
    assert main(["train", "data=synthetic:nope", "--run-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["adaspan: error: 'synthetic:nope': unknown synthetic corpus 'nope'; "
                   "expected one of synthetic:copy, synthetic:words"]


# ------------------------------------------- a model predicts the copies only if it sees them

DISTANCE = 24
TASK = (f"synthetic:copy?min={DISTANCE}&max={DISTANCE}&segment=16&gap_min=8&gap_max=16"
        "&length=200000")


def _bits(run, long_range: bool) -> float:
    """bpc of ``run`` on the valid characters that repeat the text DISTANCE back (or the
    others), scored as one stream."""
    scored = evaluate(load_model(run), load_corpus(TASK).valid, batch_size=1, block_size=64,
                      token_logprobs=True)["token_logprobs"]
    needs = source_distance(TASK, "valid")[1:] >= DISTANCE  # targets are characters 1..n
    return -scored[needs == long_range].mean() / math.log(2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    runs = {}
    for span in (16, 32):  # short of the distance, past it
        model = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_inner=64, max_span=span,
                            ramp=8, attention="fixed", dropout=0.0)
        config = TrainConfig(data=TASK, steps=500, batch_size=16, block_size=64, lr=1e-2,
                             optimizer="adamw", warmup=20, clip=1.0, clip_mode="global",
                             eval_interval=500, eval_chars=4096, checkpoint_interval=500,
                             log_interval=500, tensorboard=False, device="cpu")
        runs[span] = tmp_path_factory.mktemp(f"span{span}")
        train(model, config, runs[span], progress=False, log=lambda line: None)
    return runs


def test_a_span_past_the_distance_predicts_the_copies(trained):
    uniform = math.log2(26)
    assert _bits(trained[32], long_range=True) < 0.5 * uniform
    assert _bits(trained[16], long_range=True) > 0.95 * uniform  # it cannot see them
    for span in (16, 32):  # fresh letters are unpredictable for both
        assert _bits(trained[span], long_range=False) > 0.95 * uniform


def test_cli_evaluate_reports_bpc_by_distance(trained, capsys):
    assert main(["evaluate", str(trained[32]), "--batch-size", "1", "--block-size", "64",
                 "--no-progress", "--json"]) == 0
    groups = json.loads(capsys.readouterr().out)["by_distance"]
    assert [(g["from"], g["to"]) for g in groups] == [(0, 0), (1, 32)]  # 24 falls in [1, 32)
    assert groups[1]["bpc"] == pytest.approx(_bits(trained[32], long_range=True), abs=1e-3)
    assert groups[0]["bpc"] == pytest.approx(_bits(trained[32], long_range=False), abs=1e-3)
    assert main(["evaluate", str(trained[32]), "--no-progress"]) == 0
    assert "by the distance back to the character repeated" in capsys.readouterr().out


def test_bpc_by_distance_reads_each_target_of_each_stream():
    tokens = np.arange(1000) % 256
    distance = np.arange(1000) * 3  # a distinct "distance" per character: checks the mapping
    stream = BlockStream(tokens, 4, 16)
    targets = np.concatenate([distance[1 + b * stream.stream_len:][: stream.num_chars // 4]
                              for b in range(4)])
    scored = -np.log(2) * (targets % 7).astype(np.float32)  # a target's bits: distance mod 7
    result = {"streams": 4, "stream_chars": stream.stream_len, "token_logprobs": scored}
    groups = bpc_by_distance(result, distance, edges=(1, 300, 1200))
    for group in groups:
        low, high = group["from"], group["to"] if group["to"] is not None else np.inf
        chosen = (targets >= low) & ((targets <= 0) if high == 0 else (targets < high))
        assert group["chars"] == chosen.sum()
        assert group["bpc"] == pytest.approx((targets[chosen] % 7).mean())
    assert sum(g["chars"] for g in groups) == len(targets)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_learned_spans_grow_to_a_distance_on_their_ramp(tmp_path, dtype):
    """The documented recipe: spans get gradient only from keys on their ramp, so with a ramp
    that reaches the distance from the start (R = 32 > 24, z = 0) they grow to it and the
    copies are learned, in fp32 as under bf16 autocast. Once z passes 24 the copies sit off
    the ramp and give z no more gradient, so z settles about there (its last digits differ
    between runs of other thread counts or kernels); at z >= 18 the mask at distance 24 is
    (R + z - 24) / R >= 0.81."""
    model = ModelConfig(n_layers=1, d_model=32, n_heads=2, d_inner=64, max_span=128, ramp=32,
                        attention="adaptive", dropout=0.0)
    config = TrainConfig(data=TASK, steps=500, batch_size=16, block_size=64, lr=1e-2,
                         optimizer="adamw", warmup=20, clip=1.0, clip_mode="global",
                         eval_interval=500, eval_chars=4096, checkpoint_interval=500,
                         log_interval=500, tensorboard=False, device="cpu", dtype=dtype)
    summary = train(model, config, tmp_path, progress=False, log=lambda line: None)
    assert max(summary["spans"][0]) >= model.ramp + 0.75 * DISTANCE  # z + R, from 32
    assert _bits(tmp_path, long_range=True) < 0.5 * math.log2(26)
