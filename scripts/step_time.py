"""Milliseconds of one training step and one evaluation block of the race model, in this
process (median of 10 after 2 warm-up steps), for A/B timing of two adaspan versions with the
same script: run it alternately with ``PYTHONPATH=OTHER/src`` and without. Prints one JSON line.

    python scripts/step_time.py [--spans 93,60,56,38]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from adaspan.config import ModelConfig
from adaspan.measure.bench import build_bench_model

RACE = ModelConfig(n_layers=4, d_model=256, n_heads=4, d_inner=1024, max_span=1024, ramp=32,
                   dropout=0.0, vocab_size=256)


def _median_ms(call, repeats: int = 10) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", default="93,60,56,38")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = build_bench_model(RACE, args.spans, torch.device("cpu")).train()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-9)
    tokens = torch.randint(0, 256, (8, 257))
    cache = [model.empty_cache(8)]

    def step() -> None:
        log_probs, cache[0] = model(tokens[:, :-1], cache[0])
        loss = -log_probs.gather(-1, tokens[:, 1:, None]).mean() + model.span_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        model.clamp_spans()

    for _ in range(2):
        step()
    train_ms = _median_ms(step)
    model.eval()
    with torch.no_grad():
        kv = [model(tokens[:, :-1], model.empty_cache(8, keys_values=True))[1]]

        def block() -> None:
            _, kv[0] = model(tokens[:, :-1], kv[0])

        eval_ms = _median_ms(block)
    print(json.dumps({"train_ms": round(train_ms, 1), "eval_ms": round(eval_ms, 1)}))


if __name__ == "__main__":
    main()
