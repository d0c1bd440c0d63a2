"""The span attention core (any q, k, v; both origins; every backend but the fused one, which
test_core_fused.py runs) against the naive float64 reference of tests/reference.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reference import reference_span_attention

from adaspan.attention import core
from adaspan.attention.core import HeadLayout, KeysValues, span_attention, span_log_mask
from adaspan.attention.functional import decode_attention
from adaspan.attention.span import key_window

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


@pytest.mark.parametrize("origin", [0, 1])
@pytest.mark.parametrize("with_pos", [True, False])
@pytest.mark.parametrize("z_kind", [None, "head", "dynamic"])
@pytest.mark.parametrize("Hq,Hkv,M,T", SHAPES)
def test_agrees_with_the_reference_in_float32(Hq, Hkv, M, T, z_kind, with_pos, origin):
    T += origin  # a key before the first query
    inputs = _inputs(2, Hq, Hkv, M, T, z_kind, with_pos)
    q, k, v, z, pos = inputs
    out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos, origin=origin, backend="band")
    assert out.shape == q.shape and out.dtype == q.dtype
    grads = _gradients(out, inputs)
    ref_inputs = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    expected = reference_span_attention(*ref_inputs[:4], S, R, pos=ref_inputs[4],
                                        origin=origin)
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
    band = core.banded_attention

    def recording(q, k, v, pos, z, *args, **kwargs):
        calls.append((q.shape[1], k.shape[2], kwargs["window"], kwargs["start"]))
        return band(q, k, v, pos, z, *args, **kwargs)

    monkeypatch.setattr(core, "banded_attention", recording)
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


def test_a_layout_of_bucketed_windows_equals_the_spans_own():
    """A caller's layout (windows rounded up to a bucket of 8, from z on the host): the same
    output as the windows span_attention finds itself."""
    q, k, v, z, pos = _inputs(2, 8, 2, 6, 40, "head", True)
    host = z.detach().flatten().tolist()
    layout = HeadLayout.of([key_window(h, S, R, bucket=8) for h in host], q.device, 4)
    assert {g.window for g in layout.groups} == {8, 16}
    out = span_attention(q, k, v, z.view(1, 8, 1), max_span=S, ramp=R, pos=pos, layout=layout,
                         bounds=(host, host))
    torch.testing.assert_close(out, span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos))


@pytest.mark.parametrize("origin", [0, 1])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(4, 4, 6, 20), (8, 2, 1, 9), (4, 1, 12, 12)])
def test_memory_keys_join_the_softmax(Hq, Hkv, M, T, origin):
    """Learned keys and values (persistent memory) in one softmax with the context keys, the
    context masked and the memory not: output and every gradient against the reference."""
    inputs = _inputs(2, Hq, Hkv, M, T + origin, "head", True)
    g = torch.Generator().manual_seed(5)
    memory = [torch.randn(Hq, D, 3, generator=g).requires_grad_(),
              torch.randn(Hq, 3, D, generator=g).requires_grad_()]
    q, k, v, z, pos = inputs
    out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos, origin=origin,
                         memory=tuple(memory))
    grads = _gradients(out, inputs + memory)
    ref = [t.detach().clone().requires_grad_() for t in inputs + memory]
    expected = reference_span_attention(*ref[:4], S, R, pos=ref[4], origin=origin,
                                        memory=tuple(ref[5:]))
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, _gradients(expected, ref), strict=True):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-5, rtol=1e-5)


class _Counted(KeysValues):
    """Keys and values that record which windows the band backend asks for."""

    def __init__(self, k, v):
        super().__init__(k, v)
        self.asked = []

    def window(self, group, start):
        self.asked.append((group.members, start))
        return super().window(group, start)


def test_keys_values_are_asked_for_per_group_from_its_window():
    """A :class:`KeysValues` source is read per head group from the group's first key (the
    paper's origin: T - M - w), so a layer can project only those keys."""
    q, k, v, z, pos = (t.detach() if t is not None else None
                       for t in _inputs(1, 4, 4, 5, 21, "head", True))
    kv = _Counted(k, v)
    out = span_attention(q, kv, None, z, max_span=S, ramp=R, pos=pos, origin=1)
    assert sorted(kv.asked) == [((0,), 16 - 6), ((1,), 16 - 10), ((2,), 0), ((3,), 16 - 12)]
    expected = reference_span_attention(q, k, v, z, S, R, pos=pos, origin=1)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def _decode_case(Hq, Hkv, M, T, with_pos, dtype):
    """Inputs of :func:`decode_attention` with the spans of ``_inputs``' "head" (windows 6, 10,
    16, 12), and those spans."""
    q, k, v, z, pos = (None if t is None else t.detach() for t in
                       _inputs(2, Hq, Hkv, M, T, "head", with_pos, dtype=dtype))
    host = z.flatten().tolist()
    return (q, k, v, span_log_mask(host, key_window(max(host), S, R), R), pos), z


