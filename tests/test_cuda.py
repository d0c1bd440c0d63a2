"""The CUDA path, run where there is a GPU (skipped elsewhere; ``scripts/gpu/gpu_check.sh``
runs it):
every variant on CUDA equals the CPU in fp32 and stays close in bf16, the band kernel equals
its naive reference there, steady evaluation blocks make no host-device synchronisation
(``torch.cuda.set_sync_debug_mode("error")``) and a training step at most one (the spans),
generation's static step replayed from a CUDA graph equals the same step run eagerly and waits
for nothing, the memory estimate holds against ``torch.cuda.max_memory_allocated``, and
adaptive input and softmax equal the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import span_attention, span_variants, tiny
from reference import reference_attention

from adaspan.attention.cache import StreamCache
from adaspan.attention.registry import ATTENTIONS
from adaspan.config import ModelConfig, TrainConfig
from adaspan.model.decode import GraphStep, StaticDecoder, decoder
from adaspan.model.lm import SpanLM
from adaspan.training.memory import estimate_training_memory
from adaspan.training.optim import build_optimizer, build_scheduler
from adaspan.training.train import train_step

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              # the fused kernel must run here, not leave its layers on the grouped path
              pytest.mark.filterwarnings("error:the fused attention kernel cannot run")]
CUDA = torch.device("cuda")


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_every_variant_on_cuda_equals_the_cpu(attention):
    model = tiny(attention)
    tokens = torch.randint(0, 32, (2, 24))
    expected, _ = model(tokens)
    model.to(CUDA)
    got, _ = model(tokens.to(CUDA))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    if torch.cuda.is_bf16_supported():
        with torch.autocast("cuda", torch.bfloat16):
            low, _ = model(tokens.to(CUDA))
        assert (low.float().cpu() - expected).abs().max() < 0.1


@pytest.mark.parametrize("kind", ["fixed", "adaptive", "dynamic"])
def test_span_attention_on_cuda_equals_its_reference(kind):
    attn = span_attention(kind)
    x, cache = torch.randn(2, 16, 16), torch.randn(2, 48, 16)
    expected = reference_attention(attn, x, cache)  # on the CPU, one query at a time
    out, _ = attn.to(CUDA)(x.to(CUDA), cache.to(CUDA))
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("origin", [0, 1])
@pytest.mark.parametrize("with_pos", [True, False])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(4, 2, 16, 48), (4, 4, 9, 9), (8, 1, 5, 40)])
def test_the_cores_fused_backend_on_cuda_equals_the_reference(Hq, Hkv, M, T, with_pos, origin):
    """The span attention core's fused backend on the GPU (grouped-query heads, both origins,
    with and without a table, a short history with absent keys): output and gradients against
    the float64 reference, and the kernel launched (not the band backend)."""
    from reference import reference_span_attention

    from adaspan.attention import fused
    from adaspan.attention.core import span_attention as core_attention

    g = torch.Generator().manual_seed(0)
    T += origin
    q = torch.randn(2, Hq, M, 16, generator=g)
    k, v = (torch.randn(2, Hkv, T, 16, generator=g) for _ in range(2))
    pos = torch.randn(32, 16, generator=g) if with_pos else None
    z = torch.tensor([2.5, 29.5, 9.3, 16.7] * 2)[:Hq].view(1, Hq, 1)  # off the kinks
    inputs = [t for t in (q, k, v, z, pos) if t is not None]
    on_gpu = [t.to(CUDA).requires_grad_() for t in inputs]
    launches = []
    with fused.observe_launches(lambda name: launches.append(name) or True):
        out = core_attention(*on_gpu[:4], max_span=32, ramp=4.0, origin=origin,
                             pos=on_gpu[4] if with_pos else None, backend="fused")
    assert launches
    expected_inputs = [t.double().requires_grad_() for t in inputs]
    expected = reference_span_attention(*expected_inputs[:4], 32, 4.0, origin=origin,
                                        pos=expected_inputs[4] if with_pos else None)
    torch.testing.assert_close(out.double().cpu(), expected, atol=2e-3, rtol=2e-3)
    grad = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad((out * grad.to(CUDA)).sum(), on_gpu)
    want = torch.autograd.grad((expected * grad.double()).sum(), expected_inputs)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.double().cpu(), b, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_hugging_face_model_with_spans_on_cuda_equals_the_cpu(kind):
    """The adaptive_span attention on CUDA (the core's fused backend for the prompt, its
    decode backend per generated token) gives the CPU's logits and greedy tokens."""
    pytest.importorskip("transformers")
    from helpers import tiny_hf

    from adaspan.hf import SpanCache, add_spans, span_modules

    model = add_spans(tiny_hf(kind), max_span=64, ramp=4)
    for span, row in zip(span_modules(model), [[5, 9, 17, 12], [6, 6, 8, 20]], strict=True):
        span.set_spans(torch.tensor(row, dtype=torch.float32))
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(3))

    def greedy(model, ids):
        out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             past_key_values=SpanCache(model), return_dict_in_generate=True,
                             output_logits=True)
        return out.sequences.cpu(), torch.stack(out.logits).cpu()

    logits, (tokens, steps) = model(ids).logits, greedy(model, ids)
    model.to(CUDA)
    torch.testing.assert_close(model(ids.to(CUDA)).logits.cpu(), logits, atol=2e-3, rtol=2e-3)
    gpu_tokens, gpu_steps = greedy(model, ids.to(CUDA))
    assert torch.equal(gpu_tokens, tokens)
    torch.testing.assert_close(gpu_steps, steps, atol=2e-3, rtol=2e-3)


