"""Does a version learn worse per step? Train two versions of adaspan (git refs or source
trees) with the same recipe for the same steps on the same text over several seeds, score every
run with one evaluator, and print each version's scores, mean and spread, and the difference
with its uncertainty (Welch's t; paired by seed as well, since a seed fixes the initial weights
and the data order in both). One JSON object on stdout; progress on stderr.

    python scripts/experiments/learning_check.py --versions 399c9e9 HEAD --data TEXT --steps 2700 \\
        --seeds 1234,7,1,2,3 --jobs 2 --work runs/learning-check [--plot check.png]

A version is a git ref of this repository (exported with ``git archive``) or a directory that
holds ``src/adaspan`` or ``adaspan``; each trains with its own code. Every run is scored by
``adaspan evaluate --split valid --max-chars N`` of the tree that runs this script (fp32), so
the versions are measured by the same thing. Runs already scored in ``--work`` are reused: the
check can be stopped and started again. ``--set KEY=VALUE`` options are given to one version's
runs only (``--set B lr_schedule=cosine``), to compare settings with the same code.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from statistics import NormalDist, mean, stdev
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
# The recipe of the regression report: adaspan train on a 10M-character text, bf16 where fast.
RECIPE = ["n_layers=4", "d_model=256", "n_heads=4", "d_inner=1024", "max_span=1024", "ramp=32",
          "dropout=0", "batch_size=8", "block_size=256", "optimizer=adamw", "lr=1e-3",
          "weight_decay=0", "clip=1", "clip_mode=global", "warmup=100", "span_loss_coef=2e-6"]
QUIET = ["tensorboard=false", "log_interval=100", "eval_chars=200000"]


def student_t_quantile(p: float, df: float) -> float:
    """The p-quantile (p > 0.5) of Student's t with ``df`` degrees of freedom: bisection on
    its CDF, the density integrated by Simpson's rule (no SciPy needed)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, n: int = 2000) -> float:
        h = x / n
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def summary(scores: list[float]) -> dict:
    """Mean, sample standard deviation and standard error of ``scores``."""
    sd = stdev(scores) if len(scores) > 1 else float("nan")
    return {"n": len(scores), "mean": mean(scores), "sd": sd, "se": sd / math.sqrt(len(scores))}


def t_value(diff: float, se: float) -> float | None:
    """diff / se; None where the runs agree exactly (no spread: the same code and seeds)."""
    return diff / se if se > 0 else None


def difference(a: list[float], b: list[float]) -> dict:
    """b − a: Welch's standard error, degrees of freedom and 95% interval."""
    sa, sb = summary(a), summary(b)
    va, vb = sa["se"] ** 2, sb["se"] ** 2
    se = math.sqrt(va + vb)
    d = sb["mean"] - sa["mean"]
    if se == 0:
        return {"diff": d, "se": 0.0, "df": None, "ci95": [d, d], "t": t_value(d, se)}
    df = (va + vb) ** 2 / (va ** 2 / (sa["n"] - 1) + vb ** 2 / (sb["n"] - 1))
    half = student_t_quantile(0.975, df) * se
    return {"diff": d, "se": se, "df": df, "ci95": [d - half, d + half], "t": t_value(d, se)}


