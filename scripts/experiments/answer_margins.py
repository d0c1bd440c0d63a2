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

Output: ``prompts`` (task, length, depth, sample, answer, and ``margins``, one per model) and
``summary`` per model: prompts, those below 0, the least and the median margin.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

from adaspan.errors import UserError
from adaspan.hf.longeval import load_haystack, load_model_dir
from adaspan.hf.needles import Haystack, Sample, make


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
    return parser.parse_args(argv)


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
    names = [str(path) for path in args.model_dirs]
    prompts = []
    for (task, length, depth, i), sample in zip(points, samples, strict=True):
        answer = answer_ids(haystack, sample)
        least = {name: min(margins(model, list(sample.ids), answer))
                 for name, (model, _) in zip(names, models, strict=True)}
        prompts.append({"task": task, "length": length, "depth": depth, "sample": i,
                        "answer": ", ".join(sample.answers), "margins": least})
    result = {"models": names, "haystack": args.haystack, "prompts": prompts,
              "summary": {name: summary([p["margins"][name] for p in prompts])
                          for name in names}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
