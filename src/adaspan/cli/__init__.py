"""The ``adaspan`` command line: train, evaluate, generate, inspect, report, bench, download,
presets, demo, compare, convert-official, retrofit, longeval.

A failure the user can act on (a :class:`~adaspan.errors.UserError`, an OSError, a
MemoryError) ends with one line and exit status 2; any other exception is a bug in adaspan,
reported on two lines with exit status 1. ``--debug`` (anywhere on the line) shows the
traceback of either. A usage error (an unknown option, a bad value of a typed option) is
argparse's: the command's usage, then ``adaspan COMMAND: error: ...``, exit status 2."""

from __future__ import annotations

import argparse
import re
import sys

from .._version import __version__
from ..errors import UserError, disk_full, out_of_memory
from ..runtime.distributed import resolve_device, use_threads
from . import longeval, retrofit, runs, tools, train
from .options import DEBUG_HELP, HelpFormatter, is_main_process

EXPECTED_ERRORS = (UserError, OSError, MemoryError)  # the user's to fix: one line, status 2


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
        if is_main_process():
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
    if "threads" in args:
        use_threads(args.threads)
    if "device" in args:
        args.device = resolve_device(args.device)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaspan", formatter_class=HelpFormatter,
        description="Character-level language models whose attention heads learn their span.",
    )
    parser.add_argument("--version", action="version", version=f"adaspan {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    commands = parser.add_subparsers(metavar="COMMAND")
    for add in (train.add_train, runs.add_evaluate, runs.add_generate, runs.add_inspect,
                runs.add_report, tools.add_bench, tools.add_download, tools.add_presets,
                train.add_demo, train.add_compare, tools.add_convert_official,
                retrofit.add_retrofit, longeval.add_longeval):
        add(commands)
    return parser
