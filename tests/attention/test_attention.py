"""Span attention against the naive reference of the paper's equations, and the pieces of its
fast path (skewing, the banded softmax, key windows)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import span_attention, span_variants
from reference import gradients_against_reference, reference_attention

from adaspan import soft_mask
from adaspan.attention import band
from adaspan.attention.band import (
    CHUNKS,
    _BandSoftmax,
    banded_attention,
    chunk_size,
    ramp_columns,
    skew,
)
from adaspan.attention.cache import KeyValueCache
from adaspan.attention.span import AdaptiveSpan, FixedSpan

SPAN_VARIANTS = span_variants()


def test_skew_shifts_each_row():
    x = torch.arange(1, 7, dtype=torch.float32).view(2, 3)
    assert skew(x).tolist() == [[1, 2, 3, 0], [0, 4, 5, 6]]


@pytest.mark.parametrize("kind", SPAN_VARIANTS)
@pytest.mark.parametrize("truncation", ["head", "layer", "none"])
@pytest.mark.parametrize(("block", "cached"), [(11, 0), (11, 5), (7, 60), (1, 30)])
def test_fast_path_matches_reference(kind, truncation, block, cached):
    attn = span_attention(kind, truncation)
    torch.manual_seed(1)
    x, cache = torch.randn(2, block, 16), torch.randn(2, cached, 16)
    y, _ = attn(x, cache)
    with torch.no_grad():
        expected = reference_attention(attn, x, cache)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spans", [[8.0] * 4, [20.0, 9.0, 48.0, 33.0], [48.0] * 4,
                                   [20.0, 9.0, 20.5, 9.5]])  # groups of non-consecutive heads
def test_fast_path_matches_reference_at_several_spans(spans):
    attn = span_attention("adaptive")
    attn.span.set_spans(torch.tensor(spans))
    x, cache = torch.randn(1, 9, 16), torch.randn(1, 50, 16)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cache)[0], reference_attention(attn, x, cache),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("kind", "spans"),
                         [(kind, [8.25, 13.5, 30.7, 44.1]) for kind in SPAN_VARIANTS]
                         + [("adaptive", [20.25, 9.5, 20.5, 9.75])])  # non-consecutive groups
def test_gradients_match_reference(kind, spans):
    """Where the mask is differentiable (z + R not an integer), gradients equal the reference's."""
    attn = span_attention(kind).double()
    if isinstance(attn.span, AdaptiveSpan):
        attn.span.set_spans(torch.tensor(spans))
    x, cache = torch.randn(2, 6, 16, dtype=torch.float64), torch.randn(2, 20, 16,
                                                                       dtype=torch.float64)
    grads = gradients_against_reference(attn, x, cache)
    span_params = [n for n in grads[0] if n.startswith("span.")]
    assert isinstance(attn.span, FixedSpan) == (not span_params)
    for name in span_params:  # z (adaptive) and v, b (dynamic) receive gradient
        assert grads[0][name].abs().sum() > 0, name


@pytest.mark.parametrize("kind", SPAN_VARIANTS)
def test_new_cache_holds_what_the_heads_can_see(kind):
    attn = span_attention(kind, max_span=40)
    x = torch.randn(2, 10, 16)
    _, cache = attn(x, torch.zeros(2, 0, 16))
    windows = attn.key_windows(attn.span(x))
    # a span that depends on the tokens (dynamic) may reach all S for the next ones
    history = 40 if attn.span.input_dependent else max(windows)
    assert cache.shape == (2, history, 16)
    assert torch.equal(cache[:, -10:], x)
    assert all(w % 8 == 0 or w == 40 for w in windows)


@pytest.mark.parametrize("kind", SPAN_VARIANTS)
def test_empty_caches_of_hidden_states_and_of_keys_values(kind):
    attn = span_attention(kind)
    assert attn.empty_cache(2).shape == (2, 0, 16)
    cache = attn.empty_cache(2, keys_values=True)  # inference: projected keys and values
    assert isinstance(cache, KeyValueCache) and cache.keys.shape == (2, 4, 0, 4)


def test_short_spans_read_few_keys():
    attn = span_attention("adaptive", max_span=1024)
    attn.span.set_spans(torch.tensor([8.0, 8.0, 8.0, 100.0]))
    assert attn.key_windows(attn.span(torch.randn(1, 3, 16))) == [8, 8, 8, 104]
    attn.truncation = "layer"
    assert attn.key_windows(attn.span(torch.randn(1, 3, 16))) == [104] * 4


