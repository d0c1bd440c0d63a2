"""Runs of every tokenizer from the command line: train, resume bit for bit, evaluate (bits per
byte of the text, perplexity), generate whole tokens; the one-line errors of bad tokenizer
input. The tokenizers themselves: test_tokenizer.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from adaspan.cli import main
from adaspan.data.corpora import load_corpus
from adaspan.data.tokenizer import BYTE_SYMBOLS, EOS, UNK, BPETokenizer, WordTokenizer
from adaspan.resolve import resolve_config
from adaspan.run.checkpoint import RunDir, load_model
from adaspan.run.metrics import read_metrics
from adaspan.run.tokens import outside, run_codec, run_split, saved_tokenizer
from adaspan.training.evaluate import evaluate

TINY = ["n_layers=1", "d_model=16", "n_heads=2", "d_inner=32", "max_span=64", "ramp=8",
        "batch_size=2", "block_size=16", "eval_chars=128", "eval_interval=2", "log_interval=1",
        "checkpoint_interval=2", "tensorboard=false", "dropout=0.1"]
VOCAB = {"bytes": 256, "words": 300, "bpe": 300}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """40,000 bytes of the bundled corpus (36,000 train bytes: thousands of words)."""
    path = tmp_path_factory.mktemp("data") / "kjv40k.txt"
    path.write_bytes(load_corpus("kjv", progress=False).train[:40_000].tobytes())
    return path


def options(corpus: Path, cache: Path, tokenizer: str, *more: str) -> list[str]:
    return ["--preset", "demo", "--no-progress", *TINY, f"data={corpus}", f"data_dir={cache}",
            f"tokenizer={tokenizer}", f"vocab_size={VOCAB[tokenizer]}", *more]


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adaspan: error: "), err
    return err[0]


@pytest.mark.parametrize("tokenizer", ["bytes", "words", "bpe"])
def test_a_run_of_each_tokenizer_resumes_bit_for_bit(tmp_path, corpus, tokenizer, capsys):
    cache = tmp_path / "cache"
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    assert main(["train", "--run-dir", str(straight), *options(corpus, cache, tokenizer),
                 "steps=4"]) == 0
    assert main(["train", "--run-dir", str(halves), *options(corpus, cache, tokenizer),
                 "steps=2"]) == 0
    assert main(["train", "--resume", str(halves), "--no-progress", "steps=4"]) == 0
    assert last_json(capsys)["steps"] == 4
    a, b = load_model(straight).state_dict(), load_model(halves).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    saved = saved_tokenizer(halves)
    assert saved.name == tokenizer and saved.vocab_size == VOCAB[tokenizer]
    saved_files = (RunDir(path).tokenizer_file.read_bytes() for path in (halves, straight))
    assert next(saved_files) == next(saved_files)


@pytest.fixture(scope="module", params=["bytes", "words", "bpe"])
def trained(request, tmp_path_factory, corpus) -> tuple[str, Path]:
    """A run of each tokenizer, 4 steps, its caches in its own folder."""
    root = tmp_path_factory.mktemp(request.param)
    run = root / "run"
    assert main(["train", "--run-dir", str(run), *options(corpus, root / "cache", request.param),
                 "steps=4"]) == 0
    return request.param, run


def test_evaluate_gives_bits_per_byte_of_the_text_and_perplexity(trained, corpus, tmp_path,
                                                                  capsys):
    tokenizer, run = trained
    logprobs = tmp_path / "lp.npy"
    assert main(["evaluate", str(run), "--batch-size", "1", "--no-progress", "--json",
                 "--token-logprobs", str(logprobs)]) == 0
    result = last_json(capsys)
    nats = -np.load(logprobs).astype(np.float64).sum()
    tokens = run_split(run, "valid", progress=False).tokens
    text = load_corpus(str(corpus), progress=False).valid.tobytes()
    codec = run_codec(run)
    first = len(b"".join(codec.pieces(tokens[:1])))  # the one token that is no target
    covered = len(text) - first
    assert codec.decode(tokens) == text  # every tokenizer a run trains keeps the text
    assert result["bytes"] == covered and result["chars"] == len(tokens) - 1
    assert result["bpc"] == pytest.approx(nats / covered / math.log(2), rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(nats / result["chars"]), rel=1e-6)
    assert result["unit"] == {"bytes": "character", "words": "word", "bpe": "token"}[tokenizer]
    assert result["unk_bytes"] == 0 and result["bpc_lower_bound"] is False
    assert main(["evaluate", str(run), "--max-chars", "64", "--no-progress"]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert ("bpc over" in first_line) == (tokenizer == "bytes")
    assert ("perplexity" in first_line) == (tokenizer != "bytes")


def test_generation_streams_whole_tokens_of_the_run(trained, capsys):
    _, run = trained
    assert main(["generate", str(run), "--prompt", "And God said", "--length", "12", "--json",
                 "--seed", "3"]) == 0
    result = last_json(capsys)
    codec = run_codec(run)
    ids = codec.encode(result["text"].encode()).ids
    assert result["tokens"] == 12 and result["text"]
    assert codec.decode(ids) == result["text"].encode()  # lossless: re-encodable
    model = load_model(run)
    prompt = codec.encode(b"And God said").ids.tolist()
    generator = torch.Generator().manual_seed(3)
    from adaspan.measure.generate import stream
    sampled = list(stream(model, prompt, 12, 0.8, None, generator))
    assert b"".join(codec.pieces(sampled)).decode("utf-8", "replace") == result["text"]
    assert all(0 <= t < model.config.vocab_size for t in sampled)


def test_evaluate_scores_the_same_bytes_whatever_the_tokenizer(trained, corpus):
    """bits per byte is computed over the bytes of the text each target covers: with one
    stream, all of the split but the first token's, for every tokenizer."""
    _, run = trained
    split = run_split(run, "valid", progress=False)
    result = evaluate(load_model(run), split.tokens, batch_size=1, block_size=16,
                      ends=split.ends)
    text = load_corpus(str(corpus), progress=False).valid
    ends = split.ends if split.ends is not None else np.arange(1, len(text) + 1)
    assert int(ends[-1]) == len(text) and result["bytes"] == len(text) - int(ends[0])


