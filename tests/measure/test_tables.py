"""The text tables of the commands (tables.py) and the numbers they show (analysis.py), from
hand-made values: no model is trained."""

from __future__ import annotations

from adaspan.measure.tables import (
    bench_table,
    evaluation_text,
    record_line,
    span_table,
    trajectory_table,
)
from adaspan.model.analysis import head_span_history, span_trajectories

RESULT = {"data": "synthetic:copy", "split": "valid", "bpc": 1.23456, "chars": 2000,
          "streams": 1, "stream_chars": 2000, "block_size": 64, "dtype": "float32",
          "tf32": False, "device": "cpu", "cache_carried": False, "cache_positions": [0],
          "short_context_chars": 100, "longest_span": 99.94}


def test_span_table_has_a_row_per_layer_and_a_summary():
    lines = span_table([[10.0, 30.0], [100.0, 200.0]]).splitlines()
    assert lines[0].startswith("layer | h0") and lines[0].endswith("| mean")
    assert lines[2].split() == ["0", "|", "10", "30", "|", "20"]
    assert lines[-1] == "average span 85.0, longest 200"


def test_evaluation_text_says_what_was_scored_and_by_distance_where_given():
    lines = evaluation_text(RESULT, "character").splitlines()
    assert lines[0] == "synthetic:copy valid: 1.2346 bpc over 2,000 characters"
    assert "in 1 stream (batch size) of 2,000, blocks of 64, in float32 on cpu" in lines[1]
    assert lines[2] == "  cache carried from block to block: no, each block starts without context"
    assert "100 characters (5.00%)" in lines[3] and "longest span (99.9)" in lines[3]
    groups = [{"from": 0, "to": 0, "chars": 5, "bpc": 2.0},
              {"from": 32, "to": 128, "chars": 1000, "bpc": 1.0},
              {"from": 2048, "to": None, "chars": 7, "bpc": 0.5}]
    lines = evaluation_text({**RESULT, "by_distance": groups}, "character").splitlines()
    assert [line.split("  ")[2].strip() for line in lines[-3:]] == [
        "repeats nothing", "32 to 127 back", "2,048 or more back"]


def test_trajectories_of_each_head_from_the_records():
    events = [{"step": 1}, *({"step": s, "head_spans": [[s * 10.0, 5.0 / s]]} for s in (2, 3, 4))]
    trajectories = span_trajectories(head_span_history(events))
    assert trajectories == {"steps": [2, 4], "start": [[20.0, 2.5]], "now": [[40.0, 1.25]],
                            "max": [[40.0, 2.5]]}
    assert trajectory_table(trajectories).splitlines()[1] == (
        "    0 | h0 20.0 -> 40.0 (40.0) | h1 2.5 -> 1.2 (2.5)")
    assert span_trajectories(head_span_history(events[:1]))["steps"] == []


def test_a_record_and_bench_numbers_are_rounded_for_reading():
    record = {"step": 4, "valid_bpc": 1.234567, "avg_span": 31.96, "chars_per_s": 12345.6,
              "lr": 0.000123456, "head_spans": [[1.0]]}
    assert record_line(record) == "step=4, valid_bpc=1.2346, avg_span=32.0, chars_per_s=12,346, " \
                                  "lr=0.0001235"
    assert bench_table({"device": "cpu", "peak_mb": 1234.56}, {"peak_mb": "measured"}) == (
        "                device: cpu\n               peak_mb: 1,234.6  (measured)")
