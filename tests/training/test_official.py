"""convert-official: checkpoints of the authors' code, scored against a naive computation of
their equations written here from their tensors, or (persistent memory) against the output of
their code saved by scripts/fixtures/make_persistent_fixture.py (their model code is never
imported)."""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from adaspan.cli import main
from adaspan.config import ModelConfig, TrainConfig
from adaspan.data.authors_format import OfficialFormatError
from adaspan.data.corpora import load_corpus
from adaspan.model.lm import SpanLM
from adaspan.run.checkpoint import RunDir, load_model, load_weights
from adaspan.run.tokens import run_codec, run_split

S, R, D, HEADS, LAYERS, INNER = 80, 8, 16, 4, 2, 24
# current_val per layer and head: spans differ per head; in layer 1 every span is short, so
# their code trims 64 of the 80 keys before the softmax
CURRENT_VAL = [[0.0, 0.15, 0.5, 1.0], [0.0, 0.05, 0.1, 0.02]]
MASK = "attn.attn.adaptive_span._mask."
ALPHABET = b"abcd \n"


# ------------------------------------------------------------------------ the authors' side


def enwik8_style(text: bytes) -> str:
    """A file as their enwik8 preparation writes it: decimal bytes, a newline as a line break."""
    return " ".join("\n" if b == 10 else str(b) for b in text)


def symbols_of(text: bytes) -> list[str]:
    """The symbols their reader gets from ``enwik8_style(text)`` (no final newline: the last
    line gets its <eos> too)."""
    assert not text.endswith(b"\n")
    return ["<eos>" if b == 10 else str(b) for b in text] + ["<eos>"]


def random_text(rng: random.Random, n: int, alphabet: bytes = ALPHABET) -> bytes:
    body = bytes(rng.choice(alphabet) for _ in range(n - len(alphabet)))
    return alphabet + body + b"a"  # every symbol of the alphabet, no final newline


def write_data(path, train: bytes, valid: bytes, test: bytes):
    path.mkdir(parents=True, exist_ok=True)
    for name, text in (("train", train), ("valid", valid), ("test", test)):
        (path / f"{name}.txt").write_text(enwik8_style(text))
    return path


