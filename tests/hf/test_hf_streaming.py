"""Hard windows (StreamingLLM's sinks + recent window, DuoAttention's heads): the logits of
a naive masked attention, SpanCache holding exactly sinks + window - 1 positions, and the
model as it was after the block."""

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import tiny_hf
from transformers import DynamicCache

from adaspan.attention.span import exact_fraction
from adaspan.errors import UserError
from adaspan.hf import SpanCache, add_spans, cache_argument, kv_bytes, span_modules
from adaspan.hf.cache_policies import build_policy
from adaspan.hf.streaming import hard_windows, streaming_windows

IDS = torch.randint(0, 64, (1, 70), generator=torch.Generator().manual_seed(6))


def naive_logits(model, window, sinks):
    """The model's eager attention with a 4D mask: key j visible to query i when
    i - window < j <= i, or j < sinks."""
    T = IDS.shape[1]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (j <= i) & ((i - j < window) | (j < sinks))
    mask = torch.zeros(1, 1, T, T).masked_fill(~visible, torch.finfo(torch.float32).min)
    model.set_attn_implementation("eager")
    try:
        return model(IDS, attention_mask=mask).logits
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("window,sinks", [(8, 0), (8, 4), (20, 2)])
def test_streaming_windows_give_the_naive_masked_attention(kind, window, sinks):
    model = tiny_hf(kind)
    with torch.no_grad():
        expected = naive_logits(model, window, sinks)
        with hard_windows(model, streaming_windows(model, window), sinks):
            got = model(IDS).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_span_cache_holds_sinks_and_the_window_and_generates_the_same(kind):
    model, window, sinks = tiny_hf(kind), 12, 3
    options = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    with hard_windows(model, streaming_windows(model, window), sinks):
        cache = SpanCache(model)
        tokens = model.generate(IDS, **cache_argument(model, cache), **options)
        full = model.generate(IDS, **cache_argument(model, DynamicCache()), **options)
    assert torch.equal(tokens, full)
    kv = model.config.num_key_value_heads if kind == "llama" else 4
    assert kv_bytes(cache) == 2 * kv * (sinks + window - 1) * 2 * 8 * 4  # layers, k and v, fp32


def test_windows_per_key_value_head_and_the_model_restored():
    """DuoAttention's pattern (one head full, one streaming) on a model with its own spans:
    afterwards its spans, settings and logits are back."""
    model = add_spans(tiny_hf("llama"), max_span=64, ramp=4, init=0.3)
    with torch.no_grad():
        before = model(IDS).logits
        settings = dict(model.config.adaptive_span)
        with hard_windows(model, [[64, 10], [10, 64]], sinks=2):
            assert [s.windows(None) for s in span_modules(model)] == [[64, 10], [10, 64]]
            during = model(IDS).logits
        after = model(IDS).logits
    assert not torch.equal(during, before)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert model.config.adaptive_span == settings
    plain = tiny_hf("qwen2")
    with hard_windows(plain, streaming_windows(plain, 5)):
        pass
    assert not span_modules(plain) and plain.config._attn_implementation == "sdpa"
    assert not hasattr(plain.config, "adaptive_span")


def test_windows_of_the_wrong_shape_are_refused_and_undone():
    model = tiny_hf("llama")
    with pytest.raises(UserError, match="2 layers of 2 key/value heads"), \
            hard_windows(model, [[4, 4]], sinks=1):
        pass
    assert not span_modules(model)


@pytest.mark.parametrize("max_span", [96, 1000, 4096, 32768])
def test_the_fraction_gives_the_whole_z(max_span):
    for z in (0, 1, 7, max_span // 3, max_span - 1):
        frac = torch.tensor(exact_fraction(z, max_span), dtype=torch.float32)
        assert (max_span * frac).item() <= z
        assert (max_span * frac).item() == pytest.approx(z, abs=1e-3)


def test_the_streaming_policy_holds_its_window_or_its_budget():
    model, options = tiny_hf("llama"), dict(max_new_tokens=3, do_sample=False)
    per_window = build_policy("streaming:window=12,sinks=3", model)
    by_budget = build_policy(f"streaming:budget={2 * 2 * 14 * 64 + 63},sinks=3", model)
    assert (per_window.window, by_budget.window) == (12, 12)  # 3 sinks + 11 positions fit
    for policy in (per_window, by_budget):
        with policy.applied(IDS.shape[1]) as cache:
            model.generate(IDS, **cache_argument(model, cache), **options)
        assert kv_bytes(cache) == 2 * 2 * (3 + 12 - 1) * 2 * 8 * 4
    assert not span_modules(model)


@pytest.mark.parametrize("spec,message", [
    ("streaming", "takes a window or a budget"),
    ("streaming:window=8,budget=100", "takes a window or a budget"),
    ("streaming:window=0", "window is a whole number of at least 1"),
    ("streaming:window=8,sinks=x", "sinks is a whole number"),
    ("streaming:budget=100", "fewer than 4 sinks"),
])
def test_bad_streaming_options_are_one_line_errors(spec, message):
    with pytest.raises(UserError, match=message):
        build_policy(spec, tiny_hf("llama"))
