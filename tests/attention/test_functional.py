"""span_attention (any q, k, v) against the naive reference of tests/reference.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import reference_span_attention

from adaspan.attention import functional
from adaspan.attention.functional import (
    decode_attention,
    grouped_span_attention,
    head_groups,
    key_window,
    span_attention,
    span_log_mask,
)

S, R, D = 16, 4.0, 8


def _inputs(B, Hq, Hkv, M, T, z_kind, with_pos, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, M, D, generator=g)
    k, v = (torch.randn(B, Hkv, T, D, generator=g) for _ in range(2))
    pos = torch.randn(S, D, generator=g) if with_pos else None
    if z_kind == "head":  # windows 6, 10, 16 (capped at S), 12: some under T, some over
        z = torch.tensor([1.3, 5.7, 13.2, 7.5] * (Hq // 4 or 1))[:Hq].view(Hq, 1)
    elif z_kind == "dynamic":
        z = torch.rand(B, Hq, M, generator=g) * (S - 1) + 0.25
    else:
        z = None
    tensors = [t.to(dtype) for t in (q, k, v)] + [z, pos]
    return [None if t is None else t.clone().requires_grad_() for t in tensors]


def _gradients(out, inputs, seed=1):
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out.double() * grad.double()).sum().backward()
    return [None if t is None else t.grad for t in inputs]


SHAPES = [(4, 4, 12, 12), (4, 1, 12, 12), (8, 2, 5, 20), (4, 4, 1, 30), (8, 2, 1, 9),
          (4, 1, 40, 40), (8, 4, 7, 50)]


@pytest.mark.parametrize("with_pos", [True, False])
@pytest.mark.parametrize("z_kind", [None, "head", "dynamic"])
@pytest.mark.parametrize("Hq,Hkv,M,T", SHAPES)
def test_agrees_with_the_reference_in_float32(Hq, Hkv, M, T, z_kind, with_pos):
    inputs = _inputs(2, Hq, Hkv, M, T, z_kind, with_pos)
    q, k, v, z, pos = inputs
    out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos)
    assert out.shape == q.shape and out.dtype == q.dtype
    grads = _gradients(out, inputs)
    ref_inputs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    expected = reference_span_attention(*ref_inputs[:4], S, R, pos=ref_inputs[4])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, _gradients(expected, ref_inputs), strict=True):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("z_kind", [None, "head", "dynamic"])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(8, 2, 5, 20), (4, 4, 24, 24), (4, 1, 1, 30)])
def test_agrees_with_the_reference_in_bfloat16(Hq, Hkv, M, T, z_kind):
    inputs = _inputs(2, Hq, Hkv, M, T, z_kind, True, dtype=torch.bfloat16)
    q, k, v, z, pos = inputs
    out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos)
    assert out.dtype == torch.bfloat16
    grads = _gradients(out, inputs)
    ref_inputs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    expected = reference_span_attention(*ref_inputs[:4], S, R, pos=ref_inputs[4])
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)
    for got, want in zip(grads, _gradients(expected, ref_inputs), strict=True):
        if got is not None:
            torch.testing.assert_close(got.double(), want.double(), atol=6e-2, rtol=6e-2)


def test_spans_longer_than_the_keys_and_a_scale():
    q, k, v, _, _ = _inputs(1, 4, 2, 6, 10, None, False)
    z = torch.tensor([30.0, 2.5, 40.0, 0.0]).view(1, 4, 1)
    pos = torch.randn(64, D)
    for table in (None, pos):
        out = span_attention(q, k, v, z, max_span=64, ramp=R, pos=table, scale=0.2)
        expected = reference_span_attention(q, k, v, z, 64, R, pos=table, scale=0.2)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def _band_calls(monkeypatch) -> list[tuple]:
    calls = []
    band = functional.banded_attention

    def recording(q, k, v, pos, z, *args, **kwargs):
        calls.append((q.shape[1], k.shape[2], kwargs["window"], kwargs["start"]))
        return band(q, k, v, pos, z, *args, **kwargs)

    monkeypatch.setattr(functional, "banded_attention", recording)
    return calls


def test_each_head_reads_only_the_keys_its_span_sees(monkeypatch):
    calls = _band_calls(monkeypatch)
    q, k, v, _, _ = _inputs(1, 8, 2, 4, 100, None, False)
    spans = [1.3, 5.7, 13.2, 7.5, 1.3, 1.3, 5.7, 0.0]
    span_attention(q, k, v, torch.tensor(spans).view(8, 1), max_span=S, ramp=R)
    # heads by window ceil(z + R) (capped at S): 6 x3, 10 x2, 16, 12, 4; keys w + M - 1
    assert sorted(calls) == sorted([(3, 6 + 3, 6, 0), (2, 10 + 3, 10, 0), (1, 16 + 3, 16, 0),
                                    (1, 12 + 3, 12, 0), (1, 4 + 3, 4, 0)])
    assert all(key_window(z, S, R) == w for z, w in zip(spans, [6, 10, 16, 12, 6, 6, 10, 4],
                                                        strict=True))
    calls.clear()
    span_attention(q, k, v, None, max_span=S, ramp=R)  # no mask: S keys per query, not T
    assert calls == [(8, S + 3, S, 0)]


def test_a_short_history_reads_padding_as_absent(monkeypatch):
    calls = _band_calls(monkeypatch)
    q, k, v, z, _ = _inputs(1, 4, 4, 10, 12, "head", False)
    span_attention(q, k, v, z, max_span=S, ramp=R)
    # windows 6, 10, 12, 12 (capped at T): query 0 at position 2 reads from 2 - w + 1 < 0,
    # the keys before position 0 absent (``start``); w + M - 1 keys each
    assert sorted(calls) == [(1, 15, 6, 3), (1, 19, 10, 7), (2, 21, 12, 9)]


def test_key_window_rounds_up_to_the_bucket():
    assert key_window(5.2, 64, 4) == 10
    assert key_window(5.2, 64, 4, bucket=8) == 16
    assert key_window(100.0, 64, 4, bucket=8) == 64


@pytest.mark.parametrize("shapes,message", [
    (((1, 4, 3, 8), (1, 3, 5, 8), None), "multiple"),
    (((1, 4, 6, 8), (1, 4, 5, 8), None), "T >= M"),
    (((1, 4, 3, 8), (1, 4, 5, 8), (15, 8)), "pos must be"),
])
def test_shapes_are_checked(shapes, message):
    q, k, pos = (None if s is None else torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        span_attention(q, k, k, None, max_span=S, ramp=R, pos=pos)
    with pytest.raises(ValueError, match="broadcastable"):
        span_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 5, 8), torch.randn(1, 4, 5, 8),
                       torch.ones(3, 4, 1), max_span=S, ramp=R)


def test_the_speed_script_prints_both_paths():
    """``scripts/bench/functional_speed.py`` at a tiny size: its JSON line has both paths' times."""
    script = Path(__file__).parents[2] / "scripts" / "bench" / "functional_speed.py"
    done = subprocess.run([sys.executable, str(script), "--tokens", "64", "--max-span", "48",
                           "--spans", "34,40", "--runs", "1", "--d-head", "8"],
                          capture_output=True, text=True, check=True, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("prefill", "decode"):
        assert result[name]["span_attention_ms"] > 0 and result[name]["dense_ms"] > 0
        assert result[name]["max_abs_difference"] < 1e-4  # the same attention


def test_grouped_attention_with_host_spans_equals_span_attention():
    """``head_groups`` from z on the host (no read of the device), bucketed windows: the same
    output as :func:`span_attention`, which reads z's bounds itself."""
    q, k, v, z, pos = _inputs(2, 8, 2, 6, 40, "head", True)
    host = z.detach().flatten().tolist()
    groups = head_groups(host, host, S, R, 40, bucket=8)
    assert {w for w, _, _ in groups} == {8, 16}
    out = grouped_span_attention(q, k, v, z.view(1, 8, 1), groups, R, pos, kernel=False)
    torch.testing.assert_close(out, span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos))


