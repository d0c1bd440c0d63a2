"""Generation speed at batch 1 of "the race model", by per-token step, side by side in one run:
the model's forward over a KeyValueCache (``forward``), :class:`adaspan.model.decode.Decoder`
(``decoder``, the CPU's step) and :class:`adaspan.model.decode.StaticDecoder` (``static``: on CUDA
replayed from a CUDA graph, as ``adaspan generate`` runs there).

    python scripts/bench/generation_speed.py [--chars 2000] [--runs 5] [--prompt 256]
        [--paths forward,decoder,static] [--device cpu]

The race model: d 256, 4 heads, 4 layers, d_inner 1024, S 1024, R 32, adaptive spans
93/60/56/38 in every layer. Each path continues a prompt greedily for ``chars`` characters,
timed from the end of the prompt (building the step, and on CUDA capturing its graph,
included), after one warm-up run; the paths are alternated run after run, and the median
chars/s of ``runs`` runs is reported, in float32 and under bfloat16 autocast. Prints one JSON
line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

from adaspan import ModelConfig, SpanLM
from adaspan.model.decode import decoder

RACE = ModelConfig(vocab_size=256, d_model=256, n_heads=4, n_layers=4, d_inner=1024,
                   max_span=1024, ramp=32, attention="adaptive", dropout=0.0)
SPANS = [[93, 60, 56, 38]] * 4
PATHS = {"forward": dict(fast=False), "decoder": dict(static=False), "static": dict(static=True)}


@torch.no_grad()
def chars_per_s(model: SpanLM, prompt: torch.Tensor, chars: int, path: str) -> float:
    """Greedy characters per second after ``prompt`` (1, P) by the step ``path`` of
    :data:`PATHS`."""
    log_probs, cache = model(prompt, model.empty_cache(1, keys_values=True))
    tic = time.perf_counter()
    step = decoder(model, cache, prompt.shape[1], **PATHS[path])
    token = int(log_probs[0, -1].argmax())
    for _ in range(chars):
        token = int(step(token).argmax())
    return chars / (time.perf_counter() - tic)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chars", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=256, help="prompt length")
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"steps compared, among {', '.join(PATHS)}")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    paths = args.paths.split(",")
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = SpanLM(RACE).eval().to(device)
    model.set_spans(SPANS)
    prompt = torch.randint(0, RACE.vocab_size, (1, args.prompt), device=device)
    result = {"chars": args.chars, "runs": args.runs, "device": str(device),
              "threads": torch.get_num_threads()}
    for dtype in ("float32", "bfloat16"):
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16"
                    else contextlib.nullcontext())
        with autocast:
            for path in paths:
                chars_per_s(model, prompt, min(200, args.chars), path)  # warm-up
            runs: dict[str, list[float]] = {path: [] for path in paths}
            for _ in range(args.runs):  # alternated, so that all see the same machine load
                for path in paths:
                    runs[path].append(chars_per_s(model, prompt, args.chars, path))
        for path, values in runs.items():
            result[f"{dtype}_{path}_chars_per_s"] = round(statistics.median(values), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
