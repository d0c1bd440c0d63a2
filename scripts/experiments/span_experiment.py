"""Do learned spans grow to the distance the data needs? Train a grid of runs on a synthetic
corpus and print, per run, the spans its heads learned (and when), its bpc by the distance back
to the character a target repeats, and its FLOPs per character, as one JSON document.

    python scripts/experiments/span_experiment.py --grid copy --out runs/spans-copy
    python scripts/experiments/span_experiment.py --grid words --out runs/spans-words
    python scripts/experiments/span_experiment.py --grid copy --runs fixed-32 --steps 2 \
        --data "synthetic:copy?length=20000" --out /tmp/x          # a tiny run: does it run

Finished runs in ``--out`` are reused. ``--figure FILE.png`` draws each run's spans against
steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaspan.data.corpora import load_corpus, source_distance
from adaspan.model.analysis import flops_per_char
from adaspan.resolve import resolve_config
from adaspan.run.checkpoint import RunComplete, RunDir, load_model
from adaspan.run.metrics import read_metrics
from adaspan.training.evaluate import bpc_by_distance, evaluate
from adaspan.training.train import train

# The model and recipe every run shares; a run overrides some of it.
COMMON = ["n_layers=1", "d_model=32", "n_heads=2", "d_inner=64", "dropout=0",
          "optimizer=adamw", "lr=1e-2", "warmup=20", "clip=1.0", "clip_mode=global",
          "weight_decay=0", "batch_size=16", "block_size=64", "log_interval=50",
          "eval_interval=500", "checkpoint_interval=500", "eval_chars=8192",
          "tensorboard=false", "device=cpu"]
COPY = "synthetic:copy?min=64&max=64&segment=16&gap_min=8&gap_max=16&length=500000"
COPY_FAR = "synthetic:copy?min=192&max=192&segment=16&gap_min=8&gap_max=16&length=1000000"
WORDS = "synthetic:words?vocab=2000&length=1000000"
GRIDS: dict[str, tuple[str, int, dict[str, list[str]]]] = {
    # corpus, steps, run name -> overrides
    "copy": (COPY, 2000, {
        "fixed-32": ["attention=fixed", "max_span=32"],
        "fixed-128": ["attention=fixed", "max_span=128"],
        "adaptive": ["attention=adaptive", "max_span=512"],
        "adaptive-no-penalty": ["attention=adaptive", "max_span=512", "span_loss_coef=0"],
        "adaptive-ramp-128": ["attention=adaptive", "max_span=512", "ramp=128"],
        "adaptive-init-0.25": ["attention=adaptive", "max_span=512", "span_init=0.25"],
        "adaptive-init-1": ["attention=adaptive", "max_span=512", "span_init=1"],
        "adaptive-penalty-1e-4": ["attention=adaptive", "max_span=512", "span_loss_coef=1e-4"],
        "adaptive-penalty-1e-3": ["attention=adaptive", "max_span=512", "span_loss_coef=1e-3"],
    }),
    "copy-far": (COPY_FAR, 3000, {
        "fixed-256": ["attention=fixed", "max_span=256"],
        "adaptive": ["attention=adaptive", "max_span=512"],
        "adaptive-ramp-256": ["attention=adaptive", "max_span=512", "ramp=256"],
        "adaptive-init-0.5": ["attention=adaptive", "max_span=512", "span_init=0.5"],
    }),
    "words": (WORDS, 1500, {
        "fixed-64": ["attention=fixed", "max_span=64", "n_layers=2", "d_model=64",
                     "d_inner=128"],
        "fixed-512": ["attention=fixed", "max_span=512", "n_layers=2", "d_model=64",
                      "d_inner=128"],
        "adaptive": ["attention=adaptive", "max_span=512", "n_layers=2", "d_model=64",
                     "d_inner=128"],
    }),
}


def run_one(out: Path, name: str, data: str, steps: int, overrides: list[str],
            threads: int | None) -> dict:
    """Train (or reuse) run ``name`` and measure it."""
    extra = [f"threads={threads}"] if threads else []
    model_config, train_config = resolve_config(
        None, None, [*COMMON, f"data={data}", f"steps={steps}", *overrides, *extra])
    run_dir = out / name
    summary = train(model_config, train_config, run_dir, resume=run_dir.exists(),
                    progress=False, log=lambda line: None)
    if isinstance(summary, RunComplete):
        summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps(summary))
    model = load_model(run_dir, "cpu")
    result = evaluate(model, load_corpus(data).valid, batch_size=1,
                      block_size=train_config.block_size, token_logprobs=True)
    events = [e for e in read_metrics(RunDir(run_dir).metrics_file) if "head_spans" in e]
    return {
        "run": name, "overrides": overrides, "steps": summary["steps"],
        "valid_bpc": result["bpc"],
        "by_distance": bpc_by_distance(result, source_distance(data, "valid")),
        "spans": model.spans(),
        "span_history": [(e["step"], e["head_spans"]) for e in events],
        "flops_per_char": flops_per_char(model, train_config.block_size),
        "chars_per_s": summary["chars_per_s"],
    }


def draw(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, result in enumerate(results):
        steps = [step for step, _ in result["span_history"]]
        flat = [[s for layer in spans for s in layer] for _, spans in result["span_history"]]
        heads = zip(*flat, strict=True)
        for h, line in enumerate(heads):
            ax.plot(steps, line, color=plt.cm.tab10(i % 10),
                    label=result["run"] if h == 0 else None)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("span of each head (tokens)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", choices=GRIDS, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", help="comma-separated subset of the grid's runs")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--figure", type=Path)
    parser.add_argument("--steps", type=int, help="steps of every run (default: the grid's)")
    parser.add_argument("--data", help="the corpus of every run (default: the grid's)")
    args = parser.parse_args()
    data, steps, grid = GRIDS[args.grid]
    data, steps = args.data or data, args.steps or steps
    names = args.runs.split(",") if args.runs else list(grid)
    results = [run_one(args.out, name, data, steps, grid[name], args.threads) for name in names]
    if args.figure:
        draw(results, args.figure)
    print(json.dumps({"data": data, "steps": steps, "common": COMMON, "runs": results}))


if __name__ == "__main__":
    main()
