"""adaspan against the authors' code, side by side: alternating rounds in one run, one machine.

Usage:
    python scripts/bench/against_official.py --official ../shared/anchors/bench_official.py \
        [--configs reference,fixed-1024,...] [--rounds 3] [--steps 8] [--out results.json] \
        [--as-provided] [--device cuda] [--dtype float32] [--baseline OLD/src]

For each configuration, each round runs `adaspan bench` (``--statistic mean``) and the authors'
benchmark script (same model, spans, batch and block; the mean of ``--steps`` steps after one
warm-up step, each in a fresh process; the authors' learning rate pinned so that their spans
stay put, see ``PINNED_SPANS``), one after the other; a configuration's figure is the
median over the rounds of each side, and the ratio is adaspan / authors of those medians. Every
round is printed too, with the machine's fp32 matmul rate measured by adaspan in that round.
``--dtype`` is adaspan's (the authors' code runs fp32); ``--baseline`` runs the ``adaspan bench``
of another source tree (e.g. a checkout of an earlier version's ``src``) in the same rounds,
before or after this one's in turn, and adds its figures and the ratio of this one to it.
Prints JSON lines (one per round, then one per configuration), then a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# name: (layers, d_model, heads, d_inner, S, spans, block, batch)
CONFIGS = {
    "reference": (4, 256, 4, 1024, 8192, "32,64,128,1024", 256, 8),
    "2-layers": (2, 256, 4, 1024, 8192, "32,64,128,1024", 256, 8),
    "fixed-1024": (4, 256, 4, 1024, 1024, "fixed", 256, 8),
    "8-layers": (8, 256, 4, 1024, 8192, "32,64,128,1024", 256, 8),
    "wide": (4, 512, 8, 2048, 8192, "32,64,128,1024", 256, 4),
    "wide-4096": (4, 512, 8, 2048, 4096, "32,64,128,1024", 256, 4),
    "spans-256": (4, 256, 4, 1024, 4096, "64,256,256,512", 256, 8),
    "block-512": (4, 256, 4, 1024, 8192, "32,64,128,1024", 512, 4),
    "block-128": (4, 256, 4, 1024, 8192, "32,64,128,1024", 128, 16),
    "heads-8": (4, 256, 8, 1024, 8192, "32,64,128,1024", 256, 8),
    "init": (4, 256, 4, 1024, 8192, "32", 256, 8),
    "long-spans": (4, 256, 4, 1024, 4096, "2048", 256, 8),
    "odd": (6, 384, 6, 1536, 4096, "32,100,300,700,2000,48", 200, 6),
    "race": (4, 256, 4, 1024, 1024, "93,60,56,38", 256, 8),  # spans a 10-minute run learned
    "tiny": (1, 32, 2, 64, 64, "40,48", 16, 2),  # for the test suite: the script runs
}


def model_options(config: tuple) -> list[str]:
    """The configuration's model as adaspan's KEY=VALUE options."""
    layers, d, heads, inner, span = config[:5]
    return [f"n_layers={layers}", f"d_model={d}", f"n_heads={heads}", f"d_inner={inner}",
            f"max_span={span}", "ramp=32", "dropout=0", "vocab_size=256"]


def adaspan(config: tuple, steps: int, device: str = "cpu", dtype: str = "auto",
            src: Path | None = None) -> dict:
    """``adaspan bench`` of ``config``; of the package in ``src`` where given."""
    spans, block, batch = config[5:]
    cmd = [sys.executable, "-m", "adaspan.cli", "bench", *model_options(config), "--spans",
           spans, "--block-size", str(block), "--batch-size", str(batch), "--steps", str(steps),
           "--statistic", "mean", "--gen-chars", "2", "--device", device, "--dtype", dtype,
           "--json"]
    return _json(cmd, {"PYTHONPATH": str(src.resolve())} if src else None)


# Runs the authors' benchmark script with the learning rate of its Adagrad pinned to adaspan
# bench's 1e-9, so that their spans stay at the configuration measured, as adaspan's do. At the
# script's own lr of 0.07 the first step moves a span by hundreds of tokens (spans 32/64/128/1024
# became 32/32/32/451 in one layer and 605/32/701/451 in the next), so the steps it times are
# of other spans than those asked for. The cost of an Adagrad step does not depend on its lr.
PINNED_SPANS = """
import os, runpy, sys, torch
torch.set_default_device(os.environ.get("ADASPAN_AUTHORS_DEVICE", "cpu"))
class Adagrad(torch.optim.Adagrad):
    def __init__(self, params, lr=0.0, **kwargs):
        super().__init__(params, lr=1e-9, **kwargs)