def banded_inputs(heads: int, M: int, w: int, d_head: int) -> list[torch.Tensor]:
    """Random float64 q, k, v, pos for :func:`banded_attention`, requiring gradients."""
    shapes = [(2, heads, M, d_head), (2, heads, w + M, d_head), (2, heads, w + M, d_head),
              (w, d_head)]
    return [torch.randn(shape, dtype=torch.float64, requires_grad=True) for shape in shapes]


@pytest.mark.parametrize("z_shape", [None, (1, 3, 1), (2, 3, 5)])
def test_one_query_path_equals_chunked_path(z_shape):
    """The single-query fast path (generation) gives the last row of the chunked computation."""
    torch.manual_seed(2)
    w, M = 40, 5
    q, k, v, pos = banded_inputs(3, M, w, 8)
    z = None if z_shape is None else (torch.rand(z_shape, dtype=torch.float64) * 30 + 0.5)
    z_last = None if z is None else z[..., -1:]
    inputs = (q, k, v, pos)
    chunked = banded_attention(q, k, v, pos, z, ramp=8)[:, :, -1:]
    one = banded_attention(q[:, :, -1:], k[:, :, M - 1 :], v[:, :, M - 1 :], pos, z_last, ramp=8)
    torch.testing.assert_close(one, chunked)
    weights = torch.randn_like(one)
    grads = [torch.autograd.grad((out * weights).sum(), inputs) for out in (one, chunked)]
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected)


def test_skew_and_its_gradient():
    x = torch.randn(2, 3, 5, 7, dtype=torch.float64, requires_grad=True)
    assert skew(x, fill=-1.0)[0, 0, 4].tolist() == [-1.0] * 4 + x[0, 0, 4].tolist()
    torch.autograd.gradcheck(lambda x: skew(x, 3.0), (x,))


def test_band_softmax_equals_softmax_of_skewed_scores():
    """The fused eqs. 1-2 against their plain composition, values and gradients."""
    c, w, dh = 5, 7, 3
    q = torch.randn(2, 3, c, dh, dtype=torch.float64, requires_grad=True)
    k_t = torch.randn(2, 3, dh, w + c - 1, dtype=torch.float64, requires_grad=True)
    position = torch.randn(2, 3, c, w, dtype=torch.float64, requires_grad=True)
    log_mask = torch.randn(1, 3, c, 2, dtype=torch.float64, requires_grad=True)  # broadcast

    def plain(q, k_t, position, log_mask):
        masked = torch.cat([position[..., :2] + log_mask, position[..., 2:]], dim=-1)
        return torch.softmax(q @ k_t + skew(masked, -math.inf), dim=-1)

    inputs = (q, k_t, position, log_mask)
    torch.testing.assert_close(_BandSoftmax.apply(*inputs), plain(*inputs))
    assert torch.autograd.gradcheck(_BandSoftmax.apply, inputs)
    assert torch.autograd.gradcheck(lambda *t: _BandSoftmax.apply(*t, None), inputs[:3])


@pytest.mark.parametrize("z_shape", [None, (1, 2, 1), (2, 2, 70)])
def test_banded_attention_gradients_over_several_chunks(z_shape):
    """70 queries over 40 keys: two chunks of 64 (the second padded), overlapping windows."""
    torch.manual_seed(3)
    inputs = banded_inputs(2, 70, 40, 4)
    if z_shape is not None:  # spans away from the mask's kinks (z + R not an integer)
        z = (torch.rand(z_shape, dtype=torch.float64) * 25 + 3).floor() + 0.5
        inputs.append(z.requires_grad_())
    assert torch.autograd.gradcheck(
        lambda *t: banded_attention(*t[:4], t[4] if len(t) > 4 else None, ramp=8), inputs)


@pytest.mark.parametrize("w, c, n", [(40, 64, 2), (128, 64, 4), (5, 4, 3), (1, 8, 3), (9, 3, 5)])
def test_windows_gradient_sums_each_position_over_its_windows(w, c, n):
    """The key windows' backward (pieces of ``c`` rows, one operator each) against autograd
    through ``unfold``: each position's gradient summed over the windows that hold it."""
    torch.manual_seed(0)
    length = w + c - 1
    x = torch.randn(2, 3, w + n * c, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 3, n, length, 4, dtype=torch.float64)
    windows = band._Windows.apply(x, length, c, n)
    expected = x.unfold(2, length, c)[:, :, :n].transpose(-1, -2)
    assert torch.equal(windows, expected)
    (fast,) = torch.autograd.grad(windows, x, grad)
    (slow,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)


