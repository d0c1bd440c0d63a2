"""``adaspan longeval``: a causal LM scored on synthetic long-context retrieval prompts
(:mod:`.needles`), over a grid of tasks x lengths x depths x samples, with a cache policy.

Each prompt is answered by greedy decoding (``generate``, ``do_sample=False``) of at most the
sample's ``max_new_tokens``, and is right when every expected value is a word of the
continuation (:func:`.needles.found`). A cache policy (:mod:`.cache_policies`) builds the
cache of each ``generate`` call and may change the model for the call; the bytes of keys and
values its cache holds right after the prompt (the prefill) are recorded
(:func:`.span_cache.kv_bytes`).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from tqdm.auto import tqdm
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import Cache

from .._version import __version__
from ..data.corpora import SPLITS, load_corpus
from ..data.files import atomic_write
from ..errors import UserError
from ..measure.plots import heatmap_figure, png_bytes
from ..measure.report import LONGEVAL_FILE
from ..measure.tables import longeval_cells, longeval_length_cells, markdown_table
from ..runtime.precision import Precision
from . import duo, snapkv, streaming  # noqa: F401 (register the policies duo, snapkv, streaming)
from .cache_policies import CachePolicy, build_policy
from .needles import TASKS, Haystack, Sample, found, make
from .retrofit import _transformers_bars, load_frozen
from .span_cache import cache_argument, kv_bytes
from .spans import SETTINGS_FILE, load_spans

REPORT_FILE = LONGEVAL_FILE  # longeval.json, which adaspan report reads
TABLE_FILE = "longeval.md"


@dataclass(frozen=True)
class Grid:
    """The prompts of an evaluation: every task at every length and depth, ``samples`` times
    (sample i drawn from ``seed + i``)."""

    tasks: tuple[str, ...] = tuple(TASKS)
    lengths: tuple[int, ...] = (1024, 2048)
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    samples: int = 4
    seed: int = 0

    def check(self, model: nn.Module) -> None:
        """Refuse unknown tasks and lengths beyond the model's positions (one line)."""
        unknown = [task for task in self.tasks if task not in TASKS]
        if unknown:
            raise UserError(f"unknown task {unknown[0]!r}; the tasks are {', '.join(TASKS)}")
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions and max(self.lengths) > positions:
            raise UserError(f"a length of {max(self.lengths)} tokens is longer than the "
                            f"model's {positions} positions")

    def points(self) -> list[tuple[str, int, float, int]]:
        """(task, length, depth, sample) of every prompt."""
        return list(itertools.product(self.tasks, self.lengths, self.depths,
                                      range(self.samples)))


def has_spans(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds spans (``adaptive_spans.json``) for its model."""
    return (model_dir / SETTINGS_FILE).is_file()


def load_model_dir(model_dir: Path, device: torch.device) -> tuple[nn.Module, object]:
    """The causal LM of ``model_dir`` (fp32, evaluation mode) with its spans where the
    directory has them (:func:`has_spans`), on ``device``, and its tokenizer."""
    model, tokenizer = load_frozen(str(model_dir))
    if has_spans(model_dir):
        load_spans(model, model_dir)
    return model.to(device), tokenizer


def load_haystack(spec: str) -> str:
    """The whole text of a corpus name or a text file (as ``--data`` of adaspan reads it)."""
    corpus = load_corpus(spec, progress=False)
    return b"".join(bytes(corpus.split(split)) for split in SPLITS).decode("utf-8", "ignore")


class _PrefillBytes(LogitsProcessor):
    """Records the bytes ``cache`` holds when the first token is chosen: after the prompt."""

    def __init__(self, cache: Cache) -> None:
        self.cache, self.bytes = cache, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.bytes is None:
            self.bytes = kv_bytes(self.cache)
        return scores


@torch.no_grad()
def respond(model: nn.Module, sample: Sample, policy: CachePolicy, pad: int | None
            ) -> tuple[list[int], int]:
    """The greedy continuation of ``sample``'s prompt (at most ``max_new_tokens`` ids) and
    the bytes of keys and values held after its prompt."""
    device = next(model.parameters()).device
    ids = torch.tensor([sample.ids], device=device)
    with policy.applied(len(sample.ids)) as cache:
        prefill = _PrefillBytes(cache)
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=sample.max_new_tokens, do_sample=False,
                             pad_token_id=pad, logits_processor=LogitsProcessorList([prefill]),
                             **cache_argument(model, cache))
    return out[0, ids.shape[1]:].tolist(), prefill.bytes


def evaluate(model: nn.Module, tokenizer, haystack: Haystack, grid: Grid, policy: CachePolicy,
             precision: Precision, progress: bool = True) -> list[dict]:
    """One record per prompt of ``grid``: what was asked, answered, and held. Every task and
    depth is made once at the shortest length first: a length too short for a task, or a
    depth outside [0, 1], fails before any prompt runs."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
        tokenizer.eos_token_id)
    for task, depth in itertools.product(grid.tasks, grid.depths):
        make(task, haystack, min(grid.lengths), depth, grid.seed)
    records = []
    for task, length, depth, i in tqdm(grid.points(), unit="prompt", dynamic_ncols=True,
                                       disable=None if progress else True):
        sample = make(task, haystack, length, depth, grid.seed + i)
        with precision.applied():
            new, held = respond(model, sample, policy, pad)
        output = tokenizer.decode(new, skip_special_tokens=True)
        records.append({"task": task, "length": length, "depth": depth, "sample": i,
                        "tokens": len(sample.ids), "answers": list(sample.answers),
                        "output": output, "correct": found(output, sample.answers),
                        "kv_bytes": held})
    return records


