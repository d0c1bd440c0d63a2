"""Milliseconds of one training step and one evaluation block of the race model, in this
process (median of ``--repeats`` after 2 warm-up steps), for A/B timing of two adaspan versions
with the same script: run it alternately with ``PYTHONPATH=OTHER/src`` and without. The training
step is ``adaspan train``'s (:func:`adaspan.measure.bench.training_step`: forward, backward, the
authors' per-tensor clipping and an Adagrad step) in ``--dtype``'s training precision
(``auto``: as train chooses). Prints one JSON line.

    python scripts/bench/step_time.py [--spans 93,60,56,38] [--dtype float32] [--repeats 10]
        [--batch 8] [--block 256] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adaspan.config import ModelConfig
from adaspan.measure.bench import build_bench_model, training_step
from adaspan.runtime.precision import choose

RACE = ModelConfig(n_layers=4, d_model=256, n_heads=4, d_inner=1024, max_span=1024, ramp=32,
                   dropout=0.0, vocab_size=256)


def _median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", default="93,60,56,38")
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_bench_model(RACE, args.spans, torch.device("cpu"))
    precision = choose(args.dtype, torch.device("cpu"), "train")
    step = training_step(model, args.batch, args.block, precision)
    for _ in range(2):
        step()
    train_ms = _median_ms(step, args.repeats)
    tokens = torch.randint(0, 256, (args.batch, args.block))
    model.eval()
    with torch.no_grad(), precision.applied():
        kv = [model(tokens, model.empty_cache(args.batch, keys_values=True))[1]]

        def block() -> None:
            _, kv[0] = model(tokens, kv[0])

        eval_ms = _median_ms(block, args.repeats)
    print(json.dumps({"train_ms": round(train_ms, 1), "eval_ms": round(eval_ms, 1),
                      "precision": precision.describe(), "threads": torch.get_num_threads(),
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
