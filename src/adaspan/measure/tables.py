"""The text tables of the commands, for people: the spans of every head, what an evaluation
scored (and, on synthetic corpora, its bpc by distance back), each head's span during training,
a metrics record, the numbers of ``bench``; the cells of ``longeval``'s tables (Markdown here,
HTML in :mod:`adaspan.measure.page`)."""

from __future__ import annotations

import statistics
from collections.abc import Mapping

from ..model.analysis import span_summary


def span_table(spans: list[list[float]]) -> str:
    """Spans of every head as a text table, one row per layer (layer 0 = lowest)."""
    n_heads = max(len(layer) for layer in spans)
    head = "layer | " + " ".join(f"h{h:<6d}" for h in range(n_heads)) + " | mean"
    rows = [head, "-" * len(head)]
    for i, layer in enumerate(spans):
        cells = " ".join(f"{s:<7.0f}" for s in layer)
        rows.append(f"{i:>5d} | {cells} | {sum(layer) / len(layer):.0f}")
    summary = span_summary(spans)
    rows.append(f"average span {summary['avg_span']:.1f}, longest {summary['max_span']:.0f}")
    return "\n".join(rows)


BYTE_UNITS = ("byte", "character")  # a token is one byte of text: bpc says it all


def evaluation_text(result: dict, unit: str) -> str:
    """The result of ``adaspan evaluate`` (:func:`adaspan.training.evaluate.evaluate`, with its
    ``split``, ``data`` and precision): the bpc, then what was scored and how, indented, and
    the bpc ``by_distance`` where the result has it; ``unit``: what a token is."""
    lines = [f"{result['data']} {result['split']}: {score_text(result, unit)}",
             _evaluation_card(result, unit)]
    if "by_distance" in result:
        lines.append(_by_distance(result["by_distance"]))
    return "\n".join(lines)


def score_text(result: dict, unit: str) -> str:
    """The score of an evaluation ``result`` as fits what a token is (``unit``): bpc for bytes;
    otherwise bits per byte of the text, so that tokenizers compare, and per-token perplexity."""
    if unit in BYTE_UNITS:
        return f"{result['bpc']:.4f} bpc over {result['chars']:,} {unit}s{_bound(result)}"
    return (f"{result['bpc']:.4f} bits per byte over {result['bytes']:,} bytes{_bound(result)}; "
            f"perplexity {result['perplexity']:,.2f} per {unit} ({result['bits_per_token']:.4f} "
            f"bits) over {result['chars']:,} {unit}s")


def _bound(result: dict) -> str:
    """What a bpc under ``<unk>`` is: a lower bound, and the share of bytes it leaves out."""
    if not result.get("bpc_lower_bound"):
        return ""
    return (f" (a lower bound: {result['unk_share']:.1%} of the bytes are under <unk>, each "
            "word of them scored as one token)")


def _evaluation_card(result: dict, unit: str) -> str:
    """What :func:`adaspan.training.evaluate.evaluate` scored and how, indented."""
    cache = (f"yes, up to {max(result['cache_positions']):,} positions per stream"
             if result["cache_carried"] else "no, each block starts without context")
    short, longest = result["short_context_chars"], result["longest_span"]
    streams = "1 stream" if result["streams"] == 1 else f"{result['streams']} streams"
    return "\n".join([
        f"  {result['split']} split: {result['chars']:,} {unit}s scored in {streams} (batch "
        f"size) of {result['stream_chars']:,}, blocks of {result['block_size']}, in "
        f"{result['dtype']}{' (TF32)' if result['tf32'] else ''} on {result['device']}",
        f"  cache carried from block to block: {cache}",
        f"  {short:,} {unit}s ({short / result['chars']:.2%}) scored with fewer than the "
        f"longest span ({longest:.1f}{_in_bytes(longest, result, unit)}) of {unit}s before "
        "them: each stream starts without context (--batch-size 1: one stream)"])


def _in_bytes(tokens: float, result: dict, unit: str) -> str:
    """`` {unit}s, ~N bytes``: a length in tokens also in bytes of text, at the evaluation's
    average bytes per token (nothing for bytes)."""
    if unit in BYTE_UNITS:
        return ""
    return f" {unit}s, ~{tokens * result['bytes_per_token']:,.0f} bytes"


def _by_distance(groups: list[dict]) -> str:
    """The bpc of each group of :func:`adaspan.training.evaluate.bpc_by_distance`, one line each."""
    lines = ["  by the distance back to the character repeated:"]
    for group in groups:
        where = ("repeats nothing" if group["to"] == 0 else
                 f"{group['from']:,} or more back" if group["to"] is None else
                 f"{group['from']:,} to {group['to'] - 1:,} back")
        lines.append(f"    {where:<22} {group['chars']:>9,} chars  {group['bpc']:.4f} bpc")
    return "\n".join(lines)


