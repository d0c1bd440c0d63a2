"""What the commands share: the help format, a sub-command from its handler, the options of
configuration sources, runtime and output, argparse types, JSON output."""

from __future__ import annotations

import argparse
import inspect
import json
import math
from dataclasses import fields
from pathlib import Path

from ..config import DTYPES, TrainConfig
from ..errors import UserError
from ..runtime.distributed import Distributed

DEBUG_HELP = "show the traceback of an error, not only its message"
TOML_HELP = "TOML file with [model] and [train] tables"


class CLIError(UserError):
    """A command-line option that is invalid (beyond what argparse checks)."""

class HelpFormatter(argparse.HelpFormatter):
    """Help that ends with the option's default, where it has one that its help does not
    already give (not for on/off flags, nor options whose default is to leave them out)."""
    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        no_default = any(action.default is v for v in (None, False, argparse.SUPPRESS))
        gives_default = "(default" in text or "[default" in text
        if action.option_strings and not no_default and not gives_default:
            text += " (default: %(default)s)"
        return text


def command(commands, name: str, run, run_dir: bool = False) -> argparse.ArgumentParser:
    """The sub-command ``name`` carried out by the function ``run``, whose docstring gives the
    command's help (first paragraph) and description; ``run_dir``: its first argument is a run
    directory."""
    doc = inspect.getdoc(run)
    parser = commands.add_parser(name, help=doc.split("\n\n")[0], description=doc,
                                 formatter_class=HelpFormatter)
    parser.set_defaults(run=run, parser=parser)  # the parser: its usage for a usage error
    # also after the command; SUPPRESS: not given here keeps the value of `adaspan --debug`
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help=DEBUG_HELP)
    if run_dir:
        parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    return parser


def add_sources(p: argparse.ArgumentParser, overrides: str, preset: str, config: str,
                 default_preset: str | None = None) -> None:
    """Where a command's configuration comes from (:func:`adaspan.resolve.resolve_config`):
    KEY=VALUE ``overrides``, ``--preset`` and ``--config``, each with this command's help."""
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=overrides)
    p.add_argument("--preset", default=default_preset, help=preset)
    p.add_argument("--config", type=Path, help=config)


def add_runtime(p: argparse.ArgumentParser, auto: str) -> None:
    """``--device``, ``--dtype`` and ``--threads`` of a command that runs a model (the device
    and threads are set before it runs: :func:`_set_up`); ``auto``: what ``--dtype auto``
    means for this command."""
    p.add_argument("--device", default="auto", help=train_option_help("device"))
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help=f"products in bf16 (autocast) or fp32; auto: {auto}")
    add_threads(p)


def add_threads(p: argparse.ArgumentParser, dest: str = "threads") -> None:
    """``--threads``; ``dest="train.threads"`` where the command's training runs set them."""
    p.add_argument("--threads", type=count, metavar="N", dest=dest,
                   help=train_option_help("threads"))


def train_option_help(name: str) -> str:
    """The help of the train option ``name``, for a command's flag of the same meaning."""
    return next(item for item in fields(TrainConfig) if item.name == name).metadata["help"]


def add_output(p: argparse.ArgumentParser, json_help: str | None = None,
                progress: bool = False) -> None:
    """``--json`` (``json_help``: what it prints) and, with ``progress``, ``--no-progress``."""
    if json_help:
        p.add_argument("--json", action="store_true", help=json_help)
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    return integer(text, 1, "a positive integer")


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    return integer(text, 0, "an integer >= 0")


def integer(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: whole numbers > 0 separated by commas (``256,1024``)."""
    try:
        values = [positive_int(part) for part in text.split(",") if part.strip()]
    except argparse.ArgumentTypeError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of whole numbers > 0 "
                                         "separated by commas, e.g. 256,1024")
    return values


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def json_line(values: object) -> str:
    """``values`` as one line of JSON, floats rounded as :func:`rounded` does."""
    return json.dumps(rounded(values))


def rounded(values: object) -> object:
    """Floats to 6 decimal places, or to 6 significant digits where those are finer (a span
    loss of 1.5e-8 stays 1.5e-8), in dicts and lists too, for JSON output."""
    if isinstance(values, dict):
        return {key: rounded(value) for key, value in values.items()}
    if isinstance(values, list | tuple):
        return [rounded(value) for value in values]
    if not isinstance(values, float) or values == 0 or not math.isfinite(values):
        return values
    return round(values, max(6, 5 - math.floor(math.log10(abs(values)))))


def is_main_process() -> bool:
    """False in the processes of a torchrun job other than rank 0 (one message, not one each)."""
    return Distributed.from_env().is_main
