"""How near each retrieval prompt is to a wrong answer, under several models: the answer's
least logit margin, teacher forced. Print it as JSON.

    python scripts/experiments/answer_margins.py /work/ev30/far /work/ev35/w2/spans \
        --haystack /work/ev30/test-haystack.txt --tasks single_needle --lengths 1024 \
        --samples 12

The prompts are ``adaspan longeval``'s (task, length, depth, sample i from seed + i). Each
prompt is read with its answer after it (a space, then the values joined by ", ") in one
pass. At each position that predicts an answer token, the margin is that token's logit less
the largest other logit; a prompt's margin is the least of them. Below 0, greedy decoding
leaves the answer there (unless it left it before). A model directory is longeval's
MODEL_DIR: a causal LM, with its spans where it has them (they act as their soft mask).

With ``--summaries``, each model with spans is read again with one more key per head and
query: a summary of the keys its span drops, those weighed 1 - w by the span's weights w
(the soft mask, the sinks 1): n = the sum of 1 - w, the mean key k = sum (1 - w) k_j / n and
the mean value v likewise, with the logit scale q . k + log n (``mean``: as if the dropped
keys each scored their mean logit; a cache would hold two running sums a head), or with
their exact log-sum of exp scale q . k_j weighed 1 - w (``mass``: their mean value at their
true weight, which no cache holds), or the exact part itself (``all``: full attention, a
check). These are dense (T x T) readings of the equations, for prompts of a few thousand
tokens. Each is named ``MODEL+KIND``.

Output: ``prompts`` (task, length, depth, sample, answer, and ``margins``, one per model) and
``summary`` per model: prompts, those below 0, the least and the median margin.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from adaspan.attention.span import soft_mask
from adaspan.errors import UserError
from adaspan.hf.attention import NAME, per_query_head, register, span_modules, span_of
from adaspan.hf.longeval import load_haystack, load_model_dir
from adaspan.hf.needles import Haystack, Sample, make

SUMMARIES = ("mean", "mass", "all")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("model_dirs", type=Path, nargs="+", help="model directories (longeval's MODEL_DIR)")
    add("--haystack", required=True, help="text file or corpus name (longeval's --haystack)")
    add("--tasks", default="single_needle", help="tasks, comma-separated")
    add("--lengths", default="1024", help="prompt lengths in tokens, comma-separated")
    add("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, comma-separated")
    add("--samples", type=int, default=4, help="prompts per task, length and depth")
    add("--seed", type=int, default=0, help="sample i is drawn from seed + i")
    add("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    add("--summaries", default="", help=f"each model with spans read again with a summary "
        f"of the keys its spans drop: kinds of {', '.join(SUMMARIES)}, comma-separated")
    return parser.parse_args(argv)


def span_weights(module: nn.Module, heads: int, positions: int) -> Tensor:
    """w (h, T, T): the weight of key j for query i of each query head, m_z(i - j) within
    [0, S), the first ``sinks`` positions 1, 0 after the query (eqs. 1-2 with sinks)."""
    span = span_of(module)
    z = torch.tensor(per_query_head(span.host_z(), heads), dtype=torch.float32)
    i = torch.arange(positions)[:, None]
    j = torch.arange(positions)[None, :]
    x = (i - j).float()
    w = soft_mask(x, z[:, None, None], span.ramp) * ((x >= 0) & (x < span.max_span))
    sink = (j < getattr(span, "sinks", 0)) & (x >= 0)
    return torch.where(sink, torch.ones_like(w), w)


def summary_attention(kind: str):
    """An ``AttentionInterface`` function: span attention with the summary ``kind`` of the
    keys each head drops joined to its softmax (see the module docstring); one pass over a
    whole sequence, no cache. Each layer's weights are made once per length."""
    made: dict[tuple[nn.Module, int], tuple[Tensor, Tensor, Tensor]] = {}

    def weighed(module: nn.Module, heads: int, positions: int) -> tuple[Tensor, Tensor, Tensor]:
        """w, the dropped share (1 - w, causal) and its sum n over the keys."""
        if (module, positions) not in made:
            w = span_weights(module, heads, positions)
            dropped = (1 - w) * torch.ones(positions, positions).tril()
            made[module, positions] = w, dropped, dropped.sum(-1)
        return made[module, positions]

    def attend(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
               attention_mask: Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               **kwargs) -> tuple[Tensor, None]:
        heads, positions, d = query.shape[1:]
        if key.shape[2] != positions:
            raise UserError("a summary reads a whole sequence in one pass, without a cache")
        scale = d ** -0.5 if scaling is None else scaling
        key, value = (t.repeat_interleave(heads // t.shape[1], 1) for t in (key, value))
        w, dropped, n = weighed(module, heads, positions)
        scores = query @ key.transpose(-1, -2) * scale
        if kind == "mean":
            mean_key = dropped @ key / n.clamp(min=1)[..., None]
            extra = (query * mean_key).sum(-1) * scale + torch.log(n)
        else:
            extra = torch.logsumexp(scores + torch.log(dropped), -1)
        extra = torch.where(n > 0, extra, -math.inf)
        weights = torch.softmax(torch.cat([scores + torch.log(w), extra[..., None]], -1), -1)
        if kind == "all":
            summary = torch.softmax(scores + torch.log(dropped), -1).nan_to_num() @ value
        else:
            summary = dropped @ value / n.clamp(min=1)[..., None]
        out = weights[..., :-1] @ value + weights[..., -1:] * summary
        return out.transpose(1, 2).contiguous(), None

    return attend


@contextmanager
def summarised(kind: str) -> Iterator[None]:
    """Within the block, every span attention reads with the summary ``kind``."""
    AttentionInterface.register(NAME, summary_attention(kind))
    try:
        yield
    finally:
        register()


def answer_ids(haystack: Haystack, sample: Sample) -> list[int]:
    """The tokens of the answer as it follows the prompt: a space, the values joined."""
    return haystack.count_ids(" " + ", ".join(sample.answers))


@torch.no_grad()
def margins(model: torch.nn.Module, prompt: list[int], answer: list[int]) -> list[float]:
    """Per answer token: its logit less the largest other, after the prompt and the answer's
    tokens before it (one pass, teacher forced)."""
    ids = torch.tensor([prompt + answer])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    target = torch.tensor(answer)
    right = logits[torch.arange(len(answer)), target]
    logits[torch.arange(len(answer)), target] = -torch.inf
    return (right - logits.max(-1).values).tolist()


def summary(values: list[float]) -> dict:
    return {"prompts": len(values), "below_zero": sum(v < 0 for v in values),
            "least": min(values), "median": statistics.median(values)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        models = [load_model_dir(path, torch.device("cpu")) for path in args.model_dirs]
        haystack = Haystack(load_haystack(args.haystack), models[0][1])
        points = list(itertools.product(
            args.tasks.split(","), [int(n) for n in args.lengths.split(",")],
            [float(d) for d in args.depths.split(",")], range(args.samples)))
        samples = [make(task, haystack, length, depth, args.seed + i)
                   for task, length, depth, i in points]
    except (UserError, OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}") from None
    kinds = [kind for kind in args.summaries.split(",") if kind]
    if unknown := sorted(set(kinds) - set(SUMMARIES)):
        raise SystemExit(f"error: unknown summaries {', '.join(unknown)}; the kinds are "
                         f"{', '.join(SUMMARIES)}")
    readings = [(str(path), model, "") for path, (model, _) in zip(args.model_dirs, models,
                                                                   strict=True)]
    readings += [(f"{path}+{kind}", model, kind) for kind in kinds
                 for path, (model, _) in zip(args.model_dirs, models, strict=True)
                 if span_modules(model)]
    names = [name for name, _, _ in readings]
    prompts = []
    for (task, length, depth, i), sample in zip(points, samples, strict=True):
        answer = answer_ids(haystack, sample)
        least = {}
        for name, model, kind in readings:
            with summarised(kind) if kind else nullcontext():
                least[name] = min(margins(model, list(sample.ids), answer))
        prompts.append({"task": task, "length": length, "depth": depth, "sample": i,
                        "answer": ", ".join(sample.answers), "margins": least})
    result = {"models": names, "haystack": args.haystack, "prompts": prompts,
              "summary": {name: summary([p["margins"][name] for p in prompts])
                          for name in names}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