@pytest.mark.parametrize("origin", [0, 1])
@pytest.mark.parametrize("with_pos", [True, False])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(4, 4, 1, 30), (8, 2, 1, 9), (4, 1, 1, 40), (4, 4, 1, 1),
                                        (8, 2, 3, 25), (4, 1, 5, 7), (4, 4, 16, 16)])
def test_decoding_all_heads_at_once_agrees_with_the_reference(Hq, Hkv, M, T, with_pos, origin):
    """MHA, GQA and MQA; one query and a few, keys fewer or more than the longest window; the
    auto backend decodes where it is given the log-mask and no gradient is needed."""
    T += origin
    (q, k, v, _, pos), z = _decode_case(Hq, Hkv, M, T, with_pos, torch.float32)
    host = z.flatten().tolist()
    log_mask = span_log_mask(host, key_window(max(host), S, R), R, origin=origin)
    assert log_mask.shape == (Hq, 16)
    for scale in (None, 0.2):
        with torch.no_grad():
            out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos, scale=scale,
                                 origin=origin, log_mask=log_mask)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert core.choose_backend(q, "auto", log_mask=log_mask) == "band"  # grad enabled
        expected = reference_span_attention(q, k, v, z, S, R, pos=pos, scale=scale, origin=origin)
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
    shifted = span_log_mask(torch.tensor([1.0, 3.5]), 4, 2.0, origin=1)  # distances 4 .. 1
    torch.testing.assert_close(shifted, expected)  # m_{z+1}(x + 1) = m_z(x)
    assert shifted.dtype == torch.float32


def test_spans_given_on_the_host_read_nothing_from_the_device(monkeypatch):
    q, k, v, z, pos = _inputs(2, 8, 2, 6, 40, "head", True)
    expected = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("z read"))
    host = [1.3, 5.7, 13.2, 7.5] * 2
    out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos, z_host=host)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("origin", [0, 1])
@pytest.mark.parametrize("Hq,Hkv,M,T", [(4, 4, 40, 48), (8, 2, 1, 30), (4, 1, 3, 12)])
def test_masked_keys_weigh_nothing(Hq, Hkv, M, T, origin):
    """A key mask (a left-padded batch's pads): the decode backend, whatever the number of
    queries, gives the reference's output with those keys left out."""
    (q, k, v, _, pos), z = _decode_case(Hq, Hkv, M, T, True, torch.float32)
    host = z.flatten().tolist()
    log_mask = span_log_mask(host, key_window(max(host), S, R), R, origin=origin)
    key_mask = torch.ones(2, T, dtype=torch.bool)
    key_mask[1, : T - M - 1] = False  # row 1: every key before its queries' own is a pad
    key_mask[0, :2] = False
    with torch.no_grad():
        out = span_attention(q, k, v, z, max_span=S, ramp=R, pos=pos, origin=origin,
                             log_mask=log_mask, key_mask=key_mask)
    expected = reference_span_attention(q, k, v, z, S, R, pos=pos, origin=origin,
                                        key_mask=key_mask)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs the decode backend"):
        span_attention(q, k, v, z, max_span=S, ramp=R, key_mask=key_mask)


@pytest.mark.parametrize("Hq,Hkv,T", [(8, 2, 30), (4, 4, 10), (4, 1, 16)])
def test_keys_of_a_ring_buffer_decode_as_in_order(Hq, Hkv, T):
    """The last W = 16 of T positions in a ring (position t in slot t mod W), slots that hold
    no position yet (T < W) at offset W: the reference's output over all T keys."""
    (q, k, v, log_mask, _), z = _decode_case(Hq, Hkv, 1, T, False, torch.float32)
    W, p = log_mask.shape[1], T - 1
    ring_k, ring_v = (torch.randn(2, Hkv, W, D) for _ in range(2))  # stale slots: noise
    positions = torch.arange(max(0, T - W), T)
    for ring, keys in ((ring_k, k), (ring_v, v)):
        ring[:, :, positions % W] = keys[:, :, positions]
    offsets = (p - torch.arange(W)) % W
    offsets = offsets.masked_fill(offsets > p, W)
    with torch.no_grad():
        out = span_attention(q, ring_k, ring_v, z, max_span=S, ramp=R, log_mask=log_mask,
                             key_offsets=offsets)
    expected = reference_span_attention(q, k, v, z, S, R)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="key_offsets"):
        span_attention(q, ring_k, ring_v, z, max_span=S, ramp=R, key_offsets=offsets)