def authors_state(vocab_size: int, adaptive: bool = True, seed: int = 0) -> dict:
    """A state dict with the authors' names and shapes (no adaptive I/O, no persistent memory)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    state = {"in_emb.weight": rand(vocab_size, D), "out_emb.weight": rand(vocab_size, D, scale=0.3),
             "out_emb.bias": rand(vocab_size, scale=0.1), "key_pe": rand(1, D // HEADS, S)}
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        for proj in ("proj_query", "proj_key", "proj_val", "proj_out"):
            state[f"{p}attn.{proj}.weight"] = rand(D, D, scale=D**-0.5)
        if adaptive:
            state[f"{p}{MASK}current_val"] = torch.tensor(CURRENT_VAL[layer]).view(HEADS, 1, 1)
            state[f"{p}{MASK}mask_template"] = torch.linspace(1 - S, 0, S)
        for norm in ("norm1", "norm2"):
            state[f"{p}{norm}.weight"] = 1 + rand(D, scale=0.1)
            state[f"{p}{norm}.bias"] = rand(D, scale=0.1)
        state[f"{p}ff.fc1.weight"] = rand(INNER, D, scale=D**-0.5)
        state[f"{p}ff.fc1.bias"] = rand(INNER, scale=0.1)
        state[f"{p}ff.fc2.weight"] = rand(D, INNER, scale=INNER**-0.5)
        state[f"{p}ff.fc2.bias"] = rand(D, scale=0.1)
    return state


def save_authors_checkpoint(path, state: dict, iter_no: int = 41, prefix: str = "module."):
    torch.save({"iter_no": iter_no, "model": {prefix + k: v for k, v in state.items()},
                "optimizer": {"state": {}, "param_groups": [{"lr": 0.07, "params": [0]}]},
                "logger": {"val_bpc": [2.5, 2.1]}, "scheduler_iter": 12}, path)
    return path


def layer_norm(x, weight, bias):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias


def naive_authors_logprobs(state: dict, tokens: list[int], ramp: int = R) -> np.ndarray:
    """log p(token t+1 | tokens <= t) by the authors' equations, one token and head at a time,
    in float64, from a start of zero hidden states.

    Per layer they keep L = S - trim keys, trim = floor(min(S - 1, S - max_size) / 64) * 64 with
    max_size = ceil(max current_val * S) + R; for a query, column c of its row is the key at
    distance L - c and the position embedding key_pe[:, trim + c]; softmax over the L columns,
    times the mask clamp((template + current_val * S) / R + 1, 0, 1) of those columns, divided
    by (sum + 1e-8).
    """
    st = {k: v.double() for k, v in state.items()}
    key_pe = st["key_pe"][0]
    d_head = key_pe.shape[0]
    h = st["in_emb.weight"][torch.tensor(tokens)]
    T = len(tokens)
    for layer in range(LAYERS):
        p = f"layers.{layer}."
        adaptive = f"{p}{MASK}current_val" in st
        trim = 0
        if adaptive:
            current = st[f"{p}{MASK}current_val"].flatten()
            max_size = max(0, min(S, math.ceil(current.max().item() * S) + ramp))
            trim = math.floor(min(S - 1, S - max_size) / 64) * 64
        L = S - trim
        history = torch.cat([torch.zeros(L, D, dtype=torch.float64), h])  # text t at L + t
        q = h @ st[f"{p}attn.proj_query.weight"].t()
        k = history @ st[f"{p}attn.proj_key.weight"].t()
        v = history @ st[f"{p}attn.proj_val.weight"].t()
        heads_out = torch.zeros(T, D, dtype=torch.float64)
        for t in range(T):
            for head in range(D // d_head):
                cols = slice(head * d_head, (head + 1) * d_head)
                keys = k[t : t + L, cols]  # columns c = 0..L-1: distances L..1
                scores = (keys @ q[t, cols] + q[t, cols] @ key_pe[:, trim:]) / math.sqrt(d_head)
                weights = torch.softmax(scores, dim=0)
                if adaptive:
                    template = st[f"{p}{MASK}mask_template"][trim:]
                    mask = ((template + current[head] * S) / ramp + 1).clamp(0, 1)
                    weights = weights * mask
                    weights = weights / (weights.sum() + 1e-8)
                heads_out[t, cols] = weights @ v[t : t + L, cols]
        h = layer_norm(h + heads_out @ st[f"{p}attn.proj_out.weight"].t(),
                       st[f"{p}norm1.weight"], st[f"{p}norm1.bias"])
        inner = torch.relu(h @ st[f"{p}ff.fc1.weight"].t() + st[f"{p}ff.fc1.bias"])
        h = layer_norm(h + inner @ st[f"{p}ff.fc2.weight"].t() + st[f"{p}ff.fc2.bias"],
                       st[f"{p}norm2.weight"], st[f"{p}norm2.bias"])
    log_probs = torch.log_softmax(h @ st["out_emb.weight"].t() + st["out_emb.bias"], dim=-1)
    return log_probs[torch.arange(T - 1), torch.tensor(tokens[1:])].numpy()


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def texts():
    rng = random.Random(0)
    return {"train": random_text(rng, 300), "valid": random_text(rng, 150, ALPHABET + b"e"),
            "test": random_text(rng, 100)}


@pytest.fixture(scope="module")
def vocab(texts):
    """Their dictionary: first appearance over train, valid, test ('101' only in valid)."""
    order: dict[str, None] = {}
    for split in ("train", "valid", "test"):
        order.update(dict.fromkeys(symbols_of(texts[split])))
    return list(order)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, texts):
    return write_data(tmp_path_factory.mktemp("official") / "data", **texts)


def convert(tmp_path, state, data_dir, name="run", **save_options):
    checkpoint = save_authors_checkpoint(tmp_path / f"{name}.pt", state, **save_options)
    run = tmp_path / name
    assert main(["convert-official", str(checkpoint), str(run), "--data", str(data_dir),
                 "--ramp", str(R)]) == 0
    return run


def scored(run, data_dir, tmp_path, *options) -> tuple[np.ndarray, dict]:
    out = tmp_path / "logprobs.npy"
    assert main(["evaluate", str(run), "--data", str(data_dir), "--batch-size", "1",
                 "--block-size", "16", "--device", "cpu", "--no-progress", "--json",
                 "--token-logprobs", str(out), *options]) == 0
    return np.load(out), out


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory, data_dir, vocab):
    state = authors_state(len(vocab))
    return convert(tmp_path_factory.mktemp("adaptive"), state, data_dir), state


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adaspan: error: "), err
    return err[0]


# ------------------------------------------------------------------------------------- tests


def test_adaptive_checkpoint_matches_the_authors_equations(adaptive_run, data_dir, texts,
                                                           vocab, tmp_path, capsys):
    run, state = adaptive_run
    got, _ = scored(run, data_dir, tmp_path, "--split", "valid")
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tokens = [vocab.index(s) for s in symbols_of(texts["valid"])]
    want = naive_authors_logprobs(state, tokens)
    assert got.dtype == np.float32 and got.shape == (len(tokens) - 1,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert (result["dtype"], result["tf32"]) == ("float32", False)  # no --dtype: any CPU
    assert result["chars"] == len(tokens) - 1
    assert result["bpc"] == pytest.approx(-want.mean() / math.log(2), abs=1e-5)
    assert result["data"] == f"{data_dir} (authors' format)" and result["split"] == "valid"


def test_converted_run_holds_vocab_config_and_spans(adaptive_run, data_dir, vocab):
    run, _ = adaptive_run
    assert json.loads((run / "vocab.json").read_text()) == vocab
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["data"] == str(data_dir.resolve())
    model = load_model(run)
    config = model.config
    assert (config.attention, config.max_span, config.ramp, config.n_heads, config.n_layers,
            config.d_model, config.d_inner, config.vocab_size, config.dropout) == (
        "adaptive", S, R, HEADS, LAYERS, D, INNER, len(vocab), 0.2)
    # their z = current_val * S + 1, so the span z + R (at most S)
    want = [[min(S, c * S + 1 + R) for c in layer] for layer in CURRENT_VAL]
    np.testing.assert_allclose(model.spans(), want, atol=1e-4)
    assert load_weights(run, SpanLM(config)) == 41  # iter_no


def test_fixed_span_checkpoint(tmp_path, data_dir, texts, vocab):
    state = authors_state(len(vocab), adaptive=False, seed=1)
    run = convert(tmp_path, state, data_dir)
    assert load_model(run).config.attention == "fixed"
    got, _ = scored(run, data_dir, tmp_path, "--split", "test")
    tokens = [vocab.index(s) for s in symbols_of(texts["test"])]
    np.testing.assert_allclose(got, naive_authors_logprobs(state, tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("form", ["module-prefix", "bare", "bare-module-prefix"])
def test_checkpoint_forms_give_the_same_weights(form, adaptive_run, tmp_path, data_dir):
    reference, state = adaptive_run
    path = tmp_path / "ckpt.pt"
    if form == "module-prefix":
        save_authors_checkpoint(path, state, iter_no=41)
    else:
        prefix = "module." if form == "bare-module-prefix" else ""
        torch.save({prefix + k: v for k, v in state.items()}, path)
    assert main(["convert-official", str(path), str(tmp_path / "run"), "--data",
                 str(data_dir), "--ramp", str(R)]) == 0
    want, got = load_model(reference).state_dict(), load_model(tmp_path / "run").state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_generate_maps_byte_symbols(adaptive_run, capsys):
    run, _ = adaptive_run
    assert main(["generate", str(run), "--prompt", "ab\nc", "--length", "40",
                 "--temperature", "1.0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ab\nc") and len(out) == len("ab\nc") + 40 + 1
    assert set(out[4:-1].encode()) <= set(ALPHABET + b"e")


def test_generate_refuses_a_vocabulary_neither_of_bytes_nor_of_words(adaptive_run, tmp_path,
                                                                     vocab, capsys):
    run = tmp_path / "copy"
    shutil.copytree(adaptive_run[0], run)
    (run / "vocab.json").write_text(json.dumps(["_", *vocab[1:]]))
    assert main(["generate", str(run), "--length", "5", "--device", "cpu"]) != 0
    assert "vocab.json: a words vocabulary needs" in one_line_error(capsys)  # no <unk>


def test_unsupported_checkpoints(tmp_path, data_dir, vocab, capsys):
    extra = {"in_emb.emb_layers.0.weight": torch.zeros(3, 4)}
    path = save_authors_checkpoint(tmp_path / "c.pt", {**authors_state(len(vocab)), **extra})
    assert main(["convert-official", str(path), str(tmp_path / "run"), "--data",
                 str(data_dir)]) != 0
    line = one_line_error(capsys)  # adaptive input/output tensors next to plain ones
    assert "both in_emb.weight and adaptive input/output" in line
    assert not (tmp_path / "run").exists()


def test_unreadable_checkpoints(tmp_path, data_dir, capsys):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    # an object that only a full unpickler (weights_only=False) would build: refused
    torch.save({"model": {}, "args": argparse.Namespace(lr=0.07)}, tmp_path / "obj.pt")
    for name in ("junk.pt", "obj.pt", "missing.pt"):
        assert main(["convert-official", str(tmp_path / name), str(tmp_path / "run"),
                     "--data", str(data_dir)]) != 0
        assert name in one_line_error(capsys)


def test_vocabulary_size_mismatch(tmp_path, texts, vocab, capsys):
    other = write_data(tmp_path / "other", texts["train"], texts["valid"], b"xyz")
    path = save_authors_checkpoint(tmp_path / "c.pt", authors_state(len(vocab)))
    assert main(["convert-official", str(path), str(tmp_path / "run"), "--data",
                 str(other)]) != 0
    assert "wrong data directory" in one_line_error(capsys)


def test_refuses_a_non_empty_out_dir(adaptive_run, tmp_path, data_dir, vocab, capsys):
    path = save_authors_checkpoint(tmp_path / "c.pt", authors_state(len(vocab)))
    assert main(["convert-official", str(path), str(adaptive_run[0]), "--data",
                 str(data_dir)]) != 0
    assert "refusing to overwrite" in one_line_error(capsys)


def test_unknown_symbol_names_symbol_and_line(adaptive_run, tmp_path, texts, capsys):
    other = write_data(tmp_path / "other", texts["train"], texts["valid"], texts["test"])
    (other / "valid.txt").write_text("97 98\n99 100\n97 98 999 97\n")  # 999: never seen
    assert main(["evaluate", str(adaptive_run[0]), "--data", str(other), "--no-progress",
                 "--device", "cpu"]) != 0
    line = one_line_error(capsys)
    assert "'999'" in line and "line 3" in line and "valid.txt" in line


# ------------------------------------------------- persistent memory: their code's own output

PERSISTENT = Path(__file__).parents[1] / "fixtures" / "persistent"


@pytest.fixture(scope="module")
def persistent_case(tmp_path_factory):
    """The fixture of scripts/fixtures/make_persistent_fixture.py (their model code run once): its
    description, its texts and the data directory written from them."""
    case = json.loads((PERSISTENT / "cases.json").read_text())
    texts = {split: text.encode() for split, text in case["texts"].items()}
    return case, texts, write_data(tmp_path_factory.mktemp("persistent") / "data", **texts)


@pytest.mark.parametrize("span", ["adaptive", "fixed"])
def test_persistent_memory_checkpoint_matches_the_authors_code(span, persistent_case, tmp_path):
    case, texts, data = persistent_case
    order: dict[str, None] = {}  # their dictionary: first appearance over train, valid, test
    for split in ("train", "valid", "test"):
        order.update(dict.fromkeys(symbols_of(texts[split])))
    assert case["tokens"] == [list(order).index(s) for s in symbols_of(texts[case["split"]])]
    assert case["ramp"] == R
    run = convert(tmp_path, load_file(PERSISTENT / f"{span}.safetensors"), data)
    config = load_model(run).config
    assert (config.attention, config.persistent_span, config.persistent_size,
            config.feed_forward, config.max_span) == (
        "persistent", span, case["persistent_size"], False, case["max_span"])
    if span == "adaptive":
        want = [[min(S, c * S + 1 + R) for c in layer] for layer in case["current_val"]]
        np.testing.assert_allclose(load_model(run).spans(), want, atol=1e-4)
    got, _ = scored(run, data, tmp_path, "--split", case["split"])
    np.testing.assert_allclose(got, np.load(PERSISTENT / f"{span}.npy"), rtol=0, atol=1e-4)


def test_persistent_memory_holds_their_span_once(persistent_case, tmp_path, capsys):
    """Their persistent memory holds the layer's adaptive span again: the two must agree."""
    data = persistent_case[2]
    state = load_file(PERSISTENT / "adaptive.safetensors")
    again = "layers.1.attn.attn.persistent_memory.adaptive_span._mask.current_val"
    state[again] = state[again] + 0.1
    path = save_authors_checkpoint(tmp_path / "c.pt", state)
    assert main(["convert-official", str(path), str(tmp_path / "run"), "--data",
                 str(data)]) != 0
    assert again in one_line_error(capsys)