torch.optim.Adagrad = Adagrad
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def authors(official: Path, config: tuple, steps: int, as_provided: bool = False,
            device: str = "cpu") -> dict:
    """The authors' script (which has no device option: on CUDA its tensors are put there by
    ``torch.set_default_device``, with the spans pinned)."""
    layers, d, heads, inner, span, spans, block, batch = config
    runner = [sys.executable] if as_provided else [sys.executable, "-c", PINNED_SPANS]
    cmd = [*runner, str(official), "--layers", str(layers), "--hidden", str(d),
           "--heads", str(heads), "--inner", str(inner), "--span", str(span), "--spans", spans,
           "--block", str(block), "--batch", str(batch), "--steps", str(steps), "--ramp", "32"]
    return _json(cmd, {"ADASPAN_AUTHORS_DEVICE": device})


def _json(cmd: list[str], env: dict | None = None) -> dict:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, **(env or {})}).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(name: str, official: Path, rounds: int, steps: int, as_provided: bool,
            device: str = "cpu", dtype: str = "auto", baseline: Path | None = None) -> dict:
    """Alternating rounds of one configuration; medians and ratios."""
    config, rows = CONFIGS[name], []
    for round_ in range(rounds):
        order = ["adaspan", "baseline"] if baseline else ["adaspan"]
        if round_ % 2:  # every other round the baseline first: no side always runs first
            order.reverse()
        sides = {side: adaspan(config, steps, device, dtype, baseline if side == "baseline"
                               else None) for side in order}
        sides["authors"] = authors(official, config, steps, as_provided, device)
        ours = sides["adaspan"]
        row = {"config": name, "round": round_ + 1, "matmul_gflops": ours["matmul_gflops"],
               "dtype": ours.get("train_precision", ours.get("dtype")),
               **{f"{side}_{kind}": figures[f"{kind}_chars_per_s"]
                  for side, figures in sides.items() for kind in ("train", "eval")},
               "adaspan_train_gflops": ours["train_gflops"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    medians = {key: statistics.median(r[key] for r in rows) for key in rows[0]
               if key not in ("config", "round", "dtype")}
    summary = {"config": name, "dtype": rows[0]["dtype"], "rounds": rows, **medians,
               **{f"{kind}_ratio": medians[f"adaspan_{kind}"] / medians[f"authors_{kind}"]
                  for kind in ("train", "eval")}}
    if baseline:
        summary.update({f"{kind}_vs_baseline": medians[f"adaspan_{kind}"]
                        / medians[f"baseline_{kind}"] for kind in ("train", "eval")})
    return summary


def table(results: list[dict]) -> str:
    lines = ["| configuration | round | authors train / eval chars/s | adaspan train / eval "
             "chars/s | ratio train / eval | matmul GFLOP/s |", "|---|---|---|---|---|---:|"]
    for result in results:
        for r in result["rounds"]:
            lines.append(
                f"| {result['config']} | {r['round']} | {r['authors_train']:,.0f} / "
                f"{r['authors_eval']:,.0f} | {r['adaspan_train']:,.0f} / {r['adaspan_eval']:,.0f}"
                f" | {r['adaspan_train'] / r['authors_train']:.2f}x / "
                f"{r['adaspan_eval'] / r['authors_eval']:.2f}x | {r['matmul_gflops']:.0f} |")
        lines.append(f"| **{result['config']}** | median | {result['authors_train']:,.0f} / "
                     f"{result['authors_eval']:,.0f} | {result['adaspan_train']:,.0f} / "
                     f"{result['adaspan_eval']:,.0f} | **{result['train_ratio']:.2f}x / "
                     f"{result['eval_ratio']:.2f}x** | {result['matmul_gflops']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", type=Path, required=True,
                        help="the authors' benchmark script (bench_official.py)")
    parser.add_argument("--configs", default="reference,fixed-1024",
                        help=f"comma-separated, from: {', '.join(CONFIGS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, help="also write the results as JSON")
    parser.add_argument("--as-provided", action="store_true",
                        help="run the authors' script unchanged: its Adagrad (lr 0.07) moves "
                             "the spans during the timed steps (default: lr pinned to 1e-9)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="adaspan's products (the authors' code runs fp32)")
    parser.add_argument("--baseline", type=Path, metavar="SRC",
                        help="also time the adaspan package in SRC (e.g. an older version's "
                             "src directory), in the same rounds")
    args = parser.parse_args()
    names = [name.strip() for name in args.configs.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(CONFIGS)}")
    results = [measure(name, args.official, args.rounds, args.steps, args.as_provided,
                       args.device, args.dtype, args.baseline) for name in names]
    for result in results:
        print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