def summarise(records: list[dict], grid: Grid) -> dict:
    """``results``: per task and length, the accuracy per depth, its mean over depths, and the
    mean bytes held after the prompts and prompt tokens; ``mean``: per length, the mean
    accuracy over the tasks and the mean bytes held."""
    def cell(task: str, length: int) -> dict:
        mine = [r for r in records if r["task"] == task and r["length"] == length]
        accuracy = {f"{d:g}": statistics.fmean(r["correct"] for r in mine if r["depth"] == d)
                    for d in grid.depths}
        return {"accuracy": accuracy, "mean": statistics.fmean(accuracy.values()),
                "kv_bytes": round(statistics.fmean(r["kv_bytes"] for r in mine)),
                "prompt_tokens": round(statistics.fmean(r["tokens"] for r in mine))}

    tasks = {task: {str(n): cell(task, n) for n in grid.lengths} for task in grid.tasks}
    lengths = {str(n): {
        "accuracy": statistics.fmean(tasks[task][str(n)]["mean"] for task in grid.tasks),
        "kv_bytes": round(statistics.fmean(r["kv_bytes"] for r in records if r["length"] == n))}
        for n in grid.lengths}
    return {"results": tasks, "mean": lengths}


def sign_test(lost: int, gained: int) -> float:
    """The exact two-sided sign test (McNemar's) of the prompts one policy lost against those
    it gained: the chance of a split at least this uneven were each as likely as the other."""
    n = lost + gained
    tail = sum(math.comb(n, k) for k in range(min(lost, gained) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired(reference: list[dict], other: list[dict]) -> dict:
    """Per task and length, ``other``'s prompt records (``prompts`` of :func:`longeval`)
    against the same prompts of ``reference``: the prompts, those ``other`` lost (right in
    ``reference``, wrong in it) and gained, the difference of their accuracies, and the
    sign test's p (:func:`sign_test`). Both must have scored the same prompts."""
    def key(r: dict) -> tuple:
        return r["task"], r["length"], r["depth"], r["sample"], tuple(r["answers"])

    theirs = {key(r): r["correct"] for r in other}
    if len(theirs) != len(other) or sorted(theirs) != sorted(key(r) for r in reference):
        raise UserError("the two evaluations did not score the same prompts (their tasks, "
                        "lengths, depths, samples or seeds differ)")
    cells: dict = {}
    for r in reference:
        cell = cells.setdefault(r["task"], {}).setdefault(
            str(r["length"]), {"prompts": 0, "lost": 0, "gained": 0})
        cell["prompts"] += 1
        cell["lost"] += r["correct"] and not theirs[key(r)]
        cell["gained"] += theirs[key(r)] and not r["correct"]
    for cell in (c for lengths in cells.values() for c in lengths.values()):
        cell["difference"] = (cell["gained"] - cell["lost"]) / cell["prompts"]
        cell["p"] = sign_test(cell["lost"], cell["gained"])
    return cells


def longeval(model_dir: Path, haystack: str, grid: Grid, cache: str, precision: Precision,
             progress: bool = True) -> dict:
    """The evaluation of the model in ``model_dir`` (see the module docstring): the model,
    haystack, cache policy and grid, the summary (:func:`summarise`), every prompt's record
    (``prompts``), what ran."""
    with _transformers_bars(progress):
        model, tokenizer = load_model_dir(model_dir, precision.device)
    grid.check(model)
    policy = build_policy(cache, model)
    records = evaluate(model, tokenizer, Haystack(load_haystack(haystack), tokenizer), grid,
                       policy, precision, progress)
    return {"model": str(model_dir), "haystack": haystack, "cache": policy.name,
            **asdict(grid), **summarise(records, grid), "prompts": records,
            "precision": precision.record(),
            "versions": {"adaspan": __version__, "transformers": transformers.__version__}}


def markdown(results: dict) -> str:
    """The results as text: accuracy per task, length and depth, with the bytes held."""
    lines = [f"# Long-context retrieval of {results['model']} (cache: {results['cache']})", "",
             *markdown_table(longeval_cells(results)), "",
             *markdown_table(longeval_length_cells(results), left=0)]
    precision = results["precision"]
    lines += ["", f"Prompts per cell: {results['samples']} (seed {results['seed']}); haystack: "
              f"{results['haystack']}; greedy decoding, {precision['dtype']} on "
              f"{precision['device']}."]
    return "\n".join(lines) + "\n"


def write(out: Path, results: dict, plots: bool = True) -> list[Path]:
    """``longeval.json``, ``longeval.md`` and, with ``plots``, ``longeval_TASK.png`` per task
    in ``out`` (written atomically); the paths."""
    out.mkdir(parents=True, exist_ok=True)
    files = {out / REPORT_FILE: (json.dumps(results, indent=1) + "\n").encode(),
             out / TABLE_FILE: markdown(results).encode()}
    if plots:
        files |= {out / f"longeval_{task}.png": png_bytes(heatmap_figure(results, task))
                  for task in results["tasks"]}
    atomic_write({path: functools.partial(Path.write_bytes, data=content)
                  for path, content in files.items()})
    return list(files)