# ----------------------------------------------------------- --token-logprobs, ordinary runs


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """An ordinary adaspan run (byte corpus from a file) with spans that differ per head."""
    path = tmp_path_factory.mktemp("bytes")
    rng = random.Random(1)
    (path / "text.txt").write_bytes(bytes(rng.choice(b"abcdefgh \n") for _ in range(4000)))
    torch.manual_seed(0)
    config = ModelConfig(d_model=16, n_heads=2, n_layers=2, d_inner=32, max_span=40, ramp=4,
                         span_bucket=8)
    model = SpanLM(config)
    model.set_spans([[30, 6], [12, 40]])
    run = path / "run"
    RunDir(run).create(config, TrainConfig(data=str(path / "text.txt"), block_size=16,
                                           tensorboard=False),
                       {k: v.contiguous() for k, v in model.state_dict().items()})
    return run, model.eval(), load_corpus(str(path / "text.txt"), progress=False).valid


@pytest.mark.parametrize("batch_size", [1, 2])
def test_token_logprobs_of_an_ordinary_run(batch_size, byte_run, tmp_path):
    run, model, valid = byte_run
    out = tmp_path / "lp.npy"
    assert main(["evaluate", str(run), "--batch-size", str(batch_size), "--device", "cpu",
                 "--no-progress", "--token-logprobs", str(out)]) == 0
    n = (len(valid) - 1) // batch_size
    tokens = torch.as_tensor(valid.astype(np.int64))
    x = tokens[: batch_size * n].view(batch_size, n)  # stream b: one fresh stream, one block
    y = tokens[1 : batch_size * n + 1].view(batch_size, n)
    with torch.no_grad():
        want = model(x)[0].gather(-1, y[..., None])[..., 0].flatten().numpy()
    got = np.load(out)
    assert got.dtype == np.float32 and got.shape == (batch_size * n,)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------ tokens of any run