def trajectory_table(trajectories: dict) -> str:
    """Each head's span during training (:func:`adaspan.model.analysis.span_trajectories`, from at
    least one record): a line per layer, a cell per head."""
    first, last = trajectories["steps"]
    lines = [f"span of each head during training (metrics.jsonl, steps {first:,} to {last:,}): "
             "start -> now (max)"]
    for i, layer in enumerate(trajectories["now"]):
        cells = (f"h{h} {trajectories['start'][i][h]:.1f} -> {now:.1f} "
                 f"({trajectories['max'][i][h]:.1f})" for h, now in enumerate(layer))
        lines.append(f"{i:>5d} | " + " | ".join(cells))
    return "\n".join(lines)


def record_line(record: dict) -> str:
    """A metrics record on one line, its values rounded for reading; each head's span
    (``head_spans``) left to :func:`trajectory_table`."""
    return ", ".join(f"{key}={_readable(key, value)}" for key, value in record.items()
                     if key != "head_spans")


def _readable(key: str, value: object) -> str:
    """A value of a metrics record for people: bpc to 4 decimals, spans to 1, other numbers to
    4 significant digits (whole numbers from 1,000 up)."""
    if isinstance(value, list):
        return f"[{', '.join(_readable(key, v) for v in value)}]"
    if not isinstance(value, float):
        return str(value)
    if "bpc" in key:
        return f"{value:.4f}"
    if "span" in key:
        return f"{value:.1f}"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def bench_table(result: dict, notes: Mapping[str, str]) -> str:
    """The numbers of ``adaspan bench``, a line each (floats to one decimal), with the note of
    each key of ``notes`` (what a memory figure measures)."""
    lines = []
    for key, value in result.items():
        shown = (f"{value:.1%}" if key.endswith("_share") else f"{value:,.1f}"
                 if isinstance(value, float) else value)
        note = f"  ({notes[key]})" if key in notes else ""
        lines.append(f"{key:>22}: {shown}{note}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- longeval

# A table as its cells: the header and the rows, every cell text.
Cells = tuple[list[str], list[list[str]]]

HELD = "kv bytes after the prompt"


def markdown_table(cells: Cells, left: int = 1) -> list[str]:
    """The lines of ``cells`` as a Markdown table, the first ``left`` columns aligned left,
    the others right."""
    head, rows = cells
    rule = "|" + "---|" * left + "---:|" * (len(head) - left)
    lines = ["| " + " | ".join(row) + " |" for row in (head, *rows)]
    return [lines[0], rule, *lines[1:]]


def longeval_cells(results: dict) -> Cells:
    """An ``adaspan longeval`` output (:mod:`adaspan.hf.longeval`) per task and length: the
    accuracy at each depth, its mean over the depths, and the bytes held after the prompt."""
    depths = [f"{d:g}" for d in results["depths"]]
    head = ["task", "length", *(f"depth {d}" for d in depths), "mean", HELD]
    rows = [[task, f"{int(length):,}", *(f"{cell['accuracy'][d]:.2f}" for d in depths),
             f"{cell['mean']:.2f}", f"{cell['kv_bytes']:,}"]
            for task, cells in results["results"].items() for length, cell in cells.items()]
    return head, rows


def longeval_length_cells(results: dict) -> Cells:
    """A longeval output per length: the accuracy (mean over the tasks) and the bytes held."""
    rows = [[f"{int(n):,}", f"{value['accuracy']:.2f}", f"{value['kv_bytes']:,}"]
            for n, value in results["mean"].items()]
    return ["length", "accuracy (mean over tasks)", HELD], rows


def longeval_comparison(evaluations: Mapping[str, dict]) -> Cells:
    """Longeval outputs side by side, a column each, headed by its key in ``evaluations``:
    each task's accuracy (the mean over its lengths and depths), the mean over the tasks, and
    the bytes held after the prompt at each length; "-" where an output lacks the task or the
    length."""
    outputs = list(evaluations.values())
    tasks = list(dict.fromkeys(task for results in outputs for task in results["tasks"]))
    lengths = sorted({str(n) for results in outputs for n in results["lengths"]}, key=int)
    rows = [[task, *(_mean_over_lengths(results["results"].get(task, {}), "mean")
                     for results in outputs)] for task in tasks]
    rows.append(["mean over tasks", *(_mean_over_lengths(results["mean"], "accuracy")
                                      for results in outputs)])
    rows += [[f"{HELD}, length {int(n):,}",
              *(f"{results['mean'][n]['kv_bytes']:,}" if n in results["mean"] else "-"
                for results in outputs)] for n in lengths]
    return ["task", *evaluations], rows


def _mean_over_lengths(by_length: Mapping[str, dict], key: str) -> str:
    """The mean of ``key`` over the cells of ``by_length`` (an accuracy), to two decimals; "-"
    where there is no cell."""
    values = [cell[key] for cell in by_length.values()]
    return f"{statistics.fmean(values):.2f}" if values else "-"