def test_bits_per_byte_under_unk_is_flagged_as_a_lower_bound(corpus, tmp_path, capsys):
    """A run on a words vocabulary with <unk> (adaspan 0.8's format): evaluate says which share
    of the bytes is under <unk> and that the bpc is a lower bound, in the JSON and in words."""
    counts: dict[str, int] = {}
    for word in corpus.read_bytes().decode().split():
        counts[word] = counts.get(word, 0) + 1
    symbols = [EOS, UNK, *sorted(counts, key=counts.__getitem__, reverse=True)[:98]]
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"adaspan_tokenizer": "words", "version": 1, "min_count": 1,
                               "max_size": 100, "symbols": symbols}))
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *options(corpus, tmp_path, "words"),
                 f"tokenizer_file={old}", "vocab_size=100", "steps=2"]) == 0
    assert main(["evaluate", str(run), "--no-progress", "--json"]) == 0
    result = last_json(capsys)
    split = run_split(run, "valid", progress=False)
    targets = result["streams"] * result["stream_chars"]
    naive = sum(int(split.ends[j] - split.ends[j - 1]) for j in range(1, targets + 1)
                if split.tokens[j] == symbols.index(UNK))
    assert result["unk_bytes"] == naive > 0 and result["bpc_lower_bound"] is True
    assert result["unk_share"] == pytest.approx(naive / result["bytes"])
    assert main(["evaluate", str(run), "--no-progress"]) == 0
    first_line = capsys.readouterr().out.splitlines()[0]
    assert f"a lower bound: {naive / result['bytes']:.1%} of the bytes are under <unk>" in \
        first_line
    assert main(["report", str(run), "--limits", "64", "--no-memory"]) == 0
    page = (run / "report" / "report.html").read_text()
    assert "a lower bound:" in page and "of the bytes under &lt;unk&gt;" in page
    assert main(["bench", "--preset", "demo", *TINY, f"data={corpus}", f"data_dir={tmp_path}",
                 "tokenizer=words", f"tokenizer_file={old}", "vocab_size=100", "--steps", "1",
                 "--gen-chars", "4", "--json"]) == 0
    bench = last_json(capsys)
    valid = outside(saved_tokenizer(run), split.tokens, split.ends)[0]
    assert bench["unk_share"] == pytest.approx(valid) and valid > 0


def test_a_byte_preset_with_words_gets_a_words_vocabulary():
    assert resolve_config("demo", overrides=["tokenizer=words"])[0].vocab_size == \
        WordTokenizer.default_size == 8192
    assert resolve_config("demo", overrides=["tokenizer=bpe"])[0].vocab_size == \
        BPETokenizer.default_size == 4096
    for order in (["vocab_size=4096", "tokenizer=words"], ["tokenizer=words", "vocab_size=4096"]):
        assert resolve_config("demo", overrides=order)[0].vocab_size == 4096  # set together
    assert resolve_config("words-small")[0].vocab_size == 8192  # the preset sets both
    # a vocabulary set for another tokenizer is not reused: the tokenizer's own
    assert resolve_config("words-small", overrides=["tokenizer=bpe", "cutoffs=1024,2048"]
                          )[0].vocab_size == 4096
    assert resolve_config(overrides=["tokenizer=bytes"])[0].vocab_size == 256


