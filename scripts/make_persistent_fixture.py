"""Make the fixture of tests/training/test_official.py for persistent memory by running the
authors' model code once (their code is read here, never by the tests).

Usage:
    python scripts/make_persistent_fixture.py /work/shared/anchors/adaptive-span \
        [--out tests/fixtures/persistent]

Builds two tiny all-attention models with their ``models.TransformerSeq`` (``pers_mem_size`` > 0,
so no feed-forward sublayer): ``adaptive``, with the per-head spans of ``CURRENT_VAL`` (layer 1's
spans are short enough that their code trims 64 of the S keys), and ``fixed``, without adaptive
spans. For each, writes to ``--out``:

- ``<case>.safetensors``: the model's state dict under their names (what their trainer saves
  as ``model``, without the ``module.`` prefix), float32;
- ``<case>.npy``: their log-probability (float64, their forward run in float64 from a cache of
  zero hidden states, one block) of each token of the scored split after the tokens before it;

and ``cases.json``: the sizes, the texts of the data directory (their format: decimal bytes),
the split scored and its token ids under their vocabulary.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from safetensors.torch import save_file

from adaspan.training.official import build_vocab, encode_split

S, R, D, HEADS, LAYERS, PERSISTENT = 80, 8, 16, 4, 2, 8
CURRENT_VAL = [[0.0, 0.15, 0.5, 1.0], [0.0, 0.05, 0.1, 0.02]]
ALPHABET = "abcd \n"
SPLIT = "valid"


def texts(seed: int = 0) -> dict[str, str]:
    """Train, valid and test texts over ``ALPHABET`` (valid also has an 'e'), each holding every
    letter and ending without a newline."""
    rng = random.Random(seed)

    def text(n: int, alphabet: str = ALPHABET) -> str:
        return alphabet + "".join(rng.choice(alphabet) for _ in range(n)) + "a"

    return {"train": text(200), "valid": text(120, ALPHABET + "e"), "test": text(60)}


def write_data(folder: Path, splits: dict[str, str]) -> Path:
    """The texts in their enwik8 format: decimal bytes, a newline byte as a line break."""
    for split, text in splits.items():
        line = " ".join("\n" if c == "\n" else str(ord(c)) for c in text)
        (folder / f"{split}.txt").write_text(line)
    return folder


def authors_model(models, vocab_size: int, adaptive: bool) -> torch.nn.Module:
    """Their TransformerSeq with persistent memory, seeded; norms perturbed, spans set."""
    torch.manual_seed(0 if adaptive else 1)
    model = models.TransformerSeq(
        vocab_size=vocab_size, hidden_size=D, nb_heads=HEADS, nb_layers=LAYERS, attn_span=S,
        emb_dropout=0.0, adapt_io_params={"adapt_io_enabled": False}, dropout=0.0,
        inner_hidden_size=4 * D,
        adapt_span_params={"adapt_span_enabled": adaptive, "adapt_span_loss": 0.0,
                           "adapt_span_ramp": R, "adapt_span_init": 0.0,
                           "adapt_span_cache": False},
        pers_mem_params={"pers_mem_size": PERSISTENT})
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.norm1.weight.add_(0.1 * torch.randn(D))
            layer.norm1.bias.add_(0.1 * torch.randn(D))
            if adaptive:
                span = layer.attn.attn.adaptive_span._mask.current_val
                span.copy_(torch.tensor(CURRENT_VAL[i]).view(HEADS, 1, 1))
    return model.eval()


def authors_logprobs(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """Their log p(token t + 1 | tokens <= t), one block from zero hidden states, float64."""
    model = model.double()
    x = torch.tensor(tokens[:-1])[None]
    cache = [torch.zeros(1, layer.attn.attn.get_cache_size(), D, dtype=torch.float64)
             for layer in model.layers]
    with torch.no_grad():
        log_probs, _, _ = model(x, cache)
    return log_probs[0, torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def authors_code(description: str, default_out: str) -> tuple[ModuleType, Path]:
    """The authors' ``models`` module (its folder from the command line) and the fixture
    folder (``--out``, made): what every fixture script starts with."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("code", help="directory of the authors' models.py")
    parser.add_argument("--out", default=default_out)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.code).resolve()))
    models = importlib.import_module("models")  # the authors' code
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return models, out


def write_fixture(out: Path, cases: dict[str, torch.nn.Module], logprobs: Callable,
                  tokens: list[int], sizes: dict) -> None:
    """For each case its weights (``<case>.safetensors``, tied tensors cloned apart) and the
    log-probabilities ``logprobs(model, tokens)`` (``<case>.npy``); then ``cases.json``, the
    ``sizes`` one key a line."""
    for case, model in cases.items():
        state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(state, out / f"{case}.safetensors")
        np.save(out / f"{case}.npy", logprobs(model, tokens))
    lines = (f"{json.dumps(key)}: {json.dumps(value)}" for key, value in sizes.items())
    (out / "cases.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")


def main() -> None:
    models, out = authors_code(__doc__.split("\n\n")[0], "tests/fixtures/persistent")
    splits = texts()
    with tempfile.TemporaryDirectory() as folder:
        data = write_data(Path(folder), splits)
        vocab = build_vocab(data)
        tokens = encode_split(data, SPLIT, vocab).tolist()
    cases = {case: authors_model(models, len(vocab), adaptive=case == "adaptive")
             for case in ("adaptive", "fixed")}
    write_fixture(out, cases, authors_logprobs, tokens, {
        "max_span": S, "ramp": R, "d_model": D, "n_heads": HEADS, "n_layers": LAYERS,
        "persistent_size": PERSISTENT, "current_val": CURRENT_VAL, "texts": splits,
        "split": SPLIT, "tokens": tokens})


if __name__ == "__main__":
    main()
