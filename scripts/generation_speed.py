"""Generation speed at batch 1 of "the race model": the model's forward over a KeyValueCache
(old path) against :class:`adaspan.decode.Decoder` (new path), side by side in one run.

    python scripts/generation_speed.py [--chars 2000] [--runs 5] [--prompt 256]

The race model: d 256, 4 heads, 4 layers, d_inner 1024, S 1024, R 32, adaptive spans
93/60/56/38 in every layer. Each path continues a prompt greedily for ``chars`` characters,
timed from the end of the prompt (building the decoder included), after one warm-up run; the
median chars/s of ``runs`` runs is reported, in float32 and under bfloat16 autocast. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from adaspan import ModelConfig, SpanLM
from adaspan.decode import decoder

RACE = ModelConfig(vocab_size=256, d_model=256, n_heads=4, n_layers=4, d_inner=1024,
                   max_span=1024, ramp=32, attention="adaptive", dropout=0.0)
SPANS = [[93, 60, 56, 38]] * 4


@torch.no_grad()
def chars_per_s(model: SpanLM, prompt: torch.Tensor, chars: int, fast: bool) -> float:
    """Greedy characters per second after ``prompt`` (1, P), by the fast or the model's step."""
    log_probs, cache = model(prompt, model.empty_cache(1, keys_values=True))
    tic = time.perf_counter()
    step = decoder(model, cache, prompt.shape[1], fast=fast)
    token = int(log_probs[0, -1].argmax())
    for _ in range(chars):
        token = int(step(token).argmax())
    return chars / (time.perf_counter() - tic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=256, help="prompt length")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = SpanLM(RACE).eval()
    model.set_spans(SPANS)
    prompt = torch.randint(0, RACE.vocab_size, (1, args.prompt))
    result = {"chars": args.chars, "runs": args.runs, "threads": torch.get_num_threads()}
    for dtype in ("float32", "bfloat16"):
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bfloat16"
                    else contextlib.nullcontext())
        with autocast:
            for fast in (False, True):
                chars_per_s(model, prompt, min(200, args.chars), fast)  # warm-up
            runs = {"old": [], "new": []}
            for _ in range(args.runs):  # alternated, so that both see the same machine load
                for path, fast in (("old", False), ("new", True)):
                    runs[path].append(chars_per_s(model, prompt, args.chars, fast))
        for path, values in runs.items():
            result[f"{dtype}_{path}_chars_per_s"] = round(statistics.median(values), 1)
        result[f"{dtype}_speedup"] = round(result[f"{dtype}_new_chars_per_s"]
                                           / result[f"{dtype}_old_chars_per_s"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
