"""How much of a step the attention takes, and what that leaves any attention to gain over the
authors' code: each configuration of scripts/against_official.py timed as `adaspan bench`
times it, again with every head group's banded attention (eqs. 1-3) replaced by a copy of its
queries, and (with --official) the authors' code, alternating, in one run.

    python scripts/attention_share.py --configs init,spans-256 [--rounds 3] [--steps 8] \\
        [--official ../shared/anchors/bench_official.py]

Without the attention the keys and values are still projected but their backward is skipped,
so that step is a lower bound on what the rest of adaspan's model costs, and the authors' step
time divided by it an upper bound on the ratio any attention path could give. Prints one JSON
line per round (milliseconds per step, means of --steps), then one per configuration (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

import adaspan.attention as attention
from adaspan.bench import build_bench_model, eval_seconds, train_seconds
from adaspan.presets import resolve_config

sys.path.insert(0, str(Path(__file__).resolve().parent))
from against_official import CONFIGS, authors, model_options


@contextmanager
def without_attention():
    """Each call of :func:`adaspan.attention.banded_attention` returns a copy of its queries."""
    banded = attention.banded_attention
    attention.banded_attention = lambda q, *args, **kwargs: q * 1.0
    try:
        yield
    finally:
        attention.banded_attention = banded


def milliseconds(config: tuple, steps: int) -> dict:
    """adaspan's train and eval milliseconds per step for a configuration of CONFIGS."""
    spans, block, batch = config[5:]
    model_config, _ = resolve_config(overrides=model_options(config))
    cpu = torch.device("cpu")
    model = build_bench_model(model_config, spans, cpu)
    return {kind: 1e3 * time(model, batch, block, steps, cpu, nullcontext(), "mean")
            for kind, time in (("train", train_seconds), ("eval", eval_seconds))}


def one_round(config: tuple, steps: int, official: Path | None) -> dict:
    row = {}
    for label, context in (("", nullcontext), ("_without_attention", without_attention)):
        with context():
            row.update({f"{k}_ms{label}": ms for k, ms in milliseconds(config, steps).items()})
    if official is not None:
        chars = config[6] * config[7]
        theirs = authors(official, config, steps)
        row.update({f"authors_{k}_ms": 1e3 * chars / theirs[f"{k}_chars_per_s"]
                    for k in ("train", "eval")})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="init", help=f"from: {', '.join(CONFIGS)}")
    parser.add_argument("--official", type=Path, help="the authors' bench_official.py")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    for name in args.configs.split(","):
        if name not in CONFIGS:
            parser.error(f"unknown configuration {name!r}; choose from {', '.join(CONFIGS)}")
        rows = []
        for round_ in range(args.rounds):
            rows.append(one_round(CONFIGS[name], args.steps, args.official))
            print(json.dumps({"config": name, "round": round_ + 1, **rows[-1]}), flush=True)
        medians = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        if args.official is not None:
            medians.update({f"{k}_ratio_bound": medians[f"authors_{k}_ms"]
                            / medians[f"{k}_ms_without_attention"] for k in ("train", "eval")})
        print(json.dumps({"config": name, **medians}), flush=True)


if __name__ == "__main__":
    main()
