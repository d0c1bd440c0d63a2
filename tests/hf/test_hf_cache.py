"""SpanCache: greedy generation equals the full cache's, with at most the window of keys held
per layer; absolute positions kept after truncation."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import HF_KINDS, tiny_hf
from transformers import DynamicCache

from adaspan.errors import UserError
from adaspan.hf import (
    SpanCache,
    add_spans,
    cache_argument,
    kv_bytes,
    save_model,
    span_modules,
    windows,
)

PROMPT = torch.randint(0, 64, (1, 50), generator=torch.Generator().manual_seed(3))
NEW = 30


def greedy(model, cache):
    out = model.generate(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                         **cache_argument(model, cache), return_dict_in_generate=True,
                         output_logits=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("kind", HF_KINDS)
def test_truncated_cache_generates_what_the_full_cache_does(kind, span_groups):
    model = add_spans(tiny_hf(kind), max_span=64, ramp=4)
    for span, row in zip(span_modules(model), [[5, 9, 17, 12], [6, 6, 8, 20]], strict=True):
        span.set_spans(torch.tensor(row, dtype=torch.float32))
    assert windows(model) == [17, 20]
    cache = SpanCache(model)
    tokens, logits = greedy(model, cache)
    full_tokens, full_logits = greedy(model, DynamicCache())
    assert torch.equal(tokens, full_tokens)
    torch.testing.assert_close(logits, full_logits, atol=1e-5, rtol=0)
    # each key/value head keeps window - 1 positions of its group's longest span: heads 0-1
    # and 2-3 share a key/value head (windows 9, 17 and 6, 20), except GPT-2's (one each)
    held = [4 + 8 + 16 + 11, 5 + 5 + 7 + 19] if kind == "gpt2" else [8 + 16, 5 + 19]
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(1, n, 8) for n in held]
    assert cache.get_seq_length() == PROMPT.shape[1] + NEW - 1
    assert kv_bytes(cache) == sum(held) * 2 * 8 * 4  # keys and values of 8 fp32 each
    groups = [len(layer.groups) for layer in cache.layers]
    assert groups == ([1, 1] if span_groups == "one group" else [4, 3] if kind == "gpt2"
                      else [2, 2])


def test_spans_covering_the_context_generate_what_the_model_without_spans_does():
    model = tiny_hf("llama")
    expected = greedy(model, DynamicCache())
    add_spans(model, init=1.0)  # S = 96 >= 80 tokens
    tokens, logits = greedy(model, SpanCache(model))
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1], atol=1e-5, rtol=0)


def test_the_cache_holds_no_more_than_the_window_however_long_the_text():
    model = add_spans(tiny_hf("qwen3", positions=512), max_span=512, ramp=4, init=0.0)
    cache = SpanCache(model)
    assert windows(model) == [4, 4]
    model.generate(PROMPT, max_new_tokens=100, min_new_tokens=100, do_sample=False,
                   **cache_argument(model, cache))
    assert cache.get_seq_length() == 149
    assert kv_bytes(cache) == 2 * 2 * 3 * 2 * 8 * 4  # layers, keys and values, R - 1 keys


@pytest.mark.parametrize("spans,padded", [([5.0, 30.0, 9.0, 12.0], False),
                                          ([28.0, 30.0, 29.0, 27.0], True)])
def test_beam_search_reorders_the_kept_positions(spans, padded, span_groups):
    """Key/value heads of windows 30 and 12 keep their own; of 30 and 29, both the longest
    (one padding position per 57 kept, under ``PADDED_WASTE``)."""
    model = add_spans(tiny_hf("qwen2"), max_span=64, ramp=4, init=0.1)
    for span in span_modules(model):
        span.set_spans(torch.tensor(spans))
    options = dict(max_new_tokens=12, min_new_tokens=12, num_beams=3, do_sample=False)
    expected = model.generate(PROMPT, **cache_argument(model, DynamicCache()), **options)
    cache = SpanCache(model)
    assert torch.equal(model.generate(PROMPT, **cache_argument(model, cache), **options),
                       expected)
    assert [layer.padded for layer in cache.layers] == [padded] * 2
    held = 2 * 29 if padded else 29 + 11
    assert kv_bytes(cache) == 2 * 2 * 3 * held * 8 * 4  # layers, keys and values, beams


def test_a_static_cache_and_rolling_back_are_refused():
    model = add_spans(tiny_hf("llama"))
    with pytest.raises(UserError, match="static cache"):
        model.generate(PROMPT, max_new_tokens=2, cache_implementation="static")
    with pytest.raises(UserError, match="roll back"):
        SpanCache(model).crop(-1)


def test_windows_are_the_longest_span_of_each_layer():
    model = add_spans(tiny_hf("gpt2"), max_span=64, ramp=8, init=0.1)
    assert windows(model) == [math.ceil(6.4 + 8)] * 2


def test_the_speed_script_prints_bytes_and_speeds_of_the_caches():
    """``scripts/bench/hf_cache_speed.py`` at a tiny size: one JSON line per context, the span cache
    holding R - 1 = 31 keys per layer (spans below R), the static one the window of R, while the
    full cache holds them all; with ``--compile``, full attention's static cache holds every
    position of the longest context from the start."""
    script = Path(__file__).parents[2] / "scripts" / "bench" / "hf_cache_speed.py"
    done = subprocess.run([sys.executable, str(script), "--contexts", "40,80", "--new", "3",
                           "--runs", "1", "--spans", "8,16", "--layers", "2", "--width", "32",
                           "--heads", "2", "--kv-heads", "1", "--compile"],
                          capture_output=True, text=True, check=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    assert [line["context"] for line in lines] == [40, 80]
    per_key = 2 * 1 * 16 * 4  # keys and values of one head of 16, fp32
    for line in lines:
        assert line["span_kv_bytes"] == 2 * 31 * per_key
        assert line["full_kv_bytes"] == 2 * (line["context"] + 3) * per_key
        assert line["static_kv_bytes"] == 2 * 32 * per_key
        assert line["span_decode_tokens_per_s"] > 0 and line["full_decode_tokens_per_s"] > 0
        assert line["full_compiled_kv_bytes"] == 2 * (80 + 3) * per_key
        assert line["static_compiled_kv_bytes"] == line["static_kv_bytes"]
        assert line["static_compiled_over_full_compiled_decode"] > 0
        assert line["static_over_span_decode"] > 0 and line["static_over_full_decode"] > 0


def test_the_speed_script_sets_spans_per_layer_and_key_value_head_with_sinks():
    """``--spans A/B --per-kv-head --sinks 2``: layer 0's key/value heads hold windows 8 and
    16, layer 1's 4 and 12 (z exact in fp32 at S = 64), each its window - 1 positions and the
    2 sinks; the static cache one slot a head more. Bad ``--spans`` are one-line errors."""
    script = Path(__file__).parents[2] / "scripts" / "bench" / "hf_cache_speed.py"
    options = ["--contexts", "61", "--new", "3", "--runs", "1", "--layers", "2", "--width",
               "32", "--heads", "2", "--kv-heads", "2", "--d-ff", "48", "--vocab", "40",
               "--ramp", "4", "--sinks", "2", "--per-kv-head"]
    done = subprocess.run([sys.executable, str(script), *options, "--spans", "8,16/4,12"],
                          capture_output=True, text=True, check=True, timeout=300)
    line = json.loads(done.stdout)
    per_position = 2 * 16 * 4  # a key and a value of 16 fp32 per key/value head
    kept = (7 + 2) + (15 + 2) + (3 + 2) + (11 + 2)
    assert line["span_kv_bytes"] == kept * per_position
    assert line["static_kv_bytes"] == (kept + 4) * per_position
    assert line["full_kv_bytes"] == 2 * 2 * 64 * per_position
    assert (line["spans"], line["sinks"], line["per_kv_head"]) == ("8,16/4,12", 2, True)
    for spans, error in [("8,16/4,12/4,4", "--spans: 3 groups of spans for 2 layers"),
                         ("8,x", "--spans: numbers split by , and /, got '8,x'"),
                         ("8,16/4,100", "--spans, layer 1: spans must lie in [1, max_span=64]"),
                         ("8,16,4", "--spans, layer 0: expected 2 spans, got 3")]:
        wrong = subprocess.run([sys.executable, str(script), *options, "--spans", spans],
                               capture_output=True, text=True, timeout=300)
        assert wrong.returncode != 0 and wrong.stderr.strip().startswith(error)
        assert "Traceback" not in wrong.stderr


def test_spans_per_key_value_head_keep_their_windows_in_the_cache():
    """A z per key/value head: each key/value head holds its own window - 1 positions, and the
    greedy tokens are those of the full cache."""
    model = add_spans(tiny_hf("llama"), max_span=64, ramp=4, per_kv_head=True)
    for span, row in zip(span_modules(model), [[5, 17], [20, 7]], strict=True):
        span.set_spans(torch.tensor(row, dtype=torch.float32))
    cache = SpanCache(model)
    tokens, logits = greedy(model, cache)
    full_tokens, full_logits = greedy(model, DynamicCache())
    assert torch.equal(tokens, full_tokens)
    torch.testing.assert_close(logits, full_logits, atol=1e-5, rtol=0)
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [(1, 4 + 16, 8), (1, 19 + 6, 8)]


def test_the_speed_script_reads_a_saved_model(tmp_path):
    """``--model DIR``: the saved model with its spans against itself with sdpa attention."""
    model = add_spans(tiny_hf("llama", positions=128), max_span=128, ramp=4)
    for span in span_modules(model):
        span.set_spans(torch.tensor([6.0, 10.0, 12.0, 20.0]))
    save_model(model, tmp_path / "model")
    script = Path(__file__).parents[2] / "scripts" / "bench" / "hf_cache_speed.py"
    done = subprocess.run([sys.executable, str(script), "--contexts", "60", "--new", "3",
                           "--runs", "1", "--model", str(tmp_path / "model")],
                          capture_output=True, text=True, check=True, timeout=300)
    [line] = [json.loads(line) for line in done.stdout.strip().splitlines()]
    per_position = 2 * 8 * 4  # a key and a value of 8 fp32 per key/value head
    assert line["full_kv_bytes"] == 2 * 2 * 63 * per_position  # layers, key/value heads
    assert line["span_kv_bytes"] == 2 * (9 + 19) * per_position  # windows 10 and 20, less one
    assert line["model"] == str(tmp_path / "model") and line["spans"] is None


def partitions(items):
    """Every split of ``items`` into groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for split in partitions(rest):
        yield [(first,), *split]
        for i, group in enumerate(split):
            yield [*split[:i], (first, *group), *split[i + 1:]]


@pytest.mark.parametrize("part_rows", [0, 100, 1000, 1e9])
def test_pad_groups_read_the_fewest_positions_of_any_split(part_rows):
    """Against every split of the heads: a group costs ``part_rows`` and its longest window
    for each head; every head in one group, in order."""
    from adaspan.hf.span_cache import pad_groups

    def cost(groups):
        return sum(part_rows + len(g) * max(kept[h] for h in g) for g in groups)

    rng = torch.Generator().manual_seed(1)
    for _ in range(20):
        kept = torch.randint(0, 3000, (5,), generator=rng).tolist()
        groups = pad_groups(kept, part_rows)
        assert sorted(h for g in groups for h in g) == list(range(5))
        assert all(list(g) == sorted(g) for g in groups) and list(groups) == sorted(groups)
        assert cost(groups) == min(cost(split) for split in partitions(list(range(5))))
    assert pad_groups([4095, 162], 1024) == ((0,), (1,))
    assert pad_groups([730, 613], 1024) == ((0, 1),)
