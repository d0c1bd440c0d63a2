"""``adaspan longeval``: a Hugging Face causal LM on synthetic long-context retrieval."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..data.corpora import resolve_data
from ..runtime.precision import choose
from .options import add_output, add_runtime, command, json_line, positive_int, positive_ints


def add_longeval(commands) -> None:
    p = command(commands, "longeval", _longeval)
    p.add_argument("model_dir", type=Path, metavar="MODEL_DIR",
                   help="a Hugging Face causal LM and its tokenizer (save_pretrained), with "
                   "its spans where it has them (adaptive_spans.json)")
    p.add_argument("--haystack", required=True, metavar="TEXT",
                   help="text file (plain, .gz or .zip) or corpus name: the text the "
                   "statements are hidden in")
    p.add_argument("--tasks", type=names, metavar="LIST",
                   help="tasks separated by commas (default: every task: passkey, "
                   "single_needle, multi_key, multi_value, variable_tracking, word_passkey)")
    p.add_argument("--lengths", type=positive_ints, default=[1024, 2048], metavar="LIST",
                   help="context lengths in tokens, prompt and answer (default: 1024,2048)")
    p.add_argument("--depths", type=fractions, default=[0.0, 0.25, 0.5, 0.75, 1.0],
                   metavar="LIST", help="where the needle sits, fractions of the haystack's "
                   "tokens (default: 0,0.25,0.5,0.75,1)")
    p.add_argument("--samples", type=positive_int, default=4, metavar="N",
                   help="prompts per task, length and depth")
    p.add_argument("--cache", default="full", metavar="POLICY",
                   help="cache policy: full (every key and value), spans (the model's "
                   "SpanCache), or another registered one; NAME:KEY=VALUE,... gives it options")
    p.add_argument("--seed", type=int, default=0,
                   help="sample i is drawn from seed + i (the same at every length and depth)")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="directory for longeval.json, longeval.md and a heatmap per task")
    p.add_argument("--no-plots", action="store_true", help="no heatmaps in --out")
    add_runtime(p, "fp32")
    add_output(p, "print the results as JSON", progress=True)


def names(text: str) -> list[str]:
    """argparse type: names separated by commas."""
    values = [part.strip() for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of names separated by commas")
    return values


def fractions(text: str) -> list[float]:
    """argparse type: numbers in [0, 1] separated by commas (``0,0.5,1``)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= value <= 1 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers in [0, 1] "
                                         "separated by commas, e.g. 0,0.5,1")
    return values


def _longeval(args: argparse.Namespace) -> int:
    """Score a Hugging Face causal LM on synthetic long-context retrieval.

    Hide statements (a pass key, magic numbers for keys, chains of variables) at several
    depths of a haystack text, at several context lengths, and ask for them at the end; each
    prompt is answered by greedy decoding, with the chosen cache policy, and is right when
    every expected value is a word of the answer. Prints accuracy per task, length and depth
    and the bytes of keys and values held after each prompt; with --out, writes longeval.json,
    longeval.md and a heatmap per task there (see docs/longeval.md)."""
    from ..hf.longeval import Grid, has_spans, longeval, markdown, write
    from ..hf.needles import TASKS
    from ..measure.plots import require_plots

    plots = args.out is not None and not args.no_plots
    if plots:
        require_plots()  # before the model runs: matplotlib missing is a one-line error
    grid = Grid(tuple(args.tasks or TASKS), tuple(args.lengths), tuple(args.depths),
                args.samples, args.seed)
    if args.cache.partition(":")[0] == "full" and has_spans(args.model_dir):
        print(f"adaspan: note: {args.model_dir} has spans: --cache full holds every key and "
              "value, but the spans still weigh them; for full attention, score the model "
              "they were retrofitted from", file=sys.stderr)
    results = longeval(args.model_dir, resolve_data(args.haystack), grid, args.cache,
                       choose(args.dtype, args.device, "score"), not args.no_progress)
    if args.out is not None:
        write(args.out, results, plots)
    print(json_line(results) if args.json else markdown(results), end="\n" if args.json else "")
    return 0
