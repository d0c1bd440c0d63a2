"""The CUDA path, run where there is a GPU (skipped elsewhere; ``scripts/gpu_check.sh`` runs it):
every variant on CUDA equals the CPU in fp32 and stays close in bf16, the band kernel equals
its naive reference there, steady evaluation blocks make no host-device synchronisation
(``torch.cuda.set_sync_debug_mode("error")``) and a training step at most one (the spans),
and the memory estimate holds against ``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import span_attention, tiny
from reference import reference_attention

from adaspan.cache import StreamCache
from adaspan.config import ModelConfig, TrainConfig
from adaspan.memory import estimate_training_memory
from adaspan.model import SpanLM
from adaspan.optim import build_optimizer, build_scheduler
from adaspan.registry import ATTENTIONS
from adaspan.train import train_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
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


def test_a_steady_training_step_waits_at_most_once():
    model = tiny("adaptive").train().to(CUDA)
    config = TrainConfig(batch_size=2, optimizer="adamw", lr=1e-6, warmup=0, clip=1.0,
                         clip_mode="per-tensor-lr", dtype="float32")
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    cache = StreamCache(model.empty_cache(2))
    x = torch.randint(0, 32, (2, 16), device=CUDA)
    for _ in range(2):
        _, cache = train_step(model, optimizer, scheduler, x, x, cache, config)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, cache = train_step(model, optimizer, scheduler, x, x, cache, config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ours = [w for w in caught if "synchroniz" in str(w.message)
            and "torch/optim" not in (w.filename or "")]
    assert len(ours) <= 1, [str(w.message) for w in ours]


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