def _decode_case(Hq, Hkv, M, T, with_pos, dtype):
    """Inputs of :func:`decode_attention` with the spans of ``_inputs``' "head" (windows 6, 10,
    16, 12), and those spans."""
    q, k, v, z, pos = (None if t is None else t.detach() for t in
                       _inputs(2, Hq, Hkv, M, T, "head", with_pos, dtype=dtype))
    host = z.flatten().tolist()
    return (q, k, v, span_log_mask(host, key_window(max(host), S, R), R), pos), z


@pytest.mark.parametrize("with_pos", [True, False])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(4, 4, 1, 30), (8, 2, 1, 9), (4, 1, 1, 40), (4, 4, 1, 1),
                                        (8, 2, 3, 25), (4, 1, 5, 7), (4, 4, 16, 16)])
def test_decoding_all_heads_at_once_agrees_with_the_reference(Hq, Hkv, M, T, with_pos):
    """MHA, GQA and MQA; one query and a few, keys fewer or more than the longest window."""
    (q, k, v, log_mask, pos), z = _decode_case(Hq, Hkv, M, T, with_pos, torch.float32)
    assert log_mask.shape == (Hq, 16)
    for scale in (None, 0.2):
        out = decode_attention(q, k, v, log_mask, pos=pos, scale=scale)
        assert out.shape == q.shape and out.dtype == q.dtype
        expected = reference_span_attention(q, k, v, z, S, R, pos=pos, scale=scale)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_pos", [True, False])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(8, 2, 1, 30), (4, 1, 3, 12)])
def test_decoding_all_heads_at_once_in_bfloat16(Hq, Hkv, M, T, with_pos):
    (q, k, v, log_mask, pos), z = _decode_case(Hq, Hkv, M, T, with_pos, torch.bfloat16)
    out = decode_attention(q, k, v, log_mask, pos=pos)
    assert out.dtype == torch.bfloat16
    expected = reference_span_attention(q, k, v, z, S, R, pos=pos)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_the_log_mask_is_the_soft_mask_by_distance_oldest_first():
    mask = span_log_mask([0.0, 2.5], 4, 2.0)  # distances 3, 2, 1, 0
    expected = torch.tensor([[0.0, 0.0, 0.5, 1.0], [0.75, 1.0, 1.0, 1.0]]).log()
    torch.testing.assert_close(mask, expected)


def test_spans_given_on_the_host_read_nothing_from_the_device(monkeypatch):
    q, k, v, z, pos = _inputs(2, 8, 2, 6, 40, "head", True)
    expected = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("z read"))
    host = [1.3, 5.7, 13.2, 7.5] * 2
    out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos, z_host=host)
    torch.testing.assert_close(out, expected)
