"""The memory estimate that training checks before its first step, against the resident
memory a real training step takes, in a fresh process per configuration.

For each configuration: ``estimate_gb`` (:func:`adaspan.training.memory.estimate_training_memory`,
Adagrad) and ``measured_gb``, the growth of the process's peak resident set size over three
training steps (cache carried), plus the weights, which were resident before. Prints one JSON
object per configuration.

    python scripts/bench/memory_estimate.py
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import torch

# (name, model options, batch size, block size)
CONFIGS = [
    ("cpu-small", {"n_layers": 4, "d_model": 256, "n_heads": 4, "d_inner": 1024,
                   "max_span": 1024, "dropout": 0.1}, 16, 128),
    ("small-8x512", {"n_layers": 12, "d_model": 512, "n_heads": 8, "d_inner": 2048,
                     "dropout": 0.3}, 8, 512),
    ("fixed-1024", {"n_layers": 6, "d_model": 512, "n_heads": 8, "d_inner": 2048,
                    "dropout": 0.3, "attention": "fixed", "max_span": 1024}, 8, 256),
]


def measure(options: dict, batch: int, block: int) -> dict:
    """In this process: the estimate, then three training steps."""
    from adaspan import ModelConfig, SpanLM, TrainConfig
    from adaspan.attention.cache import StreamCache
    from adaspan.training.memory import estimate_training_memory
    from adaspan.training.optim import build_optimizer, build_scheduler
    from adaspan.training.train import train_step

    model = SpanLM(ModelConfig(**options))
    config = TrainConfig(batch_size=batch, block_size=block, optimizer="adagrad", warmup=0)
    estimate = estimate_training_memory(model, "adagrad", batch, block)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    tokens = torch.randint(0, 256, (batch, block))
    cache = StreamCache(model.empty_cache(batch))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for _ in range(3):
        _, cache = train_step(model, optimizer, scheduler, tokens, tokens, cache, config)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"estimate_gb": estimate.total / 2**30,
            "measured_gb": (after - before + estimate.weights) / 2**30}


def main() -> None:
    if len(sys.argv) > 1:  # the child: one configuration
        options, batch, block = json.loads(sys.argv[1])
        print(json.dumps(measure(options, batch, block)))
        return
    for name, options, batch, block in CONFIGS:
        child = subprocess.run([sys.executable, __file__, json.dumps([options, batch, block])],
                               capture_output=True, text=True, check=True)
        result = json.loads(child.stdout.strip().splitlines()[-1])
        ratio = result["estimate_gb"] / result["measured_gb"]
        print(json.dumps({"config": name, "batch_size": batch, "block_size": block,
                          **{k: round(v, 3) for k, v in result.items()},
                          "estimate_over_measured": round(ratio, 3)}))


if __name__ == "__main__":
    main()
