"""Attention sinks in Hugging Face models: the first positions weigh 1 for every query,
against the float64 reference (logits, gradients of z'), kept by SpanCache (the same greedy
tokens as the full cache, holding exactly sinks + window - 1 positions), saved and loaded."""

import math

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import HF_KINDS, tiny_hf
from reference import reference_hf_logits
from transformers import DynamicCache

from adaspan.errors import UserError
from adaspan.hf import (
    SpanCache,
    add_spans,
    cache_argument,
    kv_bytes,
    load_pretrained,
    save_model,
    span_modules,
)

IDS = torch.randint(0, 64, (2, 60), generator=torch.Generator().manual_seed(4))
SPANS = [[5.3, 9.6, 17.2, 12.4], [6.7, 6.1, 8.5, 20.3]]  # off the kinks of m_z


def with_sinks(kind, sinks=3, per_kv_head=False):
    model = add_spans(tiny_hf(kind), max_span=64, ramp=4, sinks=sinks,
                      per_kv_head=per_kv_head)
    for span, row in zip(span_modules(model), SPANS, strict=True):
        span.set_spans(torch.tensor(row[:span.n_heads]))
    return model


@pytest.mark.parametrize("kind", HF_KINDS)
def test_logits_and_span_gradients_equal_the_reference(kind):
    model = with_sinks(kind)
    for p in model.parameters():
        p.requires_grad_(False)
    spans = [s.z_frac.requires_grad_() for s in span_modules(model)]
    grad = torch.randn((*IDS.shape, model.config.vocab_size),
                       generator=torch.Generator().manual_seed(5))
    results = []
    for forward in (lambda: model(IDS).logits, lambda: reference_hf_logits(model, IDS)):
        logits = forward()
        (logits.double() * grad).sum().backward()
        results.append((logits.detach().double(), [s.grad.clone() for s in spans]))
        for s in spans:
            s.grad = None
    (logits, grads), (expected, expected_grads) = results
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-4)


def test_sinks_move_the_logits_of_short_spans():
    """The same spans without sinks give other logits (the test above can fail)."""
    with torch.no_grad():
        plain = add_spans(tiny_hf("llama"), max_span=64, ramp=4)
        for span, row in zip(span_modules(plain), SPANS, strict=True):
            span.set_spans(torch.tensor(row))
        gap = (plain(IDS).logits - with_sinks("llama")(IDS).logits).abs()
    assert gap[:, :2].max() < 1e-5 < gap[:, 30:].max()  # m_z = 1 for every sink: unmoved


def greedy(model, cache, prompt):
    out = model.generate(prompt, max_new_tokens=25, min_new_tokens=25, do_sample=False,
                         **cache_argument(model, cache), return_dict_in_generate=True,
                         output_logits=True)
    return out.sequences, torch.stack(out.logits)


@pytest.mark.parametrize("kind", HF_KINDS)
@pytest.mark.parametrize("prompt", [2, 50])
def test_span_cache_with_sinks_generates_what_the_full_cache_does(kind, prompt, span_groups):
    """Prompts shorter and longer than the sinks; the cache holds each key/value head's
    window - 1 positions and the sinks."""
    model = with_sinks(kind)
    cache = SpanCache(model)
    tokens, logits = greedy(model, cache, IDS[:1, :prompt])
    full_tokens, full_logits = greedy(model, DynamicCache(), IDS[:1, :prompt])
    assert torch.equal(tokens, full_tokens)
    torch.testing.assert_close(logits, full_logits, atol=1e-5, rtol=0)
    heads = 4 if kind == "gpt2" else 2  # key/value heads: 4 query heads each read one, or 2
    group = 4 // heads
    held = [sum(max(math.ceil(w) for w in row[g:g + group]) - 1 for g in range(0, 4, group))
            for row in SPANS]  # each key/value head's longest window - 1
    assert [tuple(layer.keys.shape) for layer in cache.layers] == [
        (1, n + 3 * heads, 8) for n in held]
    assert kv_bytes(cache) == (sum(held) + 2 * 3 * heads) * 2 * 8 * 4