def test_a_vocabulary_too_small_for_the_text_warns_with_the_figures(tmp_path, corpus, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *options(corpus, tmp_path, "words"),
                 "steps=1"]) == 0
    out = capsys.readouterr().out.splitlines()
    tokenizer = saved_tokenizer(run)
    ids = tokenizer.encode(load_corpus(str(corpus), progress=False).train).ids
    spelled = sum(len(piece) for id, piece in zip(ids, tokenizer.pieces(ids), strict=True)
                  if tokenizer.symbols[id] in BYTE_SYMBOLS)
    share = spelled / sum(len(piece) for piece in tokenizer.pieces(ids))
    assert share > 0.5
    (line,) = [line for line in out if line.startswith("warning:")]
    assert line == (f"warning: {share:.0%} of the train split's bytes are outside the "
                    f"300-token words vocabulary ({share:.0%} spelled byte by byte, 0% under "
                    "<unk>): a larger vocab_size fits this text better")
    assert main(["train", "--run-dir", str(tmp_path / "big"), *options(corpus, tmp_path, "words"),
                 "vocab_size=1571", "steps=1"]) == 0
    assert "warning:" not in capsys.readouterr().out


def valid_curve(run: Path, argv: list[str]) -> list[float]:
    """The validation bits per byte that training ``argv`` in ``run`` records, in order."""
    assert main(["train", "--run-dir", str(run), *argv]) == 0
    return [record["valid_bpc"] for record in read_metrics(RunDir(run).metrics_file)
            if record.get("valid_bpc") is not None]


def test_tied_adaptive_io_learns_at_the_recipes_learning_rate(tmp_path):
    """words-small's recipe (AdamW 3e-3) on a small model: tied adaptive input and softmax keep
    learning, close to untied (a vocabulary with <unk> stalls tied at full size: tokens.md)."""
    path = tmp_path / "kjv.txt"
    path.write_bytes(load_corpus("kjv", progress=False).train[:400_000].tobytes())
    argv = ["--preset", "words-small", "--no-progress", f"data={path}", f"data_dir={tmp_path}",
            "vocab_size=2048", "cutoffs=256,1024", "n_layers=2", "d_model=64", "d_inner=128",
            "n_heads=2", "max_span=64", "batch_size=8", "block_size=32", "steps=450",
            "eval_interval=150", "eval_chars=4096", "log_interval=150", "threads=1"]
    tied = valid_curve(tmp_path / "tied", [*argv, "tie_io=true"])
    untied = valid_curve(tmp_path / "untied", [*argv, "tie_io=false"])
    assert len(tied) == 3
    assert tied[0] - tied[1] > 0.03 and tied[1] - tied[2] > 0.03  # still learning at the end
    assert tied[-1] < untied[-1] + 0.1


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (["tokenizer=sentencepiece"], "tokenizer must be one of bytes, words, bpe"),
        (["tokenizer=words", "vocab_size=100000"], "distinct words"),
        (["tokenizer=bpe", "vocab_size=100000"], "ask for at most"),
        (["tokenizer=words", "vocab_size=301"], None),  # fits: no error (checked below)
        (["tokenizer=bytes", "vocab_size=100"], "vocab_size=100 does not fit the bytes"),
    ],
)
def test_bad_tokenizer_options_are_one_line_errors(tmp_path, corpus, more, message, capsys):
    argv = ["train", "--run-dir", str(tmp_path / "run"), "--preset", "demo", "--no-progress",
            *TINY, f"data={corpus}", f"data_dir={tmp_path / 'cache'}", "steps=1", *more]
    code = main(argv)
    if message is None:
        assert code == 0
        return
    assert code != 0 and message in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_a_corpus_without_whitespace_cannot_be_read_as_words(tmp_path, capsys):
    path = tmp_path / "dna.txt"
    rng = np.random.default_rng(0)
    path.write_bytes(bytes(rng.choice(list(b"ACGT"), 30_000)))
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--preset", "demo", *TINY,
                 "--no-progress", f"data={path}", f"data_dir={tmp_path}", "tokenizer=words",
                 "vocab_size=300"]) != 0
    assert "whitespace" in one_line_error(capsys)


def test_a_tokenizer_file_that_does_not_parse_is_one_line(tmp_path, corpus, capsys):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE", "vocab": ')
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--preset", "demo", *TINY,
                 "--no-progress", f"data={corpus}", f"data_dir={tmp_path}", "tokenizer=bpe",
                 f"tokenizer_file={bad}", "vocab_size=300"]) != 0
    assert str(bad) in one_line_error(capsys)


def test_a_tokenizer_file_of_another_run_is_used_as_it_is(trained, corpus, tmp_path, capsys):
    tokenizer, run = trained
    if tokenizer == "bytes":
        return  # nothing learned, nothing to reuse (tokenizer_file is refused: test_config)
    other = tmp_path / "other"
    assert main(["train", "--run-dir", str(other), *options(corpus, tmp_path, tokenizer),
                 f"tokenizer_file={RunDir(run).tokenizer_file}", "steps=1"]) == 0
    assert saved_tokenizer(other).to_json() == saved_tokenizer(run).to_json()
