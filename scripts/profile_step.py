"""Where a training step's time goes, by operation: ``torch.profiler`` over a few steps of the
race configuration (4 layers, d 256, 4 heads, FF 1024, S 1024, spans 93/60/56/38, batch
8 x 256, Adagrad), after two warm-up steps. Prints one JSON line: the step's mean milliseconds
and the operations taking the most self CPU time (ms per step, share).

    python scripts/profile_step.py [--steps 5] [--top 15] [--dtype float32] [--compile]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from adaspan.config import ModelConfig
from adaspan.measure.bench import build_bench_model, train_seconds
from adaspan.training.precision import choose

RACE = ModelConfig(vocab_size=256, d_model=256, n_heads=4, n_layers=4, d_inner=1024,
                   max_span=1024, ramp=32, dropout=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu")
    model = build_bench_model(RACE, "93,60,56,38", device)
    if args.compile:  # adaspan >= 0.5
        model.compile_dense()
    precision = choose(args.dtype, device, "train")
    train_seconds(model, 8, 256, 1, precision, "median")  # warm-up (and compile)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        train_seconds(model, 8, 256, args.steps - 1, precision, "median")  # and its warm-up
        elapsed = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(json.dumps({
        "step_ms": 1e3 * elapsed / args.steps,
        "ops": [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / args.steps,
                 "share": e.self_cpu_time_total / total} for e in events[: args.top]],
    }))


if __name__ == "__main__":
    main()
