"""Attention sinks in the span attention core: the sequence's first keys weigh 1 for every
query they precede, against the float64 reference (band with gradients, decode), with every
key held or only the sinks and the keys the spans see (a cache of the spans)."""

from __future__ import annotations

import pytest
import torch
from reference import reference_span_attention

from adaspan.attention.core import span_attention, span_log_mask
from adaspan.attention.sinks import Sinks
from adaspan.attention.span import key_window

S, R, D = 16, 4.0, 8


def _case(Hq, Hkv, M, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Hq, M, D, generator=g)
    k, v = (torch.randn(2, Hkv, T, D, generator=g) for _ in range(2))
    z = torch.tensor([1.3, 5.7, 9.2, 3.5] * (Hq // 4 or 1))[:Hq].view(Hq, 1)
    return [t.requires_grad_() for t in (q, k, v, z)]


def _sinks(k, v, n, T, M):
    return Sinks(k[:, :, :n], v[:, :, :n], first=T - M)


def _gradients(out, inputs):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.double() * grad.double()).sum().backward()
    return [t.grad for t in inputs]


CASES = [(4, 4, 20, 20), (8, 2, 5, 30), (4, 1, 1, 40), (4, 2, 3, 6), (4, 4, 40, 60)]


@pytest.mark.parametrize("n", [1, 4])
@pytest.mark.parametrize("origin", [0, 1])
@pytest.mark.parametrize("Hq,Hkv,M,T", CASES)
def test_band_with_sinks_agrees_with_the_reference(Hq, Hkv, M, T, origin, n):
    """Output and the gradients of q, k, v and z, every key held (early queries read the
    sinks within their span too: weighed once)."""
    inputs = _case(Hq, Hkv, M, T + origin)
    q, k, v, z = inputs
    out = span_attention(q, k, v, z, max_span=S, ramp=R, origin=origin, backend="band",
                         sinks=_sinks(k, v, n, T + origin, M))
    grads = _gradients(out, inputs)
    ref = [t.detach().clone().requires_grad_() for t in inputs]
    expected = reference_span_attention(*ref, S, R, origin=origin, sinks=n)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, _gradients(expected, ref), strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("origin", [0, 1])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(8, 2, 1, 50), (4, 4, 3, 60), (4, 1, 2, 7)])
def test_sinks_and_the_spans_window_alone_give_every_keys_output(Hq, Hkv, M, T, origin):
    """Band and decode given only the sinks and the last keys of the longest window (what a
    cache of the spans holds) equal the reference over every key; decode too where the sinks
    and those keys are handed joined (as a cache's buffer holds them)."""
    q, k, v, z = (t.detach() for t in _case(Hq, Hkv, M, T))
    host = z.flatten().tolist()
    W = key_window(max(host), S, R)
    held = min(T, W + M - 1 + origin)
    log_mask = span_log_mask(host, W, R, origin=origin)
    expected = reference_span_attention(q, k, v, z, S, R, origin=origin, sinks=3)
    sinks = _sinks(k, v, 3, T, M)
    recent = k[:, :, T - held:], v[:, :, T - held:]
    with torch.no_grad():
        for backend in ("band", "decode"):
            out = span_attention(q, *recent, z, max_span=S, ramp=R, origin=origin,
                                 sinks=sinks, log_mask=log_mask, backend=backend)
            torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5,
                                       msg=backend)
        joined = [torch.cat([held_sinks, keys], dim=2)
                  for held_sinks, keys in zip((sinks.k, sinks.v), recent, strict=True)]
        given = Sinks(sinks.k, sinks.v, sinks.first, joined=tuple(joined))
        out = span_attention(q, *recent, z, max_span=S, ramp=R, origin=origin, sinks=given,
                             log_mask=log_mask, backend="decode")
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
        joined[1] = torch.zeros_like(joined[1])  # read, not joined anew: the output moves
        out = span_attention(q, *recent, z, max_span=S, ramp=R, origin=origin, log_mask=log_mask,
                             sinks=Sinks(sinks.k, sinks.v, sinks.first, joined=tuple(joined)),
                             backend="decode")
        assert out.abs().max() < 1e-6


@pytest.mark.parametrize("origin", [0, 1])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(4, 4, 24, 24), (8, 2, 5, 30), (4, 1, 1, 9)])
def test_decode_with_sinks_agrees_with_the_reference(Hq, Hkv, M, T, origin):
    q, k, v, z = (t.detach() for t in _case(Hq, Hkv, M, T + origin))
    host = z.flatten().tolist()
    log_mask = span_log_mask(host, key_window(max(host), S, R), R, origin=origin)
    with torch.no_grad():
        out = span_attention(q, k, v, z, max_span=S, ramp=R, origin=origin, log_mask=log_mask,
                             sinks=_sinks(k, v, 2, T + origin, M), backend="decode")
    expected = reference_span_attention(q, k, v, z, S, R, origin=origin, sinks=2)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_sinks_change_what_a_short_span_reads():
    """With spans far shorter than the context the sinks' keys move the output; without
    sinks they do not (a check that the test above can fail)."""
    q, k, v, z = (t.detach() for t in _case(4, 4, 1, 40))
    sinks = _sinks(k, v, 2, 40, 1)
    with torch.no_grad():
        plain = span_attention(q, k, v, z, max_span=S, ramp=R)
        with_sinks = span_attention(q, k, v, z, max_span=S, ramp=R, sinks=sinks)
        k2 = k.clone()
        k2[:, :, :2] += 1.0
        moved = span_attention(q, k2, v, z, max_span=S, ramp=R)
    torch.testing.assert_close(plain, moved)
    assert (with_sinks - plain).abs().max() > 1e-3


def test_sinks_refuse_a_table_memory_and_a_key_mask():
    q, k, v, z = (t.detach() for t in _case(4, 4, 2, 10))
    sinks = _sinks(k, v, 2, 10, 2)
    with pytest.raises(ValueError, match="sinks take no table"):
        span_attention(q, k, v, z, max_span=S, ramp=R, pos=torch.zeros(S, D), sinks=sinks)
