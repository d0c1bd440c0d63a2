"""Memory for the whole run: validation's key/value buffers counted, the estimate made again as
the spans grow, ``batch_split`` raised when a step would not fit (the same update), and a clean
stop with a checkpoint when not even one stream fits — with ``memory_limit`` standing in for a
small device."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers import TRAIN_MODEL, run_quietly, tiny, tiny_train_config

from adaspan.model.lm import SpanLM
from adaspan.run.checkpoint import RunDir
from adaspan.training.memory import GB, OutOfMemory, estimate_training_memory, evaluation_memory
from adaspan.training.train import _Loop

MODEL = replace(TRAIN_MODEL, dropout=0.0)  # no dropout: a split batch draws no other masks
S, HEADS = MODEL.max_span, MODEL.n_heads


def _key_value_bytes(model: SpanLM, streams: int, block: int) -> int:
    """Bytes of the key/value buffers an evaluation block of ``streams`` streams holds."""
    with torch.no_grad():
        _, cache = model(torch.randint(0, 32, (streams, block)),
                         model.empty_cache(streams, keys_values=True))
    return sum(c.buffers.keys.nbytes + c.buffers.values.nbytes for c in cache)


def test_evaluation_memory_counts_the_key_value_buffers():
    model = tiny("adaptive")
    assert evaluation_memory(model, 3, 16) == _key_value_bytes(model, 3, 16)


def _spans_jump_to_s_after(step: int, monkeypatch) -> None:
    """Every span set to S after training step ``step`` (a checkpoint step: the loop looks at
    the memory then): the spans 'grow' at once."""
    original = _Loop._step

    def step_then_grow(loop):
        original(loop)
        if loop.state.step == step:
            loop.model.set_spans([S] * HEADS)

    monkeypatch.setattr(_Loop, "_step", step_then_grow)


def _estimate_gb(streams: int, spans: float | None) -> float:
    """The estimate the loop makes for ``streams`` streams per slice (at initial spans, or
    every span at ``spans``)."""
    model = SpanLM(MODEL)
    if spans is not None:
        model.set_spans([spans] * HEADS)
    return estimate_training_memory(model, "adamw", streams, 32, validation=True).total / GB


def _weights(run_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "model.safetensors")


def test_a_run_whose_spans_outgrow_its_memory_raises_batch_split_and_learns_the_same(
        tmp_path, corpus_file, monkeypatch):
    _spans_jump_to_s_after(3, monkeypatch)
    limit = (_estimate_gb(4, None) + _estimate_gb(4, S)) / 2  # fits now, not at S
    assert _estimate_gb(2, S) < limit
    lines = []
    config = tiny_train_config(corpus_file, memory_limit=limit)
    from adaspan import train

    train(MODEL, config, tmp_path / "small", progress=False, log=lines.append)
    raised = [line for line in lines if "batch_split raised from 1 to" in line]
    assert len(raised) == 1 and raised[0].startswith("step 3:"), lines
    run_quietly(tmp_path / "large", tiny_train_config(corpus_file), MODEL)  # never split
    small, large = _weights(tmp_path / "small"), _weights(tmp_path / "large")
    for name in large:
        torch.testing.assert_close(small[name], large[name], atol=1e-6, rtol=1e-5, msg=name)


def test_a_run_that_cannot_fit_one_stream_stops_with_a_checkpoint(tmp_path, corpus_file,
                                                                   monkeypatch):
    _spans_jump_to_s_after(3, monkeypatch)
    limit = (_estimate_gb(1, None) + _estimate_gb(1, S)) / 2  # fits now, not at S
    run_dir = tmp_path / "run"
    with pytest.raises(OutOfMemory, match="stopped at step 3 with a checkpoint") as stop:
        run_quietly(run_dir, tiny_train_config(corpus_file, memory_limit=limit), MODEL)
    assert "\n" not in str(stop.value)
    assert RunDir(run_dir).saved_step() == 3
    start = json.loads((run_dir / "config.json").read_text())["train"]
    assert start["batch_split"] == 4  # raised at the start already: one stream per slice


def test_a_run_that_cannot_start_is_refused_before_writing(tmp_path, corpus_file):
    limit = _estimate_gb(1, None) / 2
    with pytest.raises(OutOfMemory, match="one stream per slice"):
        run_quietly(tmp_path / "run", tiny_train_config(corpus_file, memory_limit=limit), MODEL)
    assert not (tmp_path / "run").exists()


def test_evaluation_memory_counts_the_key_value_heads():
    model = tiny("adaptive", kv_heads=1, position_table="rotary")
    held = _key_value_bytes(model, 2, 16)
    assert evaluation_memory(model, 2, 16) == held
    assert held * 4 == evaluation_memory(tiny("adaptive"), 2, 16)  # 1 key/value head of 4
