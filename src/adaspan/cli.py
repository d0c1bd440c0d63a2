"""The ``adaspan`` command line: train, evaluate, generate, inspect, report, bench, download,
presets, demo, compare, convert-official, retrofit.

A failure the user can act on (a :class:`~adaspan.errors.UserError`, an OSError, a
MemoryError) ends with one line and exit status 2; any other exception is a bug in adaspan,
reported on two lines with exit status 1. ``--debug`` (anywhere on the line) shows the
traceback of either. A usage error (an unknown option, a bad value of a typed option) is
argparse's: the command's usage, then ``adaspan COMMAND: error: ...``, exit status 2."""

from __future__ import annotations

import argparse
import codecs
import inspect
import json
import os
import re
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from ._version import __version__
from .attention.registry import ATTENTIONS
from .config import DTYPES
from .errors import UserError, disk_full, out_of_memory

EXPECTED_ERRORS = (UserError, OSError, MemoryError)  # the user's to fix: one line, status 2


class CLIError(UserError):
    """A command-line option that is invalid (beyond what argparse checks)."""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    overrides = [e for e in extra if "=" in e and not e.startswith("-")]
    if len(overrides) != len(extra) or (overrides and not hasattr(args, "overrides")):
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if overrides:  # KEY=VALUE given after options
        args.overrides = list(args.overrides) + overrides
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        _set_up(args)
        return args.run(args) or 0
    except KeyboardInterrupt as stop:  # a signal: training saved first (train.Interrupted)
        if _is_main_process():
            print(f"\nadaspan: {stop or 'interrupted'}", file=sys.stderr)
        return 128 + getattr(stop, "signum", 2)
    except Exception as err:
        if args.debug:
            raise
        print(f"adaspan: error: {_one_line(err)}", file=sys.stderr)
        if _expected(err):
            return 2
        print("adaspan: this is a bug in adaspan; run with --debug for the traceback",
              file=sys.stderr)
        return 1


def _expected(err: Exception) -> bool:
    """Whether ``err`` is the user's to act on: a UserError, the file system, or a resource
    exhausted (memory, disk) wherever it happened."""
    return isinstance(err, EXPECTED_ERRORS) or disk_full(err) or out_of_memory(err)


def _set_up(args: argparse.Namespace) -> None:
    """Torch's CPU threads (``--threads``) and the device (``--device``, resolved in place) of
    the commands that have those options; those of train (and compare's threads) are train
    options (``train.threads``), set by the training run."""
    from .runtime.distributed import resolve_device, use_threads

    if "threads" in args:
        use_threads(args.threads)
    if "device" in args:
        args.device = resolve_device(args.device)


def _is_main_process() -> bool:
    """False in the processes of a torchrun job other than rank 0 (one message, not one each)."""
    from .runtime.distributed import Distributed

    return Distributed.from_env().is_main


def _one_line(err: Exception) -> str:
    """The error's message on one line: for an OSError its reason and file; for a bug (an
    exception of no expected type) its type, then its message."""
    if isinstance(err, OSError) and err.strerror:
        where = f": {err.filename}" if err.filename else ""
        return f"{err.strerror}{where}"
    message = " ".join(str(err).split())
    if out_of_memory(err) and not isinstance(err, UserError):
        tried = re.search(r"allocate (\d+) bytes", message)
        what = f"{int(tried[1]) / 1e9:.1f} GB could not be allocated" if tried else message
        return (f"out of memory: {what or type(err).__name__} (a smaller model, batch_size or "
                "block_size needs less; batch_split=N splits a step)")
    if _expected(err):
        return message or type(err).__name__
    return ": ".join(filter(None, (type(err).__name__, message)))