def paired(a: dict[int, float], b: dict[int, float]) -> dict | None:
    """b − a over the seeds both have: mean, standard error and 95% interval."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    s = summary([b[seed] - a[seed] for seed in seeds])
    half = student_t_quantile(0.975, s["n"] - 1) * s["se"] if s["se"] > 0 else 0.0
    return {"seeds": seeds, "diff": s["mean"], "sd": s["sd"], "se": s["se"],
            "ci95": [s["mean"] - half, s["mean"] + half], "t": t_value(s["mean"], s["se"])}


def seeds_needed(sd: float, delta: float = 0.02, power: float = 0.8,
                 paired: bool = False) -> int:
    """Seeds per version for a two-sided 5% test to see a difference ``delta`` with the given
    power: 2 (z_0.975 + z_power)² sd² / delta² when one run's score spreads by ``sd``, or
    (z_0.975 + z_power)² sd² / delta² when ``sd`` is that of the differences seed by seed."""
    z = NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(power)
    return max(2, math.ceil((1 if paired else 2) * (z * sd / delta) ** 2))


def source_tree(version: str, work: Path) -> Path:
    """The directory to put on PYTHONPATH for ``version``: a tree's ``src`` (or the tree), or
    a git ref exported once under ``work/trees``."""
    path = Path(version)
    if path.is_dir():
        return path / "src" if (path / "src" / "adaspan").is_dir() else path
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{version}^{{commit}}"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout.strip()
    tree = work / "trees" / sha[:12]
    if not (tree / "src" / "adaspan").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, "src"], cwd=ROOT, check=True,
                                 capture_output=True).stdout
        archive_path = tree / "src.tar"
        archive_path.write_bytes(archive)
        with tarfile.open(archive_path) as tar:
            tar.extractall(tree, filter="data")
        archive_path.unlink()
    return tree / "src"


def adaspan(tree: Path, *args: str) -> str:
    """Run ``python -m adaspan.cli ARGS`` with ``tree`` first on the path; its stdout."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "adaspan.cli", *args], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"adaspan {' '.join(args[:3])} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def one_run(tree: Path, scorer: Path, run: Path, options: list[str], max_chars: int) -> float:
    """Train (unless scored before) and score one run: the validation bits per byte."""
    score_file = run / "learning_check.json"
    if score_file.exists():
        return json.loads(score_file.read_text())["bpc"]
    if run.exists():  # an interrupted run: start it again
        shutil.rmtree(run)
    adaspan(tree, "train", "--run-dir", str(run), *options)
    result = last_json(adaspan(scorer, "evaluate", str(run), "--split", "valid", "--max-chars",
                               str(max_chars), "--json"))
    score_file.write_text(json.dumps({"bpc": result["bpc"], "options": options}))
    return result["bpc"]


def valid_curve(run: Path) -> dict[int, float]:
    """The training's own validations (``metrics.jsonl``): step -> valid bpc."""
    curve = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        value = record.get("valid_bpc")
        if value is not None:
            curve[record["step"]] = value
    return curve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", nargs=2, metavar=("A", "B"), default=["HEAD", str(ROOT)],
                   help="two git refs or source trees (default: HEAD against the work tree)")
    p.add_argument("--data", required=True, help="the text every run trains on")
    p.add_argument("--steps", type=int, default=2700)
    p.add_argument("--seeds", default="1234,7,1,2,3", help="comma-separated")
    p.add_argument("--recipe", nargs="*", default=RECIPE, help="KEY=VALUE for adaspan train")
    p.add_argument("--set", nargs=2, action="append", default=[], metavar=("A|B", "KEY=VALUE"),
                   help="an option for one version's runs only")
    p.add_argument("--eval-interval", type=int, default=0,
                   help="steps between the runs' own validations (0: at the end only)")
    p.add_argument("--max-chars", type=int, default=200_000, help="validation characters scored")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (threads: cores / jobs)")
    p.add_argument("--work", default="runs/learning-check", help="run directories and trees")
    p.add_argument("--plot", help="also draw the runs' curves and the seeds needed (a PNG)")
    args = p.parse_args(argv)
    args.seeds = [int(s) for s in args.seeds.split(",")]
    if any(which not in ("A", "B") for which, _ in args.set):
        p.error("--set takes A or B, then KEY=VALUE")
    return args


class Task(NamedTuple):
    label: str  # "A" or "B"
    seed: int
    tree: Path  # the version's code
    run: Path  # its run directory
    options: list[str]  # adaspan train's KEY=VALUE


def plan(args: argparse.Namespace, work: Path) -> list[Task]:
    """One run per version and seed, each in ``work/LABEL-VERSION/seed-N``."""
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    interval = args.eval_interval or args.steps
    tasks = []
    for label, version in zip("AB", args.versions, strict=True):
        tree = source_tree(version, work)
        extra = [kv for which, kv in args.set if which == label]
        name = f"{label}-{Path(version).name or version}".replace("/", "_")
        for seed in args.seeds:
            options = [f"data={Path(args.data).resolve()}", *args.recipe, *QUIET, *extra,
                       f"steps={args.steps}", f"seed={seed}", f"threads={threads}",
                       f"eval_interval={interval}", f"checkpoint_interval={args.steps}"]
            tasks.append(Task(label, seed, tree, work / name / f"seed-{seed}", options))
    return tasks


