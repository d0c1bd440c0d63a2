"""`adaspan compare` on tiny models: rows, determinism, tables, reuse of finished runs, CLI."""

from __future__ import annotations

import base64
import csv
import html
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from adaspan.attention.registry import ATTENTIONS
from adaspan.cli import main
from adaspan.config import ConfigError
from adaspan.experiments.compare import (
    COLUMNS,
    COMPARE_FIGURE,
    COMPARE_PAGE,
    CSV_FILE,
    MARKDOWN_FILE,
    MethodError,
    compare,
    format_markdown,
)
from adaspan.measure.page import compare_page
from adaspan.resolve import resolve_config
from adaspan.run.checkpoint import RunDirError

TINY = ["n_layers=1", "d_model=16", "n_heads=2", "d_inner=32", "max_span=64", "batch_size=2",
        "block_size=16", "eval_chars=64", "eval_interval=2", "log_interval=1",
        "checkpoint_interval=2", "tensorboard=false", "device=cpu"]
METHODS = ["fixed", "adaptive", "xl"]
EVAL_CHARS = 256
FIELDS = ["method", "layers", "avg_span", "params", "flops_per_char", "peak_mb", "chars_per_s",
          "steps", "valid_bpc", "test_bpc", "train_precision", "eval_precision"]


def _configs(*extra: str):
    return resolve_config("cpu-small", overrides=[*TINY, "steps=2", *extra])


def _compare(out, methods=METHODS, extra=(), **kwargs) -> list[dict]:
    kwargs = {"evaluate_test": True, "eval_chars": EVAL_CHARS, "progress": False, **kwargs}
    return compare(methods, *_configs(*extra), out, **kwargs)


def _no_training(*args, **kwargs):
    raise AssertionError("a finished run was trained again")


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    out = tmp_path_factory.mktemp("compare")
    return out, _compare(out)


def test_one_row_per_method_with_table_fields(compared):
    _, rows = compared
    assert [row["method"] for row in rows] == METHODS
    fixed, adaptive, xl = rows
    for row in rows:
        assert list(row) == FIELDS
        assert row["layers"] == 1 and row["steps"] == 2 and row["params"] > 0
        assert row["chars_per_s"] > 0 and row["flops_per_char"] > 0 and row["peak_mb"] > 0
        assert 0 < row["valid_bpc"] < 9 and 0 < row["test_bpc"] < 9
    assert fixed["avg_span"] == xl["avg_span"] == 64
    assert adaptive["avg_span"] < 64  # spans start at R = 32 and hardly move in 2 steps
    assert adaptive["flops_per_char"] < fixed["flops_per_char"]  # attention follows the span


def test_curves_of_every_method_are_drawn_side_by_side(compared):
    out, _ = compared
    assert (out / COMPARE_FIGURE).read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    page = (out / COMPARE_PAGE).read_text()
    embedded = base64.b64decode(re.search(r"base64,([^']+)'", page).group(1))
    assert embedded == (out / COMPARE_FIGURE).read_bytes()
    assert "bpc against training time" in page and "<th>Method</th>" in page
    assert all(f"<tr><td>{method}</td>" in page for method in METHODS) and ":---" not in page
    assert re.findall(r"alt='spans of ([a-z]+)'", page) == ["adaptive"]  # learned spans only


def test_page_table_shows_the_rows_of_the_markdown_table(compared):
    out, _ = compared
    page = (out / COMPARE_PAGE).read_text()
    lines = [line for line in (out / MARKDOWN_FILE).read_text().splitlines()
             if line.startswith("|")]
    for tag, line in [("th", lines[0]), *(("td", line) for line in lines[2:])]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert "<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>" in page


def test_page_table_is_rendered_from_rows_and_escaped():
    rows = [{"method": "<b>&", "steps": 1200, "valid_bpc": 1.23456},
            {"method": "plain", "steps": 7, "valid_bpc": 2.0}]
    columns = [column for column in COLUMNS if column[0] in rows[0]]
    page = compare_page("out", [b"png"], "bpc < 2 & more", rows, columns, ["a <note>"], {}, 64)
    assert ("<tr><th>Method</th><th>steps</th><th>valid bpc</th></tr>"
            "<tr><td>&lt;b&gt;&amp;</td><td>1,200</td><td>1.235</td></tr>"
            "<tr><td>plain</td><td>7</td><td>2.000</td></tr></table>") in page
    assert "<p>bpc &lt; 2 &amp; more</p>" in page and "<li>a &lt;note&gt;</li>" in page
    assert "<b>" not in page and "fig-compare-spans" not in page  # no method with spans