def test_run_split_reads_the_format_of_the_run(adaptive_run, byte_run, data_dir, texts, vocab,
                                               tmp_path):
    converted, _ = adaptive_run
    tokens, name, unit, ends, unk = run_split(converted, "test")
    assert tokens.tolist() == [vocab.index(s) for s in symbols_of(texts["test"])]
    assert (name, unit, ends) == (f"{data_dir.resolve()} (authors' format)", "symbol", None)
    assert unk == (vocab.index("<unk>") if "<unk>" in vocab else None)
    other = write_data(tmp_path / "other", texts["train"], texts["valid"], b"ab")
    assert run_split(converted, "test", data=other).tokens.tolist() == [
        vocab.index(s) for s in symbols_of(b"ab")]
    run, _, valid = byte_run
    tokens, name, unit, ends, unk = run_split(run, "valid", progress=False)
    assert np.array_equal(tokens, valid) and (name, unit, ends, unk) == ("text.txt", "character",
                                                                         None, None)


def test_run_codec_maps_bytes_to_the_tokens_of_the_run_and_back(adaptive_run, byte_run, vocab):
    codec = run_codec(adaptive_run[0])
    ids = codec.encode(b"ab\nc").ids
    assert list(ids) == [vocab.index(s) for s in ("97", "98", "<eos>", "99")]
    assert b"".join(codec.pieces(iter(ids))) == b"ab\nc"
    with pytest.raises(OfficialFormatError, match=r"the text has bytes .*\[122\]"):
        codec.encode(b"az")
    plain = run_codec(byte_run[0])  # an ordinary run: its tokens are the bytes
    assert bytes(plain.encode(b"z\xff").ids) == b"z\xff"
    assert b"".join(plain.pieces([0, 255])) == b"\x00\xff"


