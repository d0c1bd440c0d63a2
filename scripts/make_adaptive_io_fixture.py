"""Make the fixture of tests/training/test_official.py for adaptive input/output by running the
authors' model code once (their code is read here, never by the tests).

Usage:
    python scripts/make_adaptive_io_fixture.py /work/shared/anchors/adaptive-span \
        [--out tests/fixtures/adaptive_io]

Builds two tiny word-level models with their ``models.TransformerSeq`` and
``adapt_io_enabled=True`` (cutoffs ``CUTOFFS``: a head cluster and two tail clusters, div_val
``DIV_VAL``): ``tied`` (``adapt_io_tied``: their output shares the input's embeddings and
projections) with adaptive spans set to ``CURRENT_VAL``, and ``untied`` with fixed spans. Norms,
output biases and the cluster logits' bias are perturbed so that nothing sits at its initial
symmetry, and the embeddings scaled down. For each, writes to ``--out``:

- ``<case>.safetensors``: the model's state dict under their names (what their trainer saves
  as ``model``, without the ``module.`` prefix), float32; tied tensors are saved once under each
  of their two names, as separate copies;
- ``<case>.npy``: their log-probability (their forward run in float64 from a cache of zero
  hidden states, one block, with targets: their adaptive softmax returns each target's
  negative log-likelihood, computed in float32) of each token of the scored split after the
  tokens before it;

and ``cases.json``: the sizes, the texts of the data directory (their format: words, one
``<eos>`` per line), the split scored and its token ids under their vocabulary.
"""

from __future__ import annotations

import itertools
import random
import tempfile
from pathlib import Path

import numpy as np
import torch
from make_persistent_fixture import authors_code, write_fixture  # beside this script

from adaspan.training.official import build_vocab, encode_split

S, R, D, HEADS, LAYERS, INNER = 40, 8, 16, 4, 2, 32
CUTOFFS, DIV_VAL = [6, 12], 2
CURRENT_VAL = [[0.05, 0.2, 0.5, 1.0], [0.0, 0.1, 0.3, 0.02]]
WORDS = ["the", "of", "and", "to", "a", "in", "is", "it", "that", "was", "he", "for", "on", "are",
         "as", "with", "his", "they", "at", "be", "this", "from"]
VALID_ONLY = "zebra"  # a symbol of valid.txt only: the last id of the vocabulary
SPLIT = "valid"
CASES = {"tied": {"tied": True, "adaptive": True}, "untied": {"tied": False, "adaptive": False}}


def texts(seed: int = 0) -> dict[str, str]:
    """Train, valid and test texts of random lines of ``WORDS`` (train starts with each word
    once, valid also has ``VALID_ONLY``), the first words more frequent than the last."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) for rank in range(len(WORDS))]

    def text(n_lines: int, extra: tuple[str, ...] = ()) -> str:
        lines = []
        for _ in range(n_lines):
            words = rng.choices(WORDS, weights, k=rng.randint(3, 9))
            if extra and rng.random() < 0.3:
                words.insert(rng.randrange(len(words) + 1), rng.choice(extra))
            lines.append(" ".join(words))
        return "\n".join(lines)

    return {"train": " ".join(WORDS) + "\n" + text(30), "valid": text(16, (VALID_ONLY,)),
            "test": text(8)}


def authors_model(models, vocab_size: int, tied: bool, adaptive: bool) -> torch.nn.Module:
    """Their TransformerSeq with adaptive input/output, seeded; norms and biases perturbed,
    spans set."""
    torch.manual_seed(0 if tied else 1)
    model = models.TransformerSeq(
        vocab_size=vocab_size, hidden_size=D, nb_heads=HEADS, nb_layers=LAYERS, attn_span=S,
        emb_dropout=0.0, dropout=0.0, inner_hidden_size=INNER,
        adapt_io_params={"adapt_io_enabled": True, "adapt_io_cutoffs": list(CUTOFFS),
                         "adapt_io_divval": DIV_VAL, "adapt_io_tied": tied},
        adapt_span_params={"adapt_span_enabled": adaptive, "adapt_span_loss": 0.0,
                           "adapt_span_ramp": R, "adapt_span_init": 0.0,
                           "adapt_span_cache": False},
        pers_mem_params={"pers_mem_size": 0})
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for norm in (layer.norm1, layer.norm2):
                norm.weight.add_(0.1 * torch.randn(D))
                norm.bias.add_(0.1 * torch.randn(D))
            if adaptive:
                span = layer.attn.attn.adaptive_span._mask.current_val
                span.copy_(torch.tensor(CURRENT_VAL[i]).view(HEADS, 1, 1))
        for embedding in model.in_emb.emb_layers:  # N(0, 1): logits of many nats when tied
            embedding.weight.mul_(0.4)
        for out_layer in model.out_emb.out_layers:
            out_layer.bias.add_(0.5 * torch.randn(out_layer.bias.shape))
        model.out_emb.cluster_proj.bias.copy_(torch.tensor([0.7, -0.4]))
    return model.eval()


def authors_logprobs(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """Their log p(token t + 1 | tokens <= t), one block from zero hidden states, float64."""
    model = model.double()
    x, target = torch.tensor(tokens[:-1])[None], torch.tensor(tokens[1:])[None]
    cache = [torch.zeros(1, layer.attn.attn.get_cache_size(), D, dtype=torch.float64)
             for layer in model.layers]
    with torch.no_grad():
        nll, _, _ = model(x, cache, target)
    return -nll[0].double().numpy()


def check_clusters(tokens: list[int], vocab_size: int) -> None:
    """Every cluster holds at least two of the inputs and two of the targets: their code
    squeezes the index list of a cluster, which breaks on a single element."""
    bounds = [0, *CUTOFFS, vocab_size]
    for ids in (tokens[:-1], tokens[1:]):
        for lo, hi in itertools.pairwise(bounds):
            count = sum(lo <= t < hi for t in ids)
            assert count >= 2, f"cluster [{lo}, {hi}) has {count} tokens"


def main() -> None:
    models, out = authors_code(__doc__.split("\n\n")[0], "tests/fixtures/adaptive_io")
    splits = texts()
    with tempfile.TemporaryDirectory() as folder:
        for split, text in splits.items():
            (Path(folder) / f"{split}.txt").write_text(text)
        vocab = build_vocab(folder)
        tokens = encode_split(folder, SPLIT, vocab).tolist()
    check_clusters(tokens, len(vocab))
    cases = {case: authors_model(models, len(vocab), **options)
             for case, options in CASES.items()}
    write_fixture(out, cases, authors_logprobs, tokens, {
        "max_span": S, "ramp": R, "d_model": D, "n_heads": HEADS, "n_layers": LAYERS,
        "d_inner": INNER, "cutoffs": CUTOFFS, "div_val": DIV_VAL, "vocab_size": len(vocab),
        "cases": CASES, "current_val": CURRENT_VAL, "texts": splits, "split": SPLIT,
        "tokens": tokens})


if __name__ == "__main__":
    main()
