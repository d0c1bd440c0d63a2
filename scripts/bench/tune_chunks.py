"""Measure the chunk size of banded attention: time of one head's attention (forward and
backward for training, forward for evaluation) for each key window and candidate chunk size.

    python scripts/bench/tune_chunks.py [--batch 8] [--block 256] [--repeats 5] [--windows 64,128]

Prints one JSON line per window and mode (median milliseconds per chunk size, and the best);
:data:`adaspan.attention.band.CHUNKS` is regenerated from such a run (the best chunk of each
window).
"""

from __future__ import annotations

import argparse
import json

import torch

from adaspan.attention.band import banded_attention
from adaspan.measure.bench import seconds

WINDOWS = (64, 128, 256, 512, 1024, 2048, 4096)
CANDIDATES = (32, 64, 128, 256)


def head_seconds(
    window: int, chunk: int, train: bool, batch: int, block: int, repeats: int
) -> float:
    d_head, generator = 64, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, 1, n, d_head, generator=generator, requires_grad=train)
               for n in (block, window + block, window + block))
    pos = torch.randn(window, d_head, generator=generator, requires_grad=train)
    z = torch.tensor([window - 32.0]).view(1, 1, 1).requires_grad_(train)

    def step() -> None:
        with torch.set_grad_enabled(train):
            out = banded_attention(q, k, v, pos, z, 32, chunk=chunk)
            if train:
                out.sum().backward()

    return seconds(step, repeats, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--windows", default=",".join(map(str, WINDOWS)))
    args = parser.parse_args()
    for mode in ("train", "eval"):
        for window in map(int, args.windows.split(",")):
            ms = {c: 1e3 * head_seconds(window, c, mode == "train", args.batch, args.block,
                                   args.repeats) for c in CANDIDATES}
            print(json.dumps({"mode": mode, "window": window, "ms": ms,
                              "best": min(ms, key=ms.get)}), flush=True)


if __name__ == "__main__":
    main()