class _HelpFormatter(argparse.HelpFormatter):
    """Help that ends with the option's default, where it has one that its help does not
    already give (not for on/off flags, nor options whose default is to leave them out)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        no_default = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        gives_default = "(default" in text or "[default" in text
        if action.option_strings and not no_default and not gives_default:
            text += " (default: %(default)s)"
        return text


DEBUG_HELP = "show the traceback of an error, not only its message"
TOML_HELP = "TOML file with [model] and [train] tables"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaspan", formatter_class=_HelpFormatter,
        description="Character-level language models whose attention heads learn their span.",
    )
    parser.add_argument("--version", action="version", version=f"adaspan {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    commands = parser.add_subparsers(metavar="COMMAND")
    for add in (_add_train, _add_evaluate, _add_generate, _add_inspect, _add_report, _add_bench,
                _add_download, _add_presets, _add_demo, _add_compare, _add_convert_official,
                _add_retrofit):
        add(commands)
    return parser


def _command(commands, name: str, run, run_dir: bool = False) -> argparse.ArgumentParser:
    """The sub-command ``name`` carried out by the function ``run``, whose docstring gives the
    command's help (first paragraph) and description; ``run_dir``: its first argument is a run
    directory."""
    doc = inspect.getdoc(run)
    parser = commands.add_parser(name, help=doc.split("\n\n")[0], description=doc,
                                 formatter_class=_HelpFormatter)
    parser.set_defaults(run=run, parser=parser)  # the parser: its usage for a usage error
    # also after the command; SUPPRESS: not given here keeps the value of `adaspan --debug`
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=DEBUG_HELP)
    if run_dir:
        parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    return parser


def _add_sources(p: argparse.ArgumentParser, overrides: str, preset: str, config: str,
                 default_preset: str | None = None) -> None:
    """Where a command's configuration comes from (:func:`adaspan.resolve.resolve_config`):
    KEY=VALUE ``overrides``, ``--preset`` and ``--config``, each with this command's help."""
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides)
    p.add_argument("--preset", default=default_preset, help=preset)
    p.add_argument("--config", type=Path, help=config)


def _add_runtime(p: argparse.ArgumentParser, auto: str) -> None:
    """``--device``, ``--dtype`` and ``--threads`` of a command that runs a model (the device
    and threads are set before it runs: :func:`_set_up`); ``auto``: what ``--dtype auto``
    means for this command."""
    p.add_argument("--device", default="auto", help=_train_option_help("device"))
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help=f"products in bf16 (autocast) or fp32; auto: {auto}")
    _add_threads(p)


def _add_threads(p: argparse.ArgumentParser, dest: str = "threads") -> None:
    """``--threads``; ``dest="train.threads"`` where the command's training runs set them."""
    p.add_argument("--threads", type=_count, metavar="N", dest=dest,
                   help=_train_option_help("threads"))


def _train_option_help(name: str) -> str:
    """The help of the train option ``name``, for a command's flag of the same meaning."""
    from .config import TrainConfig

    return next(item for item in fields(TrainConfig) if item.name == name).metadata["help"]


def _add_output(p: argparse.ArgumentParser, json_help: str | None = None,
                progress: bool = False) -> None:
    """``--json`` (``json_help``: what it prints) and, with ``progress``, ``--no-progress``."""
    if json_help:
        p.add_argument("--json", action="store_true", help=json_help)
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


# ---------------------------------------------------------------------------------------- train


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """One option per field of the configurations, with the field's help."""
    from .config import SECTIONS

    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} options (override preset and file)")
        for field in fields(cls):
            group.add_argument(f"--{field.name.replace('_', '-')}", dest=f"{section}.{field.name}",
                               metavar="X", default=None, help=cls.help(field))


def _add_train(commands) -> None:
    p = _command(commands, "train", _train)
    _add_sources(p, "override any option, e.g. lr=0.01 or model.max_span=1024",
                 "named configuration (see `adaspan presets`)", TOML_HELP)
    p.add_argument("--run-dir", type=Path, help="where to write the run (default: runs/NAME-TIME)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR exactly where it stopped")
    _add_output(p, progress=True)
    _add_config_options(p)


def _config_overrides(args: argparse.Namespace) -> list[str]:
    """The options given as flags (``--steps 5``: ``steps=5``), then the KEY=VALUE ones."""
    from .config import SECTIONS

    flags = []
    for key, value in vars(args).items():
        section, dot, name = key.partition(".")
        if dot and value is not None:
            flags.append(f"{SECTIONS[section].option_name(name)}={value}")
    return flags + list(args.overrides)


