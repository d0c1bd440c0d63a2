"""The fused kernel (the path CUDA takes, :mod:`adaspan.attention.fused`) against the naive
reference of the paper's equations, forward and gradients, run on the CPU by Triton's
interpreter."""

from __future__ import annotations

import os
import re

import pytest
import torch

if not torch.cuda.is_available():  # the interpreter is chosen before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import span_attention, span_variants, tiny
from reference import gradients_against_reference, reference_attention, run_blocks

from adaspan.attention import core, fused, use_kernel
from adaspan.runtime.precision import choose

pytestmark = pytest.mark.skipif(not fused.available(), reason="needs Triton (adaspan[cuda])")
SPAN_VARIANTS = span_variants()


def fused_attention(kind: str, **changes):
    """:func:`span_attention` on the fused kernel."""
    attn = span_attention(kind, **changes)
    use_kernel(attn, "fused")
    return attn


@pytest.mark.parametrize("kind", SPAN_VARIANTS)
@pytest.mark.parametrize(("truncation", "block", "cached"),
                         [("head", 11, 5), ("head", 20, 60), ("head", 1, 30), ("layer", 7, 60),
                          ("none", 7, 0)])
def test_fused_path_matches_reference(kind, truncation, block, cached):
    attn = fused_attention(kind, truncation=truncation)
    x, cache = torch.randn(2, block, 16), torch.randn(2, cached, 16)
    assert attn.uses_fused(x)
    y, _ = attn(x, cache)
    with torch.no_grad():
        torch.testing.assert_close(y, reference_attention(attn, x, cache), atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize(("kind", "spans"),
                         [(kind, [8.25, 13.5, 30.7, 44.1]) for kind in SPAN_VARIANTS]
                         + [("adaptive", [20.25, 9.5, 20.5, 9.75])])  # non-consecutive groups
def test_fused_gradients_match_reference(kind, spans):
    attn = fused_attention(kind).double()
    if kind == "adaptive":
        attn.span.set_spans(torch.tensor(spans))
    x, cache = (torch.randn(2, 19, 16, dtype=torch.float64),
                torch.randn(2, 20, 16, dtype=torch.float64))
    grads = gradients_against_reference(attn, x, cache)
    assert all(g.abs().sum() > 0 for n, g in grads[0].items() if n.startswith("span."))


@pytest.mark.parametrize("kind", ["adaptive", "dynamic"])
def test_fused_model_equals_grouped_model_in_training_and_evaluation(kind):
    """Two blocks with the cache carried: log-probabilities and every gradient in training,
    log-probabilities with a key/value cache in evaluation."""
    results = []
    for kernel in ("grouped", "fused"):
        model = tiny(kind)
        use_kernel(model, kernel)
        tokens = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(0))
        log_probs = run_blocks(model, tokens, 12)
        log_probs.sum().backward()
        with torch.no_grad():
            evaluated = run_blocks(model, tokens, 12, keys_values=True)
        results.append((log_probs, evaluated,
                        {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-4)


def test_dropout_draws_the_same_mask_forward_and_backward():
    """With dropout, the gradient is that of the function the forward computed: a directional
    derivative by central differences (the same seed each call) equals it."""
    torch.manual_seed(0)
    H, M, history, dh = 2, 9, 16, 4
    q = torch.randn(1, H, M, dh, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(1, history + M, 2, H, dh, dtype=torch.float64, requires_grad=True)
    pos = torch.randn(history, dh, dtype=torch.float64, requires_grad=True)
    z = torch.tensor([3.5, 9.5], dtype=torch.float64).view(1, H, 1).requires_grad_()
    windows = torch.tensor([12, 16], dtype=torch.int32)
    weights = torch.randn(1, M, H, dh, dtype=torch.float64)
    inputs = (q, kv, pos, z)

    def loss(*tensors):
        torch.manual_seed(1)  # the dropout seed
        out = fused.fused_attention(*tensors, windows, history, 8, dropout=0.5)
        return (out * weights).sum()

    grads = torch.autograd.grad(loss(*inputs), inputs)
    directions = [torch.randn_like(t) for t in inputs]
    eps = 1e-6
    with torch.no_grad():
        up, down = (loss(*(t + s * eps * d for t, d in zip(inputs, directions, strict=True)))
                    for s in (1, -1))
    expected = sum((g * d).sum() for g, d in zip(grads, directions, strict=True))
    torch.testing.assert_close((up - down) / (2 * eps), expected, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        plain = fused.fused_attention(q, kv, pos, z, windows, history, 8)
    assert not torch.allclose((plain * weights).sum(), loss(*inputs))


def test_a_variant_with_its_own_attend_keeps_the_grouped_path():
    attn = span_attention("adaptive")
    attn.kernel = "fused"
    x = torch.randn(1, 4, 16)
    assert attn.uses_fused(x)
    persistent = tiny("persistent")
    use_kernel(persistent, "fused")
    assert not persistent.layers[0].attn.uses_fused(x)
    with pytest.raises(ValueError, match="kernel must be one of"):
        use_kernel(persistent, "flash")


@pytest.mark.parametrize("kind", ["fixed", "adaptive", "dynamic"])
def test_heads_of_bf16_values_match_the_reference_on_the_same_values(kind):
    """The kernel on inputs and parameters rounded to bf16 against the naive reference in
    fp64 of the same values. They are given in fp32: Triton 3.9's interpreter multiplies bf16
    tiles wrongly (``tl.dot`` of two bf16 tiles gives values of 1e10), so the kernel's own bf16
    products are compiled (tests/attention/test_gpu_compile.py), not run, here."""
    attn = fused_attention(kind)
    with torch.no_grad():
        for parameter in attn.parameters():
            parameter.copy_(parameter.bfloat16())
    x, cache = (torch.randn(2, 20, 16).bfloat16().float(),
                torch.randn(2, 40, 16).bfloat16().float())
    y, _ = attn(x, cache)
    with torch.no_grad():
        expected = reference_attention(attn.double(), x.double(), cache.double())
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["fixed", "adaptive", "dynamic"])
def test_fp16_heads_match_the_reference_on_the_same_values(kind):
    """The kernel's 16-bit path (the one bf16 takes: products of 16-bit inputs accumulated
    in fp32, p_d and the weights rounded to 16 bits for them, the output stored in 16 bits)
    run on fp16 tensors, which the interpreter multiplies correctly, against the naive
    reference in fp64 of the same values: within fp16's rounding."""
    attn = fused_attention(kind).half()
    x, cache = torch.randn(2, 20, 16).half(), torch.randn(2, 40, 16).half()
    y, _ = attn(x, cache)
    assert y.dtype == torch.float16
    with torch.no_grad():
        expected = reference_attention(attn.double(), x.double(), cache.double())
    torch.testing.assert_close(y.double(), expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("job", "products"), [("score", "ieee"), ("train", "tf32"),
                                               ("generate", "tf32")])
def test_fp32_products_use_tf32_only_where_the_run_allows_it(job, products):
    """The precision policy on CUDA (no GPU needed to set it): scoring runs fp32 products in
    fp32, the other jobs allow TF32; 16-bit products and the CPU's are never TF32."""
    with choose("float32", torch.device("cuda"), job).applied():
        assert fused.precision(torch.float32, "cuda") == products
        assert fused.precision(torch.bfloat16, "cuda") == "ieee"
        assert fused.precision(torch.float32, "cpu") == "ieee"


class _Refused:
    """A Triton kernel whose launch fails as on a GPU whose blocks have too little shared
    memory for it; ``tries`` counts the launches."""

    tries = 0

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def launch(*args, **meta):
            self.tries += 1
            raise OutOfResources(180_224, 101_376, "shared memory")

        return launch


def test_a_kernel_the_device_cannot_run_leaves_the_layers_on_the_grouped_path(monkeypatch):
    """One warning naming the device and the numbers; every layer's output (training, then
    evaluation with a key/value cache) that of the grouped path; no launch tried again."""
    refused = _Refused()
    monkeypatch.setattr(fused._kernels(), "band_forward", refused)
    monkeypatch.setattr(core, "_refused", set())
    model, grouped = tiny("adaptive"), tiny("adaptive")
    use_kernel(model, "fused")
    use_kernel(grouped, "grouped")
    tokens = torch.randint(0, 32, (2, 24), generator=torch.Generator().manual_seed(0))
    with pytest.warns(RuntimeWarning) as caught:
        log_probs = run_blocks(model, tokens, 12)
        with torch.no_grad():
            evaluated = run_blocks(model, tokens, 12, keys_values=True)
    assert len(caught) == 1
    assert re.search(r"on cpu: out of resource: shared memory, Required: 180224, Hardware "
                     r"limit: 101376", str(caught[0].message))
    assert refused.tries == 1 and not model.layers[0].attn.uses_fused(tokens)
    log_probs.sum().backward()
    expected = run_blocks(grouped, tokens, 12)
    with torch.no_grad():
        torch.testing.assert_close(log_probs, expected)
        torch.testing.assert_close(evaluated, run_blocks(grouped, tokens, 12, keys_values=True))
