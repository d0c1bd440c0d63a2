"""The cache in bytes: what SpanCache holds is what span_cache_bytes says, the penalty per
byte of cache is ln 2 * lambda * the bytes of the spans' z, and limit_cache lowers every z' by
the least shared amount that meets a budget."""

import math

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import tiny_hf

from adaspan.errors import UserError
from adaspan.hf import SpanCache, add_spans, cache_argument, kv_bytes, span_modules
from adaspan.hf.budget import cache_loss, full_cache_bytes, limit_cache, span_cache_bytes
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


def z_fracs(model):
    return [span.z_frac.detach().clone() for span in span_modules(model)]


def bytes_lowered_by(model, amount, context):
    """Naive: a copy of z' lowered by ``amount`` (clamped at 0) set on the model, measured,
    restored."""
    before = z_fracs(model)
    with torch.no_grad():
        for span, z in zip(span_modules(model), before, strict=True):
            span.z_frac.copy_((z - amount).clamp(0, 1))
        held = span_cache_bytes(model, context, 2)
        for span, z in zip(span_modules(model), before, strict=True):
            span.z_frac.copy_(z)
    return held


@pytest.mark.parametrize("kind,sinks,per_kv_head", [("llama", 0, False), ("llama", 2, True),
                                                    ("qwen2", 3, False)])
@pytest.mark.parametrize("share", [0.65, 0.85])
def test_limit_cache_lowers_every_z_by_the_least_amount_that_meets_the_budget(
        kind, sinks, per_kv_head, share):
    model, context = spanned(kind, sinks=sinks, per_kv_head=per_kv_head), 40
    budget = share * span_cache_bytes(model, context, 2)
    before = z_fracs(model)
    grid = [k / 4096 for k in range(4097)]  # the least grid amount that meets the budget
    least = next(a for a in grid if bytes_lowered_by(model, a, context) <= budget)
    amount = limit_cache(model, budget, context)
    assert least - 1 / 4096 < amount <= least
    assert span_cache_bytes(model, context, 2) <= budget
    assert bytes_lowered_by(model, -1e-6, context) > budget  # a hair less would not do
    for z, start in zip(z_fracs(model), before, strict=True):
        torch.testing.assert_close(z, (start - amount).clamp(0, 1))


def test_limit_cache_leaves_spans_within_the_budget_and_refuses_one_no_spans_meet():
    model, context = spanned("llama", sinks=2), 40
    before, held = z_fracs(model), span_cache_bytes(model, context, 2)
    assert limit_cache(model, held, context) == 0.0
    assert all(torch.equal(a, b) for a, b in zip(z_fracs(model), before, strict=True))
    least = bytes_lowered_by(model, 1.0, context)  # every z = 0: sinks + R - 1 per head
    assert least == 2 * 2 * (2 + 3) * 2 * 8 * 2  # layers, kv heads, positions, k+v, d, bf16
    with pytest.raises(UserError, match="cannot be met"):
        limit_cache(model, least - 1, context)
    assert all(torch.equal(a, b) for a, b in zip(z_fracs(model), before, strict=True))
    assert limit_cache(model, least, context) > 0 and span_cache_bytes(model, context, 2) == least


def test_a_span_a_step_took_above_s_gives_up_its_excess_first():
    """limit_cache runs before the clamp to [0, 1]: z' = 1.5 (S/2 above S) holds S until the
    shared amount exceeds 0.5, the projection onto the box and the budget together."""
    model, context = spanned("llama"), 80
    with torch.no_grad():
        span_modules(model)[0].z_frac[0] = 1.5
    before = z_fracs(model)
    budget = span_cache_bytes(model, context, 2) - 2 * 8 * 2 * 6  # six positions fewer
    amount = limit_cache(model, budget, context)
    assert 0 < amount < 0.5 and span_cache_bytes(model, context, 2) <= budget
    assert span_modules(model)[0].z_frac[0].item() == 1.0
    for z, start in zip(z_fracs(model), before, strict=True):
        torch.testing.assert_close(z, (start - amount).clamp(0, 1))


@pytest.mark.parametrize("spared", [True, False])
def test_limit_cache_can_spare_the_heads_at_s(spared):
    """With spare_full the heads at S keep it where the others meet the budget alone."""
    model, context = spanned("llama", per_kv_head=True), 80
    with torch.no_grad():
        span_modules(model)[1].z_frac[1] = 1.0  # a key/value head at S: 63 positions held
    before = z_fracs(model)
    budget = span_cache_bytes(model, context, 2) - 2 * 8 * 2 * 4  # four positions fewer
    amount = limit_cache(model, budget, context, spare_full=spared)
    assert span_cache_bytes(model, context, 2) <= budget
    assert (span_modules(model)[1].z_frac[1].item() == 1.0) == spared
    for z, start in zip(z_fracs(model), before, strict=True):
        expected = (start - amount).clamp(0, 1)
        torch.testing.assert_close(z, torch.where(start >= 1, start, expected) if spared
                                   else expected)
    if spared:  # when the others cannot meet it, the head at S gives way too
        least = bytes_lowered_by(model, 1.0, context)
        limit_cache(model, least + 2 * 8 * 2, context, spare_full=True)
        assert span_modules(model)[1].z_frac[1].item() < 1.0