# ------------------------------------------------ adaptive input/output: their code's own output

ADAPTIVE_IO = Path(__file__).parents[1] / "fixtures" / "adaptive_io"


def word_symbols(text: str) -> list[str]:
    """The symbols their reader gets from a file of words: each line's words, then <eos>."""
    return [symbol for line in text.split("\n") for symbol in [*line.split(), "<eos>"]]


@pytest.fixture(scope="module")
def adaptive_io_case(tmp_path_factory):
    """The fixture of scripts/fixtures/make_adaptive_io_fixture.py (their model code run once): its
    description and the word-level data directory written from its texts."""
    case = json.loads((ADAPTIVE_IO / "cases.json").read_text())
    data = tmp_path_factory.mktemp("adaptive_io") / "data"
    data.mkdir()
    for split, text in case["texts"].items():
        (data / f"{split}.txt").write_text(text)
    return case, data


@pytest.mark.parametrize("name", ["tied", "untied"])
def test_adaptive_io_checkpoint_matches_the_authors_code(name, adaptive_io_case, tmp_path,
                                                         capsys):
    case, data = adaptive_io_case
    order: dict[str, None] = {}  # their dictionary: first appearance over train, valid, test
    for split in ("train", "valid", "test"):
        order.update(dict.fromkeys(word_symbols(case["texts"][split])))
    assert case["tokens"] == [list(order).index(s)
                              for s in word_symbols(case["texts"][case["split"]])]
    assert case["ramp"] == R
    tied, adaptive = case["cases"][name]["tied"], case["cases"][name]["adaptive"]
    run = convert(tmp_path, load_file(ADAPTIVE_IO / f"{name}.safetensors"), data)
    assert capsys.readouterr().out.strip().endswith(
        f"vocabulary of {len(order)} symbols, adaptive input/output (cutoffs 6,12, div_val 2, "
        f"{name})")
    model = load_model(run)
    config = model.config
    assert (config.adaptive_io, config.cutoff_ids, config.div_val, config.tie_io,
            config.attention, config.vocab_size, config.d_inner) == (
        True, tuple(case["cutoffs"]), case["div_val"], tied,
        "adaptive" if adaptive else "fixed", len(order), case["d_inner"])
    assert ("out.weights.0" in model.state_dict()) is not tied
    if adaptive:
        span = case["max_span"]
        want = [[min(span, c * span + 1 + R) for c in layer] for layer in case["current_val"]]
        np.testing.assert_allclose(model.spans(), want, atol=1e-4)
    got, _ = scored(run, data, tmp_path, "--split", case["split"])
    np.testing.assert_allclose(got, np.load(ADAPTIVE_IO / f"{name}.npy"), rtol=0, atol=1e-4)
    # per word and per byte of the text their files stand for: a word and the space after it
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    targets = word_symbols(case["texts"][case["split"]])[1:]
    assert result["bytes"] == sum(0 if s == "<eos>" else len(s.encode()) + 1 for s in targets)
    assert result["perplexity"] == pytest.approx(math.exp(-got.astype(float).mean()), rel=1e-5)


