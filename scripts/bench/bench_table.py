"""Regenerates the table "What the adaptive span saves" of docs/performance.md (and
docs/measurements/bench.json): `adaspan bench` of adaptive spans against fixed spans, one
configuration per process, in one run.

Usage: python scripts/bench/bench_table.py [--steps 5] [--rounds 3]
           [--out docs/measurements/bench.json]
       python scripts/bench/bench_table.py --from docs/measurements/bench.json  # the tables only

Each configuration runs in its own `adaspan bench` process (so peak RSS is per configuration),
one after the other; the whole list is run ``--rounds`` times, alternating, and each figure is
the median of the rounds. Model: 4 layers, d 256, 4 heads, FF 1024, block 256, batch 8,
ramp 32, vocab 256, no dropout. adaspan against the authors' code is measured side by side by
scripts/bench/against_official.py, not here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

MODEL = ["n_layers=4", "d_model=256", "n_heads=4", "d_inner=1024", "ramp=32", "vocab_size=256",
         "dropout=0"]
SPANS = "32,64,128,1024"
ADAPTIVE = "adaptive S=8192, spans 32/64/128/1024"
CONFIGS = {
    ADAPTIVE: (["max_span=8192"], SPANS),
    "same, per-layer truncation": (["max_span=8192", "truncation=layer"], SPANS),
    "same, bfloat16 autocast": (["max_span=8192"], SPANS, "bfloat16"),
    "fixed S=8192": (["max_span=8192"], "fixed"),
    "fixed S=1024": (["max_span=1024"], "fixed"),
    "adaptive S=4096, all spans 32": (["max_span=4096"], "32"),
    "fixed S=4096": (["max_span=4096"], "fixed"),
}
# (row, numerator, denominator, figure): ratios of figures measured in the same run
RATIOS = [
    ("adaptive S=8192 against fixed S=8192", ADAPTIVE, "fixed S=8192"),
    ("adaptive S=8192 against fixed S=1024", ADAPTIVE, "fixed S=1024"),
    ("adaptive S=4096, all spans 32, against fixed S=4096", "adaptive S=4096, all spans 32",
     "fixed S=4096"),
]
RATES = ("train_chars_per_s", "eval_chars_per_s", "generate_chars_per_s")


def run(model: list[str], spans: str, dtype: str = "float32", steps: int = 5) -> dict:
    cmd = [sys.executable, "-m", "adaspan.cli", "bench", *MODEL, *model, "--spans", spans,
           "--dtype", dtype, "--steps", str(steps), "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--from", dest="source", type=Path, help="print the tables of a JSON")
    args = parser.parse_args()
    if args.source:
        results = json.loads(args.source.read_text())
    else:
        runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
        for round_ in range(args.rounds):
            for name, (model, spans, *dtype) in CONFIGS.items():
                runs[name].append(run(model, spans, *dtype, steps=args.steps))
                print(round_, name, json.dumps(runs[name][-1]), file=sys.stderr, flush=True)
        results = {name: median_of(figures) for name, figures in runs.items()}
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))
    print(table(results) + "\n\n" + ratios(results))


def median_of(runs: list[dict]) -> dict:
    """Per numeric figure, the median of several runs of one configuration."""
    medians = {key: statistics.median(r[key] for r in runs) if isinstance(value, float)
               else value for key, value in runs[0].items()}
    return {**medians, "rounds": len(runs)}


def _peak_mb(result: dict) -> float:
    """The process's peak memory (``peak_memory_mb`` in the JSON of adaspan 0.5.0 and before)."""
    return result.get("process_peak_mb", result.get("peak_memory_mb"))


def table(results: dict) -> str:
    rows = ["| configuration | train chars/s | eval chars/s | generate chars/s | peak RSS MB | "
            "model GFLOP/s (train) |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        rows.append(f"| {name} | {r['train_chars_per_s']:,.0f} | {r['eval_chars_per_s']:,.0f} | "
                    f"{r['generate_chars_per_s']:,.1f} | {_peak_mb(r):,.0f} | "
                    f"{r['train_gflops']:.1f} |")
    rates = [r["matmul_gflops"] for r in results.values()]
    rows.append(f"\nfp32 matmul rate measured alongside (2048² product): {min(rates):.0f}–"
                f"{max(rates):.0f} GFLOP/s.")
    return "\n".join(rows)


def ratios(results: dict) -> str:
    """Speed-ups (train, eval, generate) and the memory ratio of the rows of :data:`RATIOS`."""
    lines = ["| comparison | train | eval | generate | peak RSS |", "|---|---:|---:|---:|---:|"]
    for name, a, b in RATIOS:
        speed = [results[a][key] / results[b][key] for key in RATES]
        memory = _peak_mb(results[a]) / _peak_mb(results[b])
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}×" for x in speed) +
                     f" | {memory:.2f}× |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