def run_all(tasks: list[Task], jobs: int, max_chars: int) -> dict[str, dict[int, float]]:
    """Every task's score, ``jobs`` at a time; a line on stderr as each one ends."""
    scorer, scores, start = ROOT / "src", {"A": {}, "B": {}}, time.monotonic()
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(one_run, t.tree, scorer, t.run, t.options, max_chars): t
                   for t in tasks}
        for done, future in enumerate(as_completed(futures), 1):
            task = futures[future]
            scores[task.label][task.seed] = future.result()
            print(f"[{done}/{len(tasks)}, {(time.monotonic() - start) / 60:.1f} min] "
                  f"{task.label} seed {task.seed}: {scores[task.label][task.seed]:.4f} bpc",
                  file=sys.stderr)
    return {label: dict(sorted(by_seed.items())) for label, by_seed in scores.items()}


def by_step(tasks: list[Task]) -> dict[int, dict]:
    """The runs' own validations at each step: each version's spread, the pooled spread and
    the spread of the differences seed by seed, and the seeds per version that a difference
    of 0.02 bpc needs there, unpaired and paired."""
    curves = {label: {t.seed: valid_curve(t.run) for t in tasks if t.label == label}
              for label in "AB"}
    out = {}
    for step in sorted({s for c in curves["A"].values() for s in c}):
        a, b = ({seed: c[step] for seed, c in curves[label].items() if step in c}
                for label in "AB")
        pooled = math.sqrt((summary(list(a.values()))["sd"] ** 2
                            + summary(list(b.values()))["sd"] ** 2) / 2)
        pairs = paired(a, b)
        out[step] = {"A": summary(list(a.values())), "B": summary(list(b.values())),
                     "pooled_sd": pooled, "seeds_for_0.02": seeds_needed(pooled),
                     "paired_sd": pairs and pairs["sd"],
                     "paired_seeds_for_0.02": pairs and seeds_needed(pairs["sd"], paired=True)}
    return out


def plot(tasks: list[Task], steps: dict[int, dict], names: list[str], path: Path) -> None:
    """The runs' validation curves, one line per seed, A and B in two colours (left), and the
    seeds per version that a difference of 0.02 bpc needs at each step (right), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, seeds) = plt.subplots(1, 2, figsize=(10, 4))
    for label, name, colour in zip("AB", names, ("tab:blue", "tab:orange"), strict=True):
        for i, task in enumerate(t for t in tasks if t.label == label):
            curve = valid_curve(task.run)
            curves.plot(list(curve), list(curve.values()), color=colour, alpha=0.7,
                        marker="o", label=f"{label}: {name}" if i == 0 else None)
    curves.set(xlabel="step", ylabel="valid bits per byte", title="each seed's run")
    curves.legend()
    seeds.plot(list(steps), [s["seeds_for_0.02"] for s in steps.values()], marker="o",
               label="unpaired")
    if all(s["paired_seeds_for_0.02"] for s in steps.values()):
        seeds.plot(list(steps), [s["paired_seeds_for_0.02"] for s in steps.values()],
                   marker="o", label="paired by seed")
    seeds.legend()
    seeds.set(xlabel="step", ylabel="seeds per version", yscale="log",
              title="to see 0.02 bpc (5% test, power 0.8)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tasks = plan(args, Path(args.work).resolve())
    try:
        scores = run_all(tasks, args.jobs, args.max_chars)
    except RuntimeError as exc:  # a run that failed: its command and the end of its stderr
        sys.exit(f"learning_check: error: {exc}")
    a, b = list(scores["A"].values()), list(scores["B"].values())
    steps = by_step(tasks)
    if args.plot:
        names = [" ".join([version, *(kv for which, kv in args.set if which == label)])
                 for label, version in zip("AB", args.versions, strict=True)]
        plot(tasks, steps, names, Path(args.plot))
    print(json.dumps({
        "versions": dict(zip("AB", args.versions, strict=True)), "steps": args.steps,
        "data": str(Path(args.data).resolve()), "max_chars": args.max_chars,
        "recipe": args.recipe, "set": args.set,
        "scores": {label: {str(s): v for s, v in scores[label].items()} for label in "AB"},
        "A": summary(a), "B": summary(b), "welch": difference(a, b),
        "paired": paired(scores["A"], scores["B"]), "valid_by_step": steps}))


if __name__ == "__main__":
    main()