def test_sinks_per_key_value_head_and_beam_search(span_groups):
    model = with_sinks("qwen2", sinks=2, per_kv_head=True)
    options = dict(max_new_tokens=10, min_new_tokens=10, num_beams=3, do_sample=False)
    prompt = IDS[:1, :40]
    expected = model.generate(prompt, **cache_argument(model, DynamicCache()), **options)
    got = model.generate(prompt, **cache_argument(model, SpanCache(model)), **options)
    assert torch.equal(got, expected)


def test_sinks_are_saved_and_loaded(tmp_path):
    model = with_sinks("llama", sinks=4)
    save_model(model, tmp_path)
    loaded = load_pretrained(tmp_path)
    assert [s.sinks for s in span_modules(loaded)] == [4, 4]
    assert loaded.config.adaptive_span["sinks"] == 4
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, model(IDS).logits)


def test_bad_sinks_and_padding_are_refused():
    with pytest.raises(UserError, match="sinks"):
        add_spans(tiny_hf("llama"), sinks=-1)
    model = with_sinks("llama")
    mask = torch.ones_like(IDS)
    mask[0, :5] = 0
    with torch.no_grad(), pytest.raises(UserError, match="without padding"):
        model(IDS, attention_mask=mask)


def naive_join_indices(lengths, kept, groups, seen, before, after, M):
    """The rows of [held; new] SpanLayer joins and keeps, one position at a time: group after
    group, per head its sinks (held or new), padding to the group's longest (the head's first
    new row), its window, its new rows; then the sinks of every head and the last kept
    positions of each head's block; and each group's rows."""
    H = len(lengths)
    held = H * before + sum(lengths)
    spread, block, bounds = [], {}, []
    for heads in groups:
        L, start = max(lengths[g] for g in heads), len(spread)
        for g in heads:
            n, first_new, window = lengths[g], held + g * M, H * before + sum(lengths[:g])
            block[g] = (len(spread), after + L + M)
            spread += [g * before + p if p < before else first_new + p - seen
                       for p in range(after)]
            spread += [first_new] * (L - n) + list(range(window, window + n))
            spread += range(first_new, first_new + M)
        bounds.append((start, len(spread)))
    sinks = [r for g in range(H) for r in range(block[g][0], block[g][0] + after)]
    windows = [r for g in range(H)
               for r in range(sum(block[g]) - min(kept[g], block[g][1] - after), sum(block[g]))]
    return spread, sinks + windows, tuple(bounds)


@pytest.mark.parametrize(("kept", "groups", "seen", "sinks", "M"), [
    ((7, 3), ((0, 1),), 0, 2, 5), ((7, 3), ((0,), (1,)), 1, 4, 1), ((7, 3), ((0, 1),), 5, 2, 1),
    ((40, 12, 25), ((0, 1, 2),), 30, 4, 1), ((40, 12, 25), ((0, 2), (1,)), 60, 4, 3),
    ((40, 12, 25, 3), ((0,), (1, 3), (2,)), 60, 0, 1), ((9, 9), ((0, 1),), 2, 0, 1),
    ((9, 9), ((0,), (1,)), 20, 0, 2)])
def test_span_layer_join_indices_match_the_naive_ones(kept, groups, seen, sinks, M):
    from adaspan.hf.span_cache import _join_indices

    lengths = tuple(min(n, seen) for n in kept)
    before, after = min(sinks, seen), min(sinks, seen + M)
    spread, keep, bounds = _join_indices(lengths, list(kept), groups, seen, before, after, M,
                                         torch.device("cpu"))
    assert (spread.tolist(), keep.tolist(), bounds) == naive_join_indices(
        lengths, kept, groups, seen, before, after, M)
