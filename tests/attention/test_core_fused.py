"""The span attention core's fused backend (CUDA's path: grouped-query heads, optional table,
keys of a cache, absent keys before a sequence, both origins) against the naive reference, run
on the CPU by Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter is chosen before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from reference import reference_span_attention

from adaspan import ModelConfig
from adaspan.attention import fused, use_kernel
from adaspan.attention.core import span_attention
from adaspan.attention.registry import ATTENTIONS

pytestmark = pytest.mark.skipif(not fused.available(), reason="needs Triton (adaspan[cuda])")
S, R, D = 16, 4.0, 8


@pytest.mark.parametrize("with_pos", [True, False])
@pytest.mark.parametrize("z_kind", [None, "head", "dynamic"])
@pytest.mark.parametrize("Hq,Hkv,M,T,origin", [(4, 2, 5, 20, 0), (4, 1, 12, 12, 0),
                                               (2, 2, 1, 9, 0), (4, 2, 5, 20, 1),
                                               (4, 4, 7, 9, 1)])
def test_fused_kernel_agrees_with_the_reference(Hq, Hkv, M, T, origin, z_kind, with_pos):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, Hq, M, D, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, Hkv, T, D, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    pos = torch.randn(S, D, generator=g, dtype=torch.float64) if with_pos else None
    z = {None: None, "head": torch.tensor([1.3, 9.7, 13.2, 5.5][:Hq]).view(1, Hq, 1),
         "dynamic": torch.rand(2, Hq, M, generator=g) * (S - 1) + 0.25}[z_kind]
    if z is not None:
        z = z.double().requires_grad_()
    inputs = [t for t in (q, k, v, z) if t is not None]
    launches = []
    with fused.observe_launches(lambda name: launches.append(name) or True):
        out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos, origin=origin,
                             backend="fused")
    assert launches  # the kernel ran, not the band backend
    expected = reference_span_attention(q, k, v, z, S, R, pos=pos, origin=origin)
    torch.testing.assert_close(out, expected, atol=1e-9, rtol=1e-9)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * grad).sum(), inputs)
    want = torch.autograd.grad((expected * grad).sum(), inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kind", ["adaptive", "dynamic"])
def test_rotary_grouped_query_layer_on_the_fused_kernel(kind):
    """SpanAttention with rotary positions and 2 key/value heads: the fused kernel gives the
    grouped path's output and gradients, and takes it (``uses_fused``)."""
    config = ModelConfig(d_model=16, n_heads=4, n_layers=1, d_inner=32, max_span=S, ramp=4,
                         dropout=0.0, attention=kind, span_bucket=1, position_table="rotary",
                         kv_heads=2, span_init=0.4)
    torch.manual_seed(0)
    attn = ATTENTIONS[kind](config).double()
    x, cache = (torch.randn(2, M, 16, dtype=torch.float64) for M in (6, 9))
    results = []
    for kernel in ("fused", "grouped"):
        use_kernel(attn, kernel)
        assert attn.uses_fused(x) == (kernel == "fused")
        out, _ = attn(x, cache)
        results.append((out, torch.autograd.grad(out.sum(), list(attn.parameters()))))
    (fused_out, fused_grads), (grouped_out, grouped_grads) = results
    torch.testing.assert_close(fused_out, grouped_out, atol=1e-9, rtol=1e-9)
    for a, b in zip(fused_grads, grouped_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-9)