def test_without_matplotlib_the_table_is_written_and_the_figures_skipped(compared, tmp_path,
                                                                        monkeypatch):
    out, _ = compared
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    (copy / COMPARE_FIGURE).unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    messages = []
    assert len(_compare(copy, log=messages.append)) == len(METHODS)
    assert (copy / MARKDOWN_FILE).is_file() and not (copy / COMPARE_FIGURE).exists()
    assert messages[-1].startswith("no figures: plots need matplotlib")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_seed_gives_identical_results(tmp_path, dtype):
    """Trained in fp32 or under bf16 autocast, scored in fp32 (the default of a score)."""
    first, again = (_compare(tmp_path / name, ["fixed"], extra=[f"dtype={dtype}"])
                    for name in ("first", "again"))
    assert {**again[0], "chars_per_s": None} == {**first[0], "chars_per_s": None}
    assert (first[0]["train_precision"], first[0]["eval_precision"]) == (dtype, "float32")
    weights = "fixed/model.safetensors"
    assert (tmp_path / "first" / weights).read_bytes() == (tmp_path / "again" / weights
                                                            ).read_bytes()


def test_markdown_has_header_and_one_row_per_method(compared):
    out, _ = compared
    table = [line for line in (out / MARKDOWN_FILE).read_text().splitlines()
             if line.startswith("|")]
    assert table[0].split("|")[1:-1] == [
        " Method ", " #layers ", " Avg. span ", " #Params ", " FLOPs/char ", " Peak MB ",
        " chars/s ", " steps ", " valid bpc ", " test bpc "]
    assert set(table[1]) <= set("|-: ")
    assert [line.split("|")[1].strip() for line in table[2:]] == METHODS
    assert "FLOPs/char:" in (out / MARKDOWN_FILE).read_text()


def test_markdown_leaves_out_test_column_without_test_bpc(compared):
    _, rows = compared
    header = format_markdown([{k: v for k, v in row.items() if k != "test_bpc"}
                              for row in rows]).splitlines()[0]
    assert "valid bpc" in header and "test bpc" not in header


def test_csv_parses_back(compared):
    out, rows = compared
    with (out / CSV_FILE).open(newline="") as file:
        parsed = list(csv.DictReader(file))
    assert [row["method"] for row in parsed] == METHODS
    for row, original in zip(parsed, rows, strict=True):
        assert list(row) == FIELDS
        assert float(row["valid_bpc"]) == original["valid_bpc"]
        assert int(row["params"]) == original["params"]


def test_unknown_or_repeated_method_is_refused_before_training(tmp_path):
    every_variant = ", ".join(ATTENTIONS)
    with pytest.raises(MethodError, match=re.escape(f"'bogus'; choose from {every_variant}")):
        _compare(tmp_path / "out", ["fixed", "bogus"])
    with pytest.raises(MethodError, match="each method once"):
        _compare(tmp_path / "out", ["fixed", "fixed"])
    assert not (tmp_path / "out").exists()


def test_finished_runs_are_reused(compared, tmp_path, monkeypatch):
    out, rows = compared
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    monkeypatch.setattr("adaspan.experiments.compare.train", _no_training)
    reused = _compare(tmp_path, evaluate_test=False)
    assert reused == [{k: v for k, v in row.items() if k != "test_bpc"} for row in rows]


def test_rerun_with_fewer_methods_keeps_the_rows_of_the_finished_ones(compared, tmp_path,
                                                                    monkeypatch):
    out, rows = compared
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    monkeypatch.setattr("adaspan.experiments.compare.train", _no_training)
    # their bpc is read back
    monkeypatch.setattr("adaspan.experiments.compare.evaluate", _no_training)
    assert _compare(tmp_path, ["xl"]) == [rows[2], rows[0], rows[1]]  # then registry order
    table = [line for line in (tmp_path / MARKDOWN_FILE).read_text().splitlines()
             if line.startswith("|")]
    assert [line.split("|")[1].strip() for line in table[2:]] == ["xl", "fixed", "adaptive"]
    with (tmp_path / CSV_FILE).open(newline="") as file:
        assert [row["method"] for row in csv.DictReader(file)] == ["xl", "fixed", "adaptive"]


