"""Commands that read a run: evaluate, generate, inspect, report."""

from __future__ import annotations

import argparse
import codecs
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..data.corpora import source_distance
from ..data.synthetic import is_synthetic
from ..measure.generate import stream
from ..measure.plots import plot_curves, plot_spans
from ..measure.report import (
    is_longeval_report,
    run_events,
    write_longeval_report,
    write_report,
)
from ..measure.tables import evaluation_text, record_line, span_table, trajectory_table
from ..model.analysis import head_span_history, span_summary, span_trajectories
from ..run.checkpoint import RunDir, load_model
from ..run.tokens import run_codec, run_split
from ..runtime.precision import choose
from ..training.evaluate import bpc_by_distance, evaluate, short_context
from .options import (
    add_output,
    add_runtime,
    command,
    json_line,
    positive_int,
    positive_ints,
)


def add_evaluate(commands) -> None:
    p = command(commands, "evaluate", _evaluate, run_dir=True)
    p.add_argument("--data", help="corpus (default: the one the run was trained on); for a run "
                   "made by convert-official, a directory in the authors' format")
    p.add_argument("--data-dir", help="cache directory for enwik8/text8")
    p.add_argument("--split", choices=("train", "valid", "test"), default="valid",
                   help="the part of the corpus to score")
    p.add_argument("--batch-size", type=positive_int, default=8,
                   help="parallel streams (paper: 8); each starts without context, so the "
                   "first characters of each have less of it: 1 scores the split as one "
                   "stream")
    p.add_argument("--block-size", type=positive_int,
                   help="characters per block (default: the run's)")
    p.add_argument("--max-chars", type=positive_int,
                   help="score only the first N characters of the split (a contiguous prefix)")
    add_runtime(p, "fp32 with TF32 off on any device, so the bpc does not depend on the hardware")
    p.add_argument("--token-logprobs", type=Path, metavar="FILE.npy",
                   help="save the natural-log probability of every scored token (float32, "
                   "stream after stream: text order with --batch-size 1)")
    add_output(p, "end with one JSON line of results", progress=True)


def _evaluate(args: argparse.Namespace) -> int:
    """Bits per character of a trained model on a split.

    The split is cut into as many streams as the batch size, read block by block, the cache
    carried from one block to the next. The output says what was scored: characters, streams,
    block size, the cache carried, and how many characters were scored with less context than
    the longest span (the first ones of each stream; a batch size of 1 scores the split as one
    stream)."""
    run = RunDir(args.run_dir)
    tokens, name, unit, ends, unk = run_split(run, args.split, args.data, args.data_dir,
                                              progress=not args.no_progress)
    block_size = args.block_size or run.load_config()[1].block_size
    model = load_model(run, args.device)
    synthetic = is_synthetic(name)
    result = evaluate(model, tokens, batch_size=args.batch_size, block_size=block_size,
                      progress=not args.no_progress, max_chars=args.max_chars, dtype=args.dtype,
                      token_logprobs=args.token_logprobs is not None or synthetic, ends=ends,
                      unk=unk)
    if synthetic:
        result["by_distance"] = bpc_by_distance(result, source_distance(name, args.split))
    logprobs = result.pop("token_logprobs", None)
    if args.token_logprobs is not None:
        np.save(args.token_logprobs, logprobs)
    result = {**result, **short_context(model, result), "split": args.split, "data": name,
              "unit": unit, **result["precision"]}  # dtype, tf32, device, torch: what ran
    del result["precision"]
    print(json_line(result) if args.json else evaluation_text(result, unit))
    return 0

def add_generate(commands) -> None:
    p = command(commands, "generate", _generate, run_dir=True)
    p.add_argument("--prompt", default="", help="text to continue (default: none, the "
                   "start of a line)")
    p.add_argument("--length", type=int, default=500, help="tokens to generate (bytes for a "
                   "byte-level run)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the log-probabilities before sampling; 0 = greedy")
    p.add_argument("--top-k", type=positive_int,
                   help="sample among the k most likely tokens only (default: among all)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling: a seed gives the same text at every call (the "
                   "default one too); pass another seed for another sample")
    add_runtime(p, "fp32 (TF32 on CUDA): one token at a time, bf16 is not faster on the "
                 "CPUs measured")
    add_output(p, "no streaming: print one JSON object with the text and its speed")


def _generate(args: argparse.Namespace) -> int:
    """Sample text from a trained model.

    Print the prompt, then each character as it is sampled."""
    run = RunDir(args.run_dir)
    codec = run_codec(run)
    model = load_model(run, args.device)
    precision = choose(args.dtype, args.device, "generate")
    with precision.applied():  # the tokens are computed as they are read
        _sample(args, model, codec, precision)
    return 0


