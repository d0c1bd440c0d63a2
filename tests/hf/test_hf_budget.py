"""The cache in bytes: what SpanCache holds is what span_cache_bytes says, and the penalty per
byte of cache is ln 2 * lambda * the bytes of the spans' z."""

import math

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import tiny_hf

from adaspan.hf import SpanCache, add_spans, cache_argument, kv_bytes, span_modules
from adaspan.hf.budget import cache_loss, full_cache_bytes, span_cache_bytes
from adaspan.hf.report import full_cache_bytes as report_full_bytes

SPANS = [[5.3, 9.6, 17.2, 12.4], [6.7, 6.1, 8.5, 20.3]]


def spanned(kind, **options):
    model = add_spans(tiny_hf(kind), max_span=64, ramp=4, **options)
    for span, row in zip(span_modules(model), SPANS, strict=True):
        span.set_spans(torch.tensor(row[:span.n_heads]))
    return model


@pytest.mark.parametrize("kind,sinks", [("llama", 0), ("qwen2", 3), ("gpt2", 2)])
@pytest.mark.parametrize("context", [6, 70])
def test_span_cache_bytes_are_what_the_cache_holds(kind, sinks, context):
    model = spanned(kind, sinks=sinks)
    cache = SpanCache(model)
    ids = torch.randint(0, 64, (1, context - 1), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False,
                   **cache_argument(model, cache))  # context positions held, then one more
    assert kv_bytes(cache) == span_cache_bytes(model, context, 4)


def test_full_cache_bytes_agree_with_the_report():
    config = tiny_hf("qwen2").config
    assert full_cache_bytes(config, 100, 2) == report_full_bytes(config, 100, 2)


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_the_penalty_counts_bytes_of_the_longest_span_per_key_value_head(per_kv_head):
    model = spanned("llama", per_kv_head=per_kv_head)  # 2 key/value heads of d = 8
    loss = cache_loss(model, bits_per_byte=1e-3, element_size=2)
    z = [[s - 4 for s in row] for row in SPANS]
    held = sum(max(row[0:2]) + max(row[2:4]) if not per_kv_head else row[0] + row[1]
               for row in z)
    assert loss.item() == pytest.approx(math.log(2) * 1e-3 * 2 * 8 * 2 * held, rel=1e-5)
    loss.backward()
    grads = [s.z_frac.grad for s in span_modules(model)]
    if not per_kv_head:  # only the longest of each pair moves
        assert [(g != 0).tolist() for g in grads] == [[False, True, True, False],
                                                      [True, False, False, True]]
