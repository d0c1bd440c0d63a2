"""Rotary and grouped-query span attention (position_table="rotary", kv_heads) against the
naive reference, and the rotation itself."""

from __future__ import annotations

import math

import pytest
import torch
from reference import reference_span_attention, reference_z

from adaspan import ModelConfig
from adaspan.attention.registry import ATTENTIONS
from adaspan.attention.rotary import rotate


def test_rotate_turns_each_pair_by_its_angle():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    got = rotate(x, 7)
    for t in range(5):
        for i in range(4):  # the pair (i, i + d/2) as a complex number, times e^{i angle}
            angle = (7 + t) * 10000 ** (-2 * i / 8)
            pair = torch.complex(x[..., t, i], x[..., t, i + 4]) * complex(math.cos(angle),
                                                                          math.sin(angle))
            torch.testing.assert_close(got[..., t, i], pair.real)
            torch.testing.assert_close(got[..., t, i + 4], pair.imag)


def test_rotated_scores_depend_on_the_distance_alone():
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    scores = [(rotate(q, a) * rotate(k, b)).sum().item() for a, b in ((9, 4), (105, 100))]
    assert scores[0] == pytest.approx(scores[1], rel=1e-4)
    assert scores[0] != pytest.approx((q * k).sum().item(), rel=1e-3)


def _layer(kind: str, kv_heads: int, max_span: int = 24):
    config = ModelConfig(d_model=32, n_heads=4, n_layers=1, d_inner=32, max_span=max_span,
                         ramp=4, dropout=0.0, attention=kind, span_bucket=1,
                         position_table="rotary", kv_heads=kv_heads)
    torch.manual_seed(0)
    attn = ATTENTIONS[kind](config)
    if kind == "adaptive":
        attn.span.set_spans(torch.tensor([5.5, 13.25, 23.5, 9.3]))  # off the kinks
    elif kind == "dynamic":
        with torch.no_grad():
            attn.span.v.normal_(0, 0.3)
            attn.span.b.uniform_(-2, 1)
    return attn


def _reference(attn, x, cache):
    """The layer from its equations: zero states before the history, every state's key and
    value projected, q and k rotated at their positions, then eqs. 1-3 by the reference."""
    B, M, D = x.shape
    states = torch.cat([torch.zeros(B, attn.max_span, D), cache, x], dim=1)
    T = states.shape[1]
    heads = lambda t: t.unflatten(-1, (-1, attn.d_head)).transpose(1, 2)  # noqa: E731
    q, k, v = heads(attn.q(x)), heads(attn.k(states)), heads(attn.v(states))
    q, k = rotate(q, T - M), rotate(k, 0)
    out = reference_span_attention(q, k, v, reference_z(attn, x), attn.max_span, attn.ramp)
    return attn.o(out.float().transpose(1, 2).reshape(B, M, D))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("kind", ["fixed", "adaptive", "dynamic"])
def test_layer_agrees_with_the_reference(kind, kv_heads):
    attn = _layer(kind, kv_heads)
    assert attn.k.weight.shape == (kv_heads * attn.d_head, 32)
    x, cache = torch.randn(2, 10, 32), torch.randn(2, 7, 32)
    out, _ = attn(x, cache)
    grad = torch.randn(out.shape)
    got = torch.autograd.grad((out * grad).sum(), list(attn.parameters()))
    expected = _reference(attn, x, cache)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad((expected * grad).sum(), list(attn.parameters()))
    for name, a, b in zip([n for n, _ in attn.named_parameters()], got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_flops_count_the_key_value_heads():
    grouped, full = _layer("fixed", 1), _layer("fixed", 4)
    d, d_kv, keys = 32, 8, 4 * 24  # keys per query, summed over the heads
    assert full.flops_per_char(16) == 4 * d * d + 2 * 8 * keys
    assert grouped.flops_per_char(16) == 2 * d * d + 2 * d * d_kv + 2 * 8 * keys