def _sample(args: argparse.Namespace, model, codec, precision) -> None:
    """Stream (or, with --json, time) the sampled text of ``_generate``."""
    typed = os.fsencode(args.prompt)  # the bytes typed, UTF-8 or not
    shown = typed.decode("utf-8", errors="replace")
    prompt = codec.encode(typed or b"\n").ids  # empty: a line start
    tokens = stream(model, prompt.tolist(), args.length, args.temperature, args.top_k,
                    torch.Generator().manual_seed(args.seed))
    pieces = codec.pieces(tokens)
    if args.json:
        tic = time.perf_counter()
        text = b"".join(pieces)
        seconds = time.perf_counter() - tic
        rate = (lambda n: round(n / seconds, 3) if seconds else None)  # noqa: E731
        print(json.dumps({"prompt": shown, "text": text.decode("utf-8", errors="replace"),
                          "tokens": args.length, "chars": len(text), "seconds": round(seconds, 6),
                          "tokens_per_s": rate(args.length), "chars_per_s": rate(len(text)),
                          **precision.record()}))
    else:
        _write_stream(shown, pieces)


def _write_stream(prompt: str, pieces) -> None:
    """Write ``prompt``, then the bytes of each token of ``pieces`` as they come (UTF-8
    decoded incrementally: a character split over tokens is written when complete)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    sys.stdout.write(prompt)
    sys.stdout.flush()
    for piece in pieces:
        text = decoder.decode(piece)
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write(decoder.decode(b"", final=True) + "\n")
    sys.stdout.flush()

def add_inspect(commands) -> None:
    p = command(commands, "inspect", _inspect, run_dir=True)
    p.add_argument("--plot", type=Path, metavar="DIR",
                   help="write spans.png and curves.png into DIR (e.g. the run directory)")
    add_output(p, "print spans and summary as JSON")


def _inspect(args: argparse.Namespace) -> int:
    """Learned spans, training curves and plots of a run.

    Print the span of every head, each head's span at the first and the last record of
    metrics.jsonl and its largest over the records, and the last record."""
    model = load_model(args.run_dir)
    spans = model.spans()
    events = run_events(args.run_dir)
    trajectories = span_trajectories(head_span_history(events))
    if args.json:
        print(json_line({"spans": spans, **span_summary(spans),
                          "parameters": model.num_parameters(),
                          "span_trajectories": trajectories}))
    else:
        cfg = model.config
        print(f"{args.run_dir}: {cfg.attention} attention, {cfg.n_layers} layers x "
              f"{cfg.n_heads} heads, S={cfg.max_span}, {model.num_parameters():,} parameters")
        print(span_table(spans))
        if trajectories["steps"]:
            print(trajectory_table(trajectories))
        for event in events[-1:]:
            print(f"last record: {record_line(event)}")
    if args.plot:
        for path in (plot_spans(spans, args.plot / "spans.png", model.config.max_span),
                     plot_curves(events, args.plot / "curves.png")):
            print(f"wrote {path}")
    return 0

def add_report(commands) -> None:
    p = command(commands, "report", _report)
    p.add_argument("dirs", type=Path, nargs="+", metavar="DIR",
                   help="a training run directory, or one or more directories of adaspan "
                   "longeval --out (longeval.json): their cache policies side by side")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="output directory [a run: RUN_DIR/report; one longeval output: its "
                   "directory; several: required]")
    p.add_argument("--text", help="a run: text of the Figure 5 panel (dynamic spans) [a piece "
                   "of the run's valid split]")
    p.add_argument("--limits", type=positive_ints, default="256,512,1024,2048,4096,8192",
                   help="a run: span limits S of the Figure 3 panel [default: %(default)s]")
    p.add_argument("--no-memory", action="store_true",
                   help="a run: skip the memory probe (one training step per limit and curve)")
    p.add_argument("--device", default="cpu",
                   help="a run: where the model and memory probe run")


def _report(args: argparse.Namespace) -> int:
    """One HTML page with a run's curves, spans and the paper's figures, or with long-context
    evaluations side by side.

    For a run directory, write OUT/report.html, a self-contained page (figures embedded): the
    configuration, bpc curves, spans during training, the final spans (paper Figure 4), FLOPs
    and memory against the span limit (Figure 3) and, for dynamic spans, the span along a text
    (Figure 5); and OUT/report.json, the numbers behind the figures.

    For directories written by adaspan longeval --out (they hold longeval.json), write
    OUT/report.html: what was evaluated (model, cache policy and its options, haystack, tasks,
    lengths, depths, samples, the bytes held), the accuracy per task and policy, and a heatmap
    per task, a row per policy (see docs/longeval.md)."""
    if is_longeval_report(args.dirs):
        page = write_longeval_report(args.dirs, args.out)
    else:
        page = write_report(args.dirs[0], args.out, args.text, args.limits,
                            not args.no_memory, args.device)
    print(f"wrote {page}")
    return 0
