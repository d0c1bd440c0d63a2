"""The import paths users may hold from before the span attention core and the new parts keep
working: the package's own names, ``adaspan.attention``'s and its functional interface,
``adaspan.model``, ``adaspan.config`` and ``adaspan.hf``'s."""

from __future__ import annotations

import importlib

import pytest
import torch

OLD_NAMES = {
    "adaspan": ["SpanLM", "span_attention", "banded_attention", "key_window", "SpanAttention",
                "ModelConfig", "TrainConfig", "load_model", "train", "evaluate", "generate",
                "AdaptiveSpan", "soft_mask", "span_loss", "register_attention", "ATTENTIONS"],
    "adaspan.attention": ["Attention", "SpanAttention", "use_kernel"],
    "adaspan.attention.functional": ["span_attention", "decode_attention", "span_log_mask",
                                     "key_window", "rotate"],
    "adaspan.model": ["SpanLM"],
    "adaspan.config": ["ModelConfig", "TrainConfig", "DTYPES"],
    "adaspan.registry": ["ATTENTIONS", "register_attention"],
}
HF_NAMES = ["SpanCache", "SpanLayer", "add_spans", "clamp_spans", "head_windows", "kv_bytes",
            "load_model", "load_spans", "save_model", "save_spans", "span_loss", "span_modules",
            "windows"]


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_the_names_of_earlier_versions_import(module):
    imported = importlib.import_module(module)
    assert [name for name in OLD_NAMES[module] if not hasattr(imported, name)] == []


def test_the_hugging_face_names_of_earlier_versions_import():
    pytest.importorskip("transformers")
    hf = importlib.import_module("adaspan.hf")
    assert [name for name in HF_NAMES if not hasattr(hf, name)] == []


def test_the_functional_interface_keeps_its_signature():
    """``adaspan.span_attention`` as 0.12.0 called it (keys at distances 0 .. S - 1, z_min,
    z_host) gives the core's output."""
    from adaspan import span_attention
    from adaspan.attention.core import span_attention as core

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, n, 8, generator=g) for n in (5, 12, 12))
    z = torch.tensor([1.5, 4.0, 7.5, 2.0]).view(4, 1)
    old = span_attention(q, k, v, z, max_span=10, ramp=2, pos=None, scale=None, dropout=0.0,
                         training=False, z_min=1.5, z_host=None)
    assert torch.equal(old, core(q, k, v, z, max_span=10, ramp=2, origin=0))