def _train(args: argparse.Namespace) -> int:
    """Train a model.

    Options apply in order: defaults (the paper's small model) < --preset < --config FILE <
    the options below < KEY=VALUE overrides."""
    from .resolve import resolve_config
    from .run.checkpoint import RunComplete, RunDir, new_run_dir
    from .training.train import train

    overrides = _config_overrides(args)
    if args.resume:
        if args.preset or args.config:
            raise CLIError("--resume continues a run with its saved configuration: "
                           "drop --preset/--config (KEY=VALUE overrides such as steps=... work)")
        model_config, train_config = resolve_config(
            base=RunDir(args.resume).load_config(), overrides=overrides)
        run_dir = args.resume
    else:
        model_config, train_config = resolve_config(args.preset, args.config, overrides)
        run_dir = args.run_dir or new_run_dir(args.preset or "run")
    result = train(model_config, train_config, run_dir, resume=bool(args.resume),
                   progress=not args.no_progress)
    complete = isinstance(result, RunComplete)  # a finished run, left as it is: nothing to do
    line = str(result) if complete else _json_line(result)
    if _is_main_process():  # under torchrun: one line, not one per process
        print(line)
    return 0


# ------------------------------------------------------------------------------------- evaluate


def _add_evaluate(commands) -> None:
    p = _command(commands, "evaluate", _evaluate, run_dir=True)
    p.add_argument("--data", help="corpus (default: the one the run was trained on); for a run "
                   "made by convert-official, a directory in the authors' format")
    p.add_argument("--data-dir", help="cache directory for enwik8/text8")
    p.add_argument("--split", choices=("train", "valid", "test"), default="valid",
                   help="the part of the corpus to score")
    p.add_argument("--batch-size", type=_positive_int, default=8,
                   help="parallel streams (paper: 8); each starts without context, so the "
                   "first characters of each have less of it: 1 scores the split as one "
                   "stream")
    p.add_argument("--block-size", type=_positive_int,
                   help="characters per block (default: the run's)")
    p.add_argument("--max-chars", type=_positive_int,
                   help="score only the first N characters of the split (a contiguous prefix)")
    _add_runtime(p, "fp32 with TF32 off on any device, so the bpc does not depend on the hardware")
    p.add_argument("--token-logprobs", type=Path, metavar="FILE.npy",
                   help="save the natural-log probability of every scored token (float32, "
                   "stream after stream: text order with --batch-size 1)")
    _add_output(p, "end with one JSON line of results", progress=True)


def _evaluate(args: argparse.Namespace) -> int:
    """Bits per character of a trained model on a split.

    The split is cut into as many streams as the batch size, read block by block, the cache
    carried from one block to the next. The output says what was scored: characters, streams,
    block size, the cache carried, and how many characters were scored with less context than
    the longest span (the first ones of each stream; a batch size of 1 scores the split as one
    stream)."""
    from .data.corpora import source_distance
    from .data.synthetic import is_synthetic
    from .measure.tables import evaluation_text
    from .run.checkpoint import RunDir, load_model
    from .run.tokens import run_split
    from .training.evaluate import bpc_by_distance, evaluate, short_context

    tokens, name, unit, ends, unk = run_split(args.run_dir, args.split, args.data,
                                              args.data_dir, progress=not args.no_progress)
    block_size = args.block_size or RunDir(args.run_dir).load_config()[1].block_size
    model = load_model(args.run_dir, args.device)
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
    print(_json_line(result) if args.json else evaluation_text(result, unit))
    return 0


# ------------------------------------------------------------------------------------- generate