def test_mask_is_added_only_where_it_is_below_one():
    z = torch.tensor([[5.0], [12.5], [30.0]])
    width = ramp_columns(40, z.min().item())
    distances = torch.arange(40, 0, -1, dtype=torch.float64)  # column j holds distance 40 - j
    mask = soft_mask(distances, z, 8)
    assert (mask[:, width:] == 1).all() and (mask[:, width - 1] < 1).any()
    assert ramp_columns(40, 45.0) == 0



def test_the_public_softmax_formulas_agree_with_the_private_kernels(monkeypatch):
    """Where a torch lacks ATen's private softmax entry points, the band kernel computes the
    softmax and its backward with the public formulas: same values and gradients."""
    torch.manual_seed(0)
    inputs = [torch.randn(2, 3, n, 8, requires_grad=True) for n in (96, 160, 160)]
    pos = torch.randn(64, 8, requires_grad=True)
    z = torch.tensor([10.0, 40.0, 20.0]).view(1, 3, 1).requires_grad_()

    def outputs_and_gradients():
        out = banded_attention(*inputs, pos, z, 8)
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, 8)).sum(), [*inputs, pos, z])
        return out, grads

    private = outputs_and_gradients()
    monkeypatch.setattr(band, "_SOFTMAX_OUT", None)
    monkeypatch.setattr(band, "_SOFTMAX_BACKWARD", None)
    public = outputs_and_gradients()
    torch.testing.assert_close(public, private)


def test_a_block_is_one_chunk_on_cuda_and_chunked_by_the_table_on_the_cpu():
    assert chunk_size(256, 64, "cuda") == 256 and chunk_size(256, 5000, "cuda") == 256
    assert chunk_size(256, 64) == CHUNKS[0][1] < 256 and chunk_size(16, 64) == 16


@pytest.mark.parametrize("kind", ["adaptive", "dynamic"])
def test_one_span_per_layer_matches_reference_in_one_head_group(kind):
    """span_per="layer": the heads share z (or z_t), read the same keys as one group, and the
    output and every gradient (the shared span's included) equal the reference's."""
    attn = span_attention(kind, span_per="layer").double()
    x, cache = (torch.randn(2, 6, 16, dtype=torch.float64),
                torch.randn(2, 40, 16, dtype=torch.float64))
    windows = attn.key_windows(attn.span(x))
    assert len(attn._layout(tuple(windows), x.device).groups) == 1
    grads = gradients_against_reference(attn, x, cache)
    assert all(grads[0][n].abs().sum() > 0 for n in grads[0] if n.startswith("span."))


@pytest.mark.parametrize("kind", ["adaptive", "dynamic", "fixed"])
def test_grouped_query_heads_are_the_layer_with_shared_key_value_heads(kind):
    """kv_heads=2 of 4: the paper's layer (keys before the query, the table of p_d) whose
    heads 2h and 2h + 1 read one key/value head: equal to the layer of 4 key/value heads
    whose W_k, W_v rows repeat them, with hidden states and with a key/value cache."""
    grouped = span_attention(kind, kv_heads=2)
    full = span_attention(kind)
    with torch.no_grad():
        for name in ("k", "v"):
            rows = getattr(grouped, name).weight.unflatten(0, (2, -1))  # (2, d_head, D)
            getattr(full, name).weight.copy_(rows.repeat_interleave(2, dim=0).flatten(0, 1))
    full.load_state_dict({**full.state_dict(), **{n: p for n, p in grouped.state_dict().items()
                                                  if n.split(".")[0] not in ("k", "v")}})
    x, past = torch.randn(2, 10, 16), torch.randn(2, 30, 16)
    torch.testing.assert_close(grouped(x, past)[0], full(x, past)[0])
    with torch.no_grad():
        caches = [KeyValueCache.empty(torch.zeros(2, attn.kv_heads, 0, 4))
                  for attn in (grouped, full)]
        for block in (x[:, :6], x[:, 6:]):
            (a, caches[0]), (b, caches[1]) = (attn(block, cache) for attn, cache in
                                              zip((grouped, full), caches, strict=True))
            torch.testing.assert_close(a, b)
