"""DuoAttention's method: the gated mixture of full and streaming attention (alpha = 1 the
model's own, alpha = 0 its streaming heads), the gates' gradient and penalty, binarising at a
budget in bytes, and the cache policy holding what it says."""

import pytest

pytest.importorskip("transformers", reason="adaspan.hf needs transformers (adaspan[hf])")

import torch
from helpers import tiny_hf

from adaspan.errors import UserError
from adaspan.hf import cache_argument, kv_bytes
from adaspan.hf.cache_policies import build_policy
from adaspan.hf.duo import add_gates, binarise, clamp_gates, gate_loss, gates, save_gates
from adaspan.hf.streaming import hard_windows, streaming_windows

IDS = torch.randint(0, 64, (2, 50), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_alpha_one_is_the_model_and_zero_its_streaming_heads(kind):
    model = tiny_hf(kind)
    with torch.no_grad():
        own = model(IDS).logits
        with hard_windows(model, streaming_windows(model, 6), sinks=2):
            streaming = model(IDS).logits
        for gate in add_gates(model, window=6, sinks=2):
            assert gate.alpha.tolist() == [1.0] * gate.alpha.numel()
        torch.testing.assert_close(model(IDS).logits, own, atol=1e-5, rtol=1e-5)
        for gate in gates(model):
            gate.alpha.zero_()
        torch.testing.assert_close(model(IDS).logits, streaming, atol=1e-5, rtol=1e-5)


def test_the_gates_learn_and_are_penalised_and_clamped():
    model = tiny_hf("qwen2").requires_grad_(False)
    found = add_gates(model, window=5, sinks=1)
    with torch.no_grad():
        for gate in found:
            gate.alpha.fill_(0.5)
    (model(IDS).logits.square().mean() + gate_loss(model, 0.1)).backward()
    assert all(g.alpha.grad is not None and g.alpha.grad.abs().sum() > 0 for g in found)
    assert gate_loss(model, 0.1).item() == pytest.approx(0.1 * 0.5 * 4 / 2)
    with torch.no_grad():
        found[0].alpha.fill_(3.0)
    clamp_gates(model)
    assert found[0].alpha.tolist() == [1.0, 1.0]


def test_binarising_keeps_the_greatest_gates_within_the_budget():
    alpha = [[0.9, 0.1], [0.5, 0.7]]
    # per position 10 bytes; context 100: a streaming head holds 2 + 7 positions, a full 2 + 100
    stream, full = 90, 1020
    windows = binarise(alpha, 4 * stream + 2 * (full - stream), 100, 8, 2, 10, 128)
    assert windows == [[128, 8], [8, 128]]
    assert binarise(alpha, 4 * stream, 100, 8, 2, 10, 128) == [[8, 8], [8, 8]]
    with pytest.raises(UserError, match="fewer than every head's sinks"):
        binarise(alpha, 4 * stream - 1, 100, 8, 2, 10, 128)


def test_the_duo_policy_holds_its_budget(tmp_path):
    trained = tiny_hf("llama")
    add_gates(trained, window=8, sinks=2)
    with torch.no_grad():
        for gate, row in zip(gates(trained), [[0.9, 0.2], [0.3, 0.8]], strict=True):
            gate.alpha.copy_(torch.tensor(row))
    save_gates(trained, tmp_path)
    model = tiny_hf("llama")  # 2 layers of 2 key/value heads, 8 x 4 bytes per key
    per_position, context = 2 * 8 * 4, IDS.shape[1]
    # at 50 positions a streaming head holds 2 + 7, a full one 2 + 50: room for two full ones
    budget = (4 * (2 + 7) + 2 * (52 - 9) + 42) * per_position
    policy = build_policy(f"duo:gates={tmp_path},budget={budget}", model)
    with policy.applied(context) as cache:
        model.generate(IDS[:1], max_new_tokens=1, do_sample=False,
                       **cache_argument(model, cache))
    assert kv_bytes(cache) == (2 * (2 + 50) + 2 * (2 + 7)) * per_position <= budget
    assert not hasattr(model.config, "adaptive_span")