def _add_generate(commands) -> None:
    p = _command(commands, "generate", _generate, run_dir=True)
    p.add_argument("--prompt", default="", help="text to continue (default: none, the "
                   "start of a line)")
    p.add_argument("--length", type=int, default=500, help="tokens to generate (bytes for a "
                   "byte-level run)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="divides the log-probabilities before sampling; 0 = greedy")
    p.add_argument("--top-k", type=_positive_int,
                   help="sample among the k most likely tokens only (default: among all)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling: a seed gives the same text at every call (the "
                   "default one too); pass another seed for another sample")
    _add_runtime(p, "fp32 (TF32 on CUDA): one token at a time, bf16 is not faster on the "
                 "CPUs measured")
    _add_output(p, "no streaming: print one JSON object with the text and its speed")


def _generate(args: argparse.Namespace) -> int:
    """Sample text from a trained model.

    Print the prompt, then each character as it is sampled."""
    from .run.checkpoint import load_model
    from .run.tokens import run_codec
    from .runtime.precision import choose

    codec = run_codec(args.run_dir)
    model = load_model(args.run_dir, args.device)
    precision = choose(args.dtype, args.device, "generate")
    with precision.applied():  # the tokens are computed as they are read
        _sample(args, model, codec, precision)
    return 0


def _sample(args: argparse.Namespace, model, codec, precision) -> None:
    """Stream (or, with --json, time) the sampled text of ``_generate``."""
    from .measure.generate import stream

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


# -------------------------------------------------------------------------------------- inspect


def _add_inspect(commands) -> None:
    p = _command(commands, "inspect", _inspect, run_dir=True)
    p.add_argument("--plot", type=Path, metavar="DIR",
                   help="write spans.png and curves.png into DIR (e.g. the run directory)")
    _add_output(p, "print spans and summary as JSON")


def _inspect(args: argparse.Namespace) -> int:
    """Learned spans, training curves and plots of a run.

    Print the span of every head, each head's span at the first and the last record of
    metrics.jsonl and its largest over the records, and the last record."""
    from .measure.plots import plot_curves, plot_spans
    from .measure.report import run_events
    from .measure.tables import record_line, span_table, trajectory_table
    from .model.analysis import head_span_history, span_summary, span_trajectories
    from .run.checkpoint import load_model

    model = load_model(args.run_dir)
    spans = model.spans()
    events = run_events(args.run_dir)
    trajectories = span_trajectories(head_span_history(events))
    if args.json:
        print(_json_line({"spans": spans, **span_summary(spans),
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


# --------------------------------------------------------------------------------------- report


def _add_report(commands) -> None:
    p = _command(commands, "report", _report, run_dir=True)
    p.add_argument("--out", type=Path, metavar="DIR", help="output directory [RUN_DIR/report]")
    p.add_argument("--text", help="text of the Figure 5 panel (dynamic spans) [a piece of the "
                   "run's valid split]")
    p.add_argument("--limits", type=_positive_ints, default="256,512,1024,2048,4096,8192",
                   help="span limits S of the Figure 3 panel [default: %(default)s]")
    p.add_argument("--no-memory", action="store_true",
                   help="skip the memory probe (one training step per limit and curve)")
    p.add_argument("--device", default="cpu", help="where the model and memory probe run")


def _report(args: argparse.Namespace) -> int:
    """One HTML page with a run's curves, spans and the paper's figures.

    Write OUT/report.html, a self-contained page (figures embedded): the configuration, bpc
    curves, spans during training, the final spans (paper Figure 4), FLOPs and memory against
    the span limit (Figure 3) and, for dynamic spans, the span along a text (Figure 5); and
    OUT/report.json, the numbers behind the figures."""
    from .measure.report import write_report

    page = write_report(args.run_dir, args.out, args.text, args.limits, not args.no_memory,
                        args.device)
    print(f"wrote {page}")
    return 0


# ---------------------------------------------------------------------------------------- bench

BENCH_BLOCK_SIZE = 256  # without a preset or config file


def _add_bench(commands) -> None:
    p = _command(commands, "bench", _bench)
    _add_sources(p, "model options (and tokenizer=, data= for figures per byte)",
                 "take the model of this preset", "TOML file with a [model] table")
    p.add_argument("--spans", help="'fixed', or spans cycled over the heads, e.g. 32,64,128,1024 "
                   "(default: the spans of a new model)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="parallel streams")
    p.add_argument("--block-size", type=_positive_int,
                   help=f"characters per block (default: block_size of --preset or --config, "
                   f"else {BENCH_BLOCK_SIZE})")
    p.add_argument("--steps", type=_positive_int, default=5,
                   help="timed steps (after one warm-up)")
    p.add_argument("--gen-chars", type=_positive_int, default=64,
                   help="characters generated for timing")
    _add_runtime(p, "each part as its command runs it: training bf16 where the device has fast "
                 "bf16, evaluation fp32, generation as `adaspan generate`")
    p.add_argument("--statistic", choices=("median", "mean"), default="median",
                   help="of the timed steps (mean: the protocol of the authors' bench script)")
    p.add_argument("--compile", action="store_true",
                   help="compile the dense parts with torch.compile (compile_s: its time)")
    _add_output(p, "print one JSON object")


def _bench(args: argparse.Namespace) -> int:
    """Measure train/eval/generation speed, FLOPs and memory of a configuration.

    One warm-up step, then --steps timed steps with the cache carried; the median (or mean)
    of their times. Rates are in tokens (chars: whatever a token is); for a tokenizer that
    learns its tokens (tokenizer=words|bpe) also per byte of text, at the average bytes per
    token of the corpus's valid split."""
    from .measure.bench import MEMORY_FIELDS, bench
    from .measure.tables import bench_table
    from .resolve import resolve_config
    from .run.tokens import UNK_NOTE, per_byte

    model_config, train_config = resolve_config(args.preset, args.config, args.overrides)
    block_size = args.block_size or (train_config.block_size if args.preset or args.config
                                     else BENCH_BLOCK_SIZE)
    result = bench(model_config, args.batch_size, block_size, args.spans, args.steps,
                   args.gen_chars, args.device, args.dtype, args.statistic,
                   args.compile, train_config.optimizer)
    result.update(per_byte(train_config, model_config, result, progress=not args.json))
    print(_json_line(result) if args.json else bench_table(result, {**MEMORY_FIELDS, **UNK_NOTE}))
    return 0


# ------------------------------------------------------------------------------------- download


def _add_download(commands) -> None:
    p = _command(commands, "download", _download)
    p.add_argument("name", choices=("enwik8", "text8"))
    p.add_argument("--data-dir", help="where enwik8/text8 are cached (default: $ADASPAN_DATA "
                   "or ~/.cache/adaspan)")


def _download(args: argparse.Namespace) -> int:
    """Download and verify enwik8 or text8."""
    from .data.download import download_benchmark

    print(download_benchmark(args.name, args.data_dir))
    return 0


# -------------------------------------------------------------------------------------- presets


def _add_presets(commands) -> None:
    p = _command(commands, "presets", _presets)
    p.add_argument("name", nargs="?", help="show this preset's options")


def _presets(args: argparse.Namespace) -> int:
    """List the named configurations."""
    from .model.lm import parameter_count
    from .presets import PRESETS
    from .resolve import resolve_config

    if args.name:
        if args.name not in PRESETS:
            raise CLIError(f"unknown preset {args.name!r}; available: {', '.join(PRESETS)}")
        print(json.dumps(PRESETS[args.name], indent=2))
        return 0
    width = max(map(len, PRESETS))
    for name, preset in PRESETS.items():
        params = parameter_count(resolve_config(name)[0]) / 1e6
        print(f"{name:<{width}}  {params:6.1f}M params  {preset['description']}")
    return 0


# ----------------------------------------------------------------------------------------- demo


def _add_demo(commands) -> None:
    p = _command(commands, "demo", _demo)
    p.add_argument("--minutes", type=_positive_float, default=6.0,
                   help="cap on training time (the demo preset runs 2,400 steps, ~4 min)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where to write the run (default: runs/demo-TIME)")
    _add_output(p, progress=True)


def _demo(args: argparse.Namespace) -> int:
    """Train a small model on the bundled corpus for a few minutes, then report."""
    from .experiments.demo import run_demo

    run_demo(args.minutes, args.run_dir, progress=not args.no_progress)
    return 0


# -------------------------------------------------------------------------------------- compare


def _add_compare(commands) -> None:
    p = _command(commands, "compare", _compare)
    p.add_argument("--methods", default=",".join(ATTENTIONS),
                   help="comma-separated attention methods [default: %(default)s]")
    _add_sources(p, "override any option for every method, e.g. d_model=128",
                 "named configuration [default: %(default)s]", TOML_HELP,
                 default_preset="cpu-small")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=_positive_float,
                        help="training time of each method")
    budget.add_argument("--steps", type=_positive_int, help="training steps of each method")
    p.add_argument("--max-spans", type=_positive_ints, metavar="S,S,..",
                   help="train every method with each span limit S and draw bpc, FLOPs, "
                   "memory and speed against S (the paper's Figure 2)")
    p.add_argument("--out", type=Path, help="output directory (default: runs/compare-TIME)")
    p.add_argument("--test", action="store_true", help="also report test bpc")
    p.add_argument("--eval-chars", type=_positive_int, metavar="N",
                   help="evaluate on the first N characters of each split (default: all)")
    _add_threads(p, dest="train.threads")  # a train option: each method's run sets them
    _add_output(p, "end with the rows as one JSON line", progress=True)


def _compare(args: argparse.Namespace) -> int:
    """Train several attention methods on one budget and tabulate them.

    Train each method on the same data, with the same seed and budget, then evaluate it and
    write a table in the form of the paper's Table 1 to OUT/compare.md and OUT/compare.csv, and
    the methods' curves side by side (bpc against training time and steps, average span) to
    OUT/compare_curves.png and OUT/compare.html. With --max-spans, each method is trained with
    every span limit, and bpc, FLOPs per character, memory and speed are drawn against it
    (OUT/compare_max_spans.png). Re-running with the same --out reuses the finished runs."""
    from .experiments.compare import MARKDOWN_FILE, compare
    from .resolve import resolve_config
    from .run.checkpoint import new_run_dir

    budget = []
    if args.minutes is not None:  # the time budget decides; steps only cap it
        budget = [f"time_budget={args.minutes * 60}", "steps=1e9"]
    elif args.steps is not None:
        budget = [f"steps={args.steps}"]
    model_config, train_config = resolve_config(args.preset, args.config,
                                                budget + _config_overrides(args))
    out = args.out or new_run_dir("compare")
    methods = [method.strip() for method in args.methods.split(",") if method.strip()]
    rows = compare(methods, model_config, train_config, out, args.test, args.eval_chars,
                   progress=not args.no_progress, max_spans=args.max_spans)
    if args.json:
        print(_json_line(rows))
    else:
        print((out / MARKDOWN_FILE).read_text(), end="")
    return 0


# ----------------------------------------------------------------------------- convert-official


def _add_convert_official(commands) -> None:
    from .training.official import DEFAULT_DROPOUT, DEFAULT_RAMP, DEFAULT_SPAN_LOSS

    p = _command(commands, "convert-official", _convert_official)
    p.add_argument("checkpoint", type=Path, metavar="CHECKPOINT.pt")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="new (or empty) run directory")
    p.add_argument("--data", type=Path, required=True, metavar="DATA_DIR",
                   help="the authors' data directory (train.txt, valid.txt, test.txt) the model "
                   "was trained on: it defines the vocabulary")
    p.add_argument("--ramp", type=int, default=DEFAULT_RAMP,
                   help="ramp R of the soft mask, not stored in the checkpoint "
                   "(their --adapt-span-ramp) [default: %(default)s]")
    p.add_argument("--dropout", type=float, default=DEFAULT_DROPOUT,
                   help="dropout for further training (their --dropout) [default: %(default)s]")
    p.add_argument("--span-loss-coef", type=float, default=DEFAULT_SPAN_LOSS,
                   help="span penalty for further training (their --adapt-span-loss) "
                   "[default: %(default)s]")


def _convert_official(args: argparse.Namespace) -> int:
    """Import a checkpoint of the authors' code as an adaspan run.

    Convert a checkpoint written by the training script of the paper's authors
    (facebookresearch/adaptive-span, with or without persistent memory, with or without
    adaptive input/output) into an adaspan run directory with the same log-probabilities
    (see docs/official.md)."""
    from .training.official import convert

    model = convert(args.checkpoint, args.out_dir, args.data, args.ramp, args.dropout,
                    args.span_loss_coef)
    print(f"wrote {args.out_dir}: {model}")
    return 0


# ------------------------------------------------------------------------------------- retrofit


def _add_retrofit(commands) -> None:
    from .config import LOSSES, RetrofitConfig

    p = _command(commands, "retrofit", _retrofit)
    p.add_argument("model_dir", type=Path, metavar="MODEL_DIR",
                   help="a Hugging Face causal LM and its tokenizer (save_pretrained)")
    p.add_argument("--data", required=True, metavar="TEXT", help="text file (plain, .gz or "
                   ".zip) or corpus name: spans learn on its train split, the report scores "
                   "its valid split (adaspan's 90/5/5 split)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="new directory: the model with its spans, the report, the checkpoint")
    default = RetrofitConfig("", "", "")
    p.add_argument("--max-span", type=_positive_int, help="S (default: --context)")
    p.add_argument("--ramp", type=_positive_int, default=default.ramp, help="ramp R")
    p.add_argument("--context", type=_positive_int, default=default.context,
                   help="tokens per window (training, scoring and decoding)")
    p.add_argument("--steps", type=_positive_int, default=default.steps,
                   help="optimiser steps of the spans")
    p.add_argument("--batch-size", type=_positive_int, default=default.batch_size,
                   help="windows per step")
    p.add_argument("--lr", type=_positive_float, default=default.lr, help="Adam's step on z'")
    p.add_argument("--span-loss", type=float, default=default.span_loss,
                   help="lambda of the span penalty lambda/M * sum z")
    p.add_argument("--loss", choices=LOSSES, default=default.loss, help="distill: KL to the "
                   "frozen model with full attention; lm: the text's NLL; both: their sum")
    p.add_argument("--seed", type=int, default=default.seed,
                   help="the windows of each step are drawn from (seed, step)")
    p.add_argument("--checkpoint-interval", type=_positive_int,
                   default=default.checkpoint_interval, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue the retrofit in --out")
    p.add_argument("--eval-bytes", type=_positive_int, default=65536,
                   help="held-out bytes the report scores")
    p.add_argument("--decode-tokens", type=_positive_int, default=64,
                   help="tokens decoded at the full context for the speed")
    _add_runtime(p, "bf16 for training where the device has fast bf16, fp32 for the report")
    _add_output(p, "print the report as JSON", progress=True)


def _retrofit(args: argparse.Namespace) -> int:
    """Learn a span per head for a frozen Hugging Face causal LM.

    Freeze every weight of MODEL_DIR, attach an adaptive span to each attention layer (at
    its full span S) and train only the spans: distillation towards the model's own
    full-attention outputs (and/or the text's loss) plus the span penalty. Writes to --out the
    model with its spans (adaspan.hf.load_pretrained reads it) and a report, retrofit.json and
    retrofit.md: spans per head, held-out bits per byte, key/value cache bytes and decode
    speed, with full attention and with the spans (see docs/retrofit.md)."""
    from .config import RetrofitConfig
    from .data.corpora import resolve_data
    from .hf.report import markdown, measure_retrofit, write
    from .hf.retrofit import retrofit
    from .runtime.precision import choose

    config = RetrofitConfig(
        str(args.model_dir.resolve()), resolve_data(args.data), str(args.out.resolve()),
        args.max_span, args.ramp, args.context, args.steps, args.batch_size, args.lr,
        args.span_loss, args.loss, args.seed, args.checkpoint_interval)
    run = retrofit(config, choose(args.dtype, args.device, "train"), args.resume,
                   progress=not args.no_progress)
    report = measure_retrofit(run, choose(args.dtype, args.device, "score"), args.eval_bytes,
                              args.decode_tokens)
    write(args.out, report)
    print(_json_line(report) if args.json else markdown(report), end="\n" if args.json else "")
    return 0


# -------------------------------------------------------------------------------------- helpers


def _positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    return _integer(text, 1, "a positive integer")


def _count(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _integer(text, 0, "an integer >= 0")


def _integer(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def _positive_ints(text: str) -> list[int]:
    """argparse type: whole numbers > 0 separated by commas (``256,1024``)."""
    try:
        values = [_positive_int(part) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of whole numbers > 0 "
                                         "separated by commas, e.g. 256,1024")
    return values


def _positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _json_line(values: object) -> str:
    """``values`` as one line of JSON, floats rounded to 6 digits."""
    return json.dumps(_rounded(values))


def _rounded(values: object) -> object:
    """Floats rounded to 6 digits, in dicts and lists too, for JSON output."""
    if isinstance(values, dict):
        return {key: _rounded(value) for key, value in values.items()}
    if isinstance(values, list | tuple):
        return [_rounded(value) for value in values]
    return round(values, 6) if isinstance(values, float) else values


if __name__ == "__main__":
    sys.exit(main())