def test_finished_runs_are_reused_with_other_threads(compared, tmp_path, monkeypatch):
    """threads change the speed, not what a run learns."""
    out, rows = compared
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    monkeypatch.setattr("adaspan.experiments.compare.train", _no_training)
    assert _compare(tmp_path, extra=["threads=1"]) == rows


def test_run_with_other_settings_is_not_reused(compared, tmp_path, monkeypatch):
    out, _ = compared
    shutil.copytree(out, tmp_path, dirs_exist_ok=True)
    monkeypatch.setattr("adaspan.experiments.compare.train", _no_training)
    with pytest.raises(RunDirError, match="delete it to train fixed again"):
        _compare(tmp_path, extra=["steps=3"])


def test_cli_compare_json_last_line(tmp_path, capsys):
    assert main(["compare", "--methods", "fixed,adaptive", "--steps", "2", "--out",
                 str(tmp_path), "--eval-chars", str(EVAL_CHARS), "--json", "--no-progress",
                 *TINY]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["method"] for row in rows] == ["fixed", "adaptive"]
    assert all(row["steps"] == 2 and "test_bpc" not in row for row in rows)
    assert (tmp_path / MARKDOWN_FILE).is_file() and (tmp_path / CSV_FILE).is_file()


def test_cli_minutes_budget_prints_markdown(tmp_path, capsys):
    assert main(["compare", "--methods", "vanilla", "--minutes", "1e-6", "--out",
                 str(tmp_path), "--eval-chars", str(EVAL_CHARS), "--no-progress", *TINY]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"comparing vanilla in {tmp_path}: each trains for 6e-05 s "
                                   "of training (set it with --steps N or --minutes M)")
    row = next(line for line in out.splitlines() if line.startswith("| vanilla"))
    assert row.split("|")[8].strip() == "1"  # the time budget, not steps, ended training
    assert row.split("|")[3].strip() == "15"  # S = 64, but it sees at most its block of 16


def test_cli_unknown_method_is_one_line_error(tmp_path, capsys):
    assert main(["compare", "--methods", "fixed,bogus", "--out", str(tmp_path / "out")]) == 2
    assert "unknown method(s) 'bogus'" in capsys.readouterr().err


def test_runs_of_a_relative_corpus_path_are_reused(tmp_path, monkeypatch, corpus_file):
    monkeypatch.chdir(tmp_path)
    shutil.copy(corpus_file, tmp_path / "text.txt")
    first = _compare(tmp_path / "out", methods=["fixed"], extra=["data=text.txt"],
                     evaluate_test=False)
    monkeypatch.setattr("adaspan.experiments.compare.train", _no_training)
    messages = []
    again = _compare(tmp_path / "out", methods=["fixed"], extra=["data=text.txt"],
                     evaluate_test=False, log=messages.append)
    assert again == first  # the training summary is read back: same steps and throughput
    assert messages[0] == (f"comparing fixed in {tmp_path / 'out'}: each trains for 2 steps "
                           "(set it with --steps N or --minutes M)")  # the preset's, stated
    assert messages[1].endswith("finished run with the same configuration, reused")


# ------------------------------------------------------------- against the span limit (Figure 2)


@pytest.fixture(scope="module")
def against_limits(tmp_path_factory):
    out = tmp_path_factory.mktemp("limits")
    return out, _compare(out, ["fixed", "adaptive"], max_spans=[128, 64], evaluate_test=False)


def test_one_row_per_method_and_span_limit(against_limits):
    out, rows = against_limits
    assert [(row["method"], row["max_span"]) for row in rows] == [
        ("fixed", 64), ("adaptive", 64), ("fixed", 128), ("adaptive", 128)]
    assert all((out / f"{m}-S{s}" / "config.json").is_file() for m in ("fixed", "adaptive")
               for s in (64, 128))
    by = {(row["method"], row["max_span"]): row for row in rows}
    # a fixed span pays for S; a learned span (near R = 32 after 2 steps) for what it uses
    fixed_growth = by["fixed", 128]["flops_per_char"] - by["fixed", 64]["flops_per_char"]
    assert fixed_growth == pytest.approx(2 * 8 * 64 * 2)  # 2 d_head per key, 2 heads, 64 keys
    assert by["adaptive", 128]["flops_per_char"] == pytest.approx(
        by["adaptive", 64]["flops_per_char"], rel=0.01)
    assert by["fixed", 128]["peak_mb"] > by["fixed", 64]["peak_mb"]
    assert by["fixed", 64]["avg_span"] == 64 and by["fixed", 128]["avg_span"] == 128