def test_steady_evaluation_blocks_never_wait_for_the_gpu():
    model = tiny("adaptive").to(CUDA)
    blocks = torch.randint(0, 32, (4, 2, 16), device=CUDA)
    with torch.no_grad():
        cache = model.empty_cache(2, keys_values=True)
        _, cache = model(blocks[0], cache)  # reads the spans, builds the head groups
        torch.cuda.set_sync_debug_mode("error")
        try:
            for block in blocks[1:]:
                _, cache = model(block, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", span_variants())
def test_generation_replays_the_static_step_from_a_cuda_graph(name, dtype):
    """``decoder`` on CUDA captures the static step once (after one eager warm-up token) and
    replays it per token: the same log-probabilities as the step run eagerly and close to the
    host-position decoder's (bf16: autocast's fp32 layer norms kept out of the steps), the
    ring wrapping (W <= S = 64), and no host-device synchronisation but the token's write."""
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("no bf16 on this GPU")
    model = tiny(name, vocab_size=256).to(CUDA)
    tokens = torch.randint(0, 256, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cuda", dtype, enabled=dtype == torch.bfloat16):
        _, cache = model(tokens[:, :10].to(CUDA), model.empty_cache(1, keys_values=True))
        graphed, eager = decoder(model, cache, 10), StaticDecoder(model, cache, 10)
        host = decoder(model, cache, 10, static=False)
        assert isinstance(graphed, GraphStep)
        replayed, expected, hosted = [], [], []
        for i, token in enumerate(tokens[0, 10:].tolist()):
            torch.cuda.set_sync_debug_mode("error" if i > 0 else "default")
            try:
                replayed.append(graphed(token).clone())
            finally:
                torch.cuda.set_sync_debug_mode("default")
            expected.append(eager(token).clone())
            hosted.append(host(token).clone())
    assert graphed.graph is not None  # captured, not fallen back to eager
    assert replayed[0].dtype == torch.float32
    fp32 = dtype == torch.float32  # bf16: the products' order may differ
    torch.testing.assert_close(torch.stack(replayed), torch.stack(expected),
                               atol=1e-5 if fp32 else 5e-2, rtol=0)
    torch.testing.assert_close(torch.stack(hosted), torch.stack(expected),
                               atol=1e-4 if fp32 else 0.1, rtol=0)


@pytest.mark.parametrize("optimizer", ["adamw", "adagrad"])  # Adagrad's fused kernel: CPU only
def test_a_steady_training_step_waits_at_most_once(optimizer):
    model = tiny("adaptive").train().to(CUDA)
    config = TrainConfig(batch_size=2, optimizer=optimizer, lr=1e-6, warmup=0, clip=1.0,
                         clip_mode="per-tensor-lr", dtype="float32")
    x = torch.randint(0, 32, (2, 16), device=CUDA)
    waits = steady_step_waits(model, config, x, x)
    assert len(waits) <= 1, waits


def steady_step_waits(model: SpanLM, config: TrainConfig, x: torch.Tensor,
                      y: torch.Tensor) -> list[str]:
    """The synchronisations CUDA reports in a third training step of ``model`` on ``x``, ``y``
    (``torch.cuda.set_sync_debug_mode("warn")``), torch.optim's own left out."""
    optimizer = build_optimizer(model.train(), config)
    scheduler = build_scheduler(optimizer, config)
    cache = StreamCache(model.empty_cache(x.shape[0]))
    for _ in range(2):
        _, cache = train_step(model, optimizer, scheduler, x, y, cache, config)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_step(model, optimizer, scheduler, x, y, cache, config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)
            and "torch/optim" not in (w.filename or "")]


def test_the_memory_estimate_holds_on_cuda():
    config = ModelConfig(d_model=128, n_heads=4, n_layers=3, d_inner=512, max_span=512,
                         ramp=32, dropout=0.0)
    model = SpanLM(config).to(CUDA)
    model.set_spans([64, 128, 256, 512])
    estimate = estimate_training_memory(model, "adagrad", 4, 128)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=1e-9)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    tokens = torch.randint(0, 256, (4, 129), device=CUDA)
    log_probs, _ = model(tokens[:, :-1])
    (-log_probs.gather(-1, tokens[:, 1:, None]).mean() + model.span_loss()).backward()
    optimizer.step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before + estimate.weights
    assert 0.75 * measured <= estimate.total <= 1.25 * measured, (estimate, measured)


@pytest.mark.parametrize("tie_io", [True, False])
def test_adaptive_input_and_softmax_on_cuda(tie_io):
    """Adaptive input and softmax on CUDA equal the CPU (the targets' log-probabilities and the
    full distribution), and a steady training step waits once more than the spans' read: the
    clusters' target counts."""
    model = tiny("fixed", vocab_size=64, adaptive_io=True, cutoffs="8,24", div_val=2,
                 tie_io=tie_io)
    tokens = torch.randint(0, 64, (2, 25))
    x, y = tokens[:, :-1], tokens[:, 1:]
    expected, _ = model(x, targets=y)
    full, _ = model(x)
    model.to(CUDA)
    got, _ = model(x.to(CUDA), targets=y.to(CUDA))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model(x.to(CUDA))[0].cpu(), full, atol=1e-4, rtol=1e-4)
    config = TrainConfig(batch_size=2, optimizer="adamw", lr=1e-6, warmup=0, clip=1.0,
                         dtype="float32")
    waits = steady_step_waits(model, config, x.to(CUDA), y.to(CUDA))
    assert len(waits) <= 2, waits  # the spans' read and the clusters' counts
