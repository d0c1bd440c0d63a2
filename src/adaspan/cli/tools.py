"""Commands about the machine, the data and the configurations: bench, download, presets,
convert-official."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..data.download import download_benchmark
from ..measure.bench import MEMORY_FIELDS, bench
from ..measure.tables import bench_table
from ..model.lm import parameter_count
from ..presets import PRESETS
from ..resolve import resolve_config
from ..run.tokens import UNK_NOTE, per_byte
from ..training.official import DEFAULT_DROPOUT, DEFAULT_RAMP, DEFAULT_SPAN_LOSS, convert
from .options import (
    CLIError,
    add_output,
    add_runtime,
    add_sources,
    command,
    json_line,
    positive_int,
)

BENCH_BLOCK_SIZE = 256  # without a preset or config file


def add_bench(commands) -> None:
    p = command(commands, "bench", _bench)
    add_sources(p, "model options (and tokenizer=, data= for figures per byte)",
                 "take the model of this preset", "TOML file with a [model] table")
    p.add_argument("--spans", help="'fixed', or spans cycled over the heads, e.g. 32,64,128,1024 "
                   "(default: the spans of a new model)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="parallel streams")
    p.add_argument("--block-size", type=positive_int,
                   help=f"characters per block (default: block_size of --preset or --config, "
                   f"else {BENCH_BLOCK_SIZE})")
    p.add_argument("--steps", type=positive_int, default=5,
                   help="timed steps (after one warm-up)")
    p.add_argument("--gen-chars", type=positive_int, default=64,
                   help="characters generated for timing")
    add_runtime(p, "each part as its command runs it: training bf16 where the device has fast "
                 "bf16, evaluation fp32, generation as `adaspan generate`")
    p.add_argument("--statistic", choices=("median", "mean"), default="median",
                   help="of the timed steps (mean: the protocol of the authors' bench script)")
    p.add_argument("--compile", action="store_true",
                   help="compile the dense parts with torch.compile (compile_s: its time)")
    add_output(p, "print one JSON object")


def _bench(args: argparse.Namespace) -> int:
    """Measure train/eval/generation speed, FLOPs and memory of a configuration.

    One warm-up step, then --steps timed steps with the cache carried; the median (or mean)
    of their times. Rates are in tokens (chars: whatever a token is); for a tokenizer that
    learns its tokens (tokenizer=words|bpe) also per byte of text, at the average bytes per
    token of the corpus's valid split."""
    model_config, train_config = resolve_config(args.preset, args.config, args.overrides)
    block_size = args.block_size or (train_config.block_size if args.preset or args.config
                                     else BENCH_BLOCK_SIZE)
    result = bench(model_config, args.batch_size, block_size, args.spans, args.steps,
                   args.gen_chars, args.device, args.dtype, args.statistic,
                   args.compile, train_config.optimizer)
    result.update(per_byte(train_config, model_config, result, progress=not args.json))
    print(json_line(result) if args.json else bench_table(result, {**MEMORY_FIELDS, **UNK_NOTE}))
    return 0

def add_download(commands) -> None:
    p = command(commands, "download", _download)
    p.add_argument("name", choices=("enwik8", "text8"))
    p.add_argument("--data-dir", help="where enwik8/text8 are cached (default: $ADASPAN_DATA "
                   "or ~/.cache/adaspan)")


def _download(args: argparse.Namespace) -> int:
    """Download and verify enwik8 or text8."""
    print(download_benchmark(args.name, args.data_dir))
    return 0

def add_presets(commands) -> None:
    p = command(commands, "presets", _presets)
    p.add_argument("name", nargs="?", help="show this preset's options")


def _presets(args: argparse.Namespace) -> int:
    """List the named configurations."""
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

def add_convert_official(commands) -> None:

    p = command(commands, "convert-official", _convert_official)
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
    model = convert(args.checkpoint, args.out_dir, args.data, args.ramp, args.dropout,
                    args.span_loss_coef)
    print(f"wrote {args.out_dir}: {model}")
    return 0