def _drop(state: dict, name: str) -> dict:
    del state[name]
    return state


ADAPTIVE_IO_DEFECTS = {  # case, change of its state dict, what the error names
    "tail tensor removed": ("tied", lambda s: _drop(s, "out_emb.out_layers.2.bias"),
                            "lacks out_emb.out_layers.2.bias"),
    "untied shape": ("untied", lambda s: {**s, "out_emb.out_layers.1.weight": torch.zeros(6, 5)},
                     "out_emb.out_layers.1.weight has shape (6, 5), expected (6, 8)"),
    "div_val": ("tied", lambda s: {**s, "in_emb.emb_layers.2.weight": torch.zeros(12, 3)},
                "embedding sizes [16, 8, 3]"),
    "cluster gap": ("untied", lambda s: {**s, "out_emb.out_projs.4": torch.zeros(16, 1)},
                    "clusters [0, 1, 2, 4]"),
    "unexpected tensor": ("untied", lambda s: {**s, "out_emb.shortlist": torch.zeros(3)},
                          "cannot map: out_emb.shortlist"),
    "plain and adaptive": ("tied", lambda s: {**s, "in_emb.weight": torch.zeros(24, 16)},
                           "both in_emb.weight and adaptive input/output"),
}


@pytest.mark.parametrize("defect", ADAPTIVE_IO_DEFECTS)
def test_adaptive_io_refuses_inconsistent_checkpoints(defect, adaptive_io_case, tmp_path,
                                                      capsys):
    name, change, message = ADAPTIVE_IO_DEFECTS[defect]
    state = change(load_file(ADAPTIVE_IO / f"{name}.safetensors"))
    path = save_authors_checkpoint(tmp_path / "c.pt", state)
    assert main(["convert-official", str(path), str(tmp_path / "run"), "--data",
                 str(adaptive_io_case[1])]) != 0
    assert message in one_line_error(capsys)
    assert not (tmp_path / "run").exists()


def test_adaptive_io_untied_when_one_output_tensor_differs(adaptive_io_case, tmp_path):
    """Equal values under both names are their tie; one differing tensor makes it untied."""
    state = load_file(ADAPTIVE_IO / "tied.safetensors")
    state["out_emb.out_projs.2"] = state["out_emb.out_projs.2"] + 0.01
    run = convert(tmp_path, state, adaptive_io_case[1])
    weights = load_model(run).state_dict()
    assert not load_model(run).config.tie_io
    assert torch.equal(weights["out.projections.2"], state["out_emb.out_projs.2"])
    assert torch.equal(weights["out.weights.2"], state["in_emb.emb_layers.2.weight"])