def test_span_limit_figure_is_drawn_and_embedded(against_limits):
    out, _ = against_limits
    png = (out / "compare_max_spans.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    page = (out / COMPARE_PAGE).read_text()
    assert base64.b64encode(png).decode() in page and "Figure 2" in page
    assert "<th>S</th>" in (page) and "| S |" in (out / MARKDOWN_FILE).read_text()


def test_span_limit_runs_are_reused(against_limits, tmp_path, monkeypatch):
    out, rows = against_limits
    shutil.copytree(out, tmp_path / "again")
    monkeypatch.setattr("adaspan.experiments.compare.train", _no_training)
    again = _compare(tmp_path / "again", ["fixed", "adaptive"],
                     max_spans=[64, 128], evaluate_test=False)
    assert again == rows


@pytest.mark.parametrize("limits, message", [([64, 64], "once"), ([16], "max_span=16")])
def test_bad_span_limits_are_refused_before_training(tmp_path, limits, message):
    with pytest.raises(ConfigError, match=message):
        _compare(tmp_path, ["adaptive"], max_spans=limits)
    assert not any(tmp_path.iterdir())


def test_cli_max_spans(tmp_path, capsys):
    assert main(["compare", *TINY, "--steps", "1", "--methods", "fixed", "--max-spans",
                 "64,96", "--out", str(tmp_path / "c"), "--json", "--no-progress"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["max_span"] for row in rows] == [64, 96]
    for bad in ("64,x", "0,64", "-64"):  # refused before anything runs
        with pytest.raises(SystemExit) as exit_info:
            main(["compare", "--max-spans", bad, "--out", str(tmp_path / "d")])
        assert exit_info.value.code == 2
        assert "not a list of whole numbers > 0" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


def test_a_comparison_of_bpe_runs_gives_spans_and_flops_per_byte_too(tmp_path):
    rows = _compare(tmp_path / "bpe", ["fixed", "adaptive"],
                    ("tokenizer=bpe", "vocab_size=300", f"data_dir={tmp_path / 'cache'}"),
                    evaluate_test=False)
    for row in rows:
        ratio = row["avg_span_bytes"] / row["avg_span"]  # bytes per token of the valid prefix
        assert 1.5 < ratio < 4  # 300 byte-level BPE tokens of English
        assert row["flops_per_byte"] == pytest.approx(row["flops_per_char"] / ratio)
    assert "FLOPs/byte" in (tmp_path / "bpe" / MARKDOWN_FILE).read_text()


def test_a_comparison_on_a_vocabulary_with_unk_flags_its_bits_per_byte(tmp_path, corpus_file):
    """A user's words vocabulary with <unk> (adaspan 0.8's format): each row gives the share of
    the valid bytes under <unk>, and the caption calls bpc a lower bound."""
    words = Path(corpus_file).read_bytes().decode().split()
    symbols = ["<eos>", "<unk>", *sorted(set(words), key=words.count, reverse=True)[:30]]
    vocabulary = tmp_path / "old.json"
    vocabulary.write_text(json.dumps({"adaspan_tokenizer": "words", "version": 1,
                                      "min_count": 1, "max_size": 32, "symbols": symbols}))
    rows = _compare(tmp_path / "unk", ["fixed", "adaptive"],
                    ("tokenizer=words", f"tokenizer_file={vocabulary}", "vocab_size=32",
                     f"data={corpus_file}", f"data_dir={tmp_path / 'cache'}"),
                    evaluate_test=False)
    shares = {row["valid_unk_share"] for row in rows}
    assert len(shares) == 1 and 0 < shares.pop() < 1  # the same text, the same share
    markdown = (tmp_path / "unk" / MARKDOWN_FILE).read_text()
    assert "valid bytes under <unk>" in markdown and "a lower bound" in markdown.splitlines()[0]
    plain = _compare(tmp_path / "bytes", ["fixed"], (f"data={corpus_file}",),
                     evaluate_test=False)
    assert "valid_unk_share" not in plain[0]
    assert "lower bound" not in (tmp_path / "bytes" / MARKDOWN_FILE).read_text()
