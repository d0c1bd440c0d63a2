"""Learned spans in a Hugging Face causal LM: attached (``add_spans``), saved and loaded with
the model (penalised and kept in [0, 1] by ``attention.span``'s ``span_loss`` and
``clamp_spans``, which ``adaspan.hf`` exports).

``add_spans`` finds the attention modules by one probing forward of two tokens through the
``adaptive_span`` attention function: the modules it is called for are the layers, in order; a
model whose attention does not go through ``AttentionInterface`` calls it for none and is
refused. Each module gets an :class:`~adaspan.attention.span.AdaptiveSpan` of the model's
query heads, ``z = S z'`` (``init`` is z': 1 keeps the model unchanged up to S tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from ..attention.span import AdaptiveSpan
from ..errors import ConfigError, UserError, one_line, require
from .attention import NAME, attached_spans, probing, span_modules

SPANS_FILE = "adaptive_spans.safetensors"  # z' of every layer, one tensor per layer
SETTINGS_FILE = "adaptive_spans.json"  # max_span, ramp, per_layer; the spans, for reading


def attention_modules(model: nn.Module) -> tuple[list[nn.Module], list[int]]:
    """The modules that call the attention interface, in call order, and the sliding windows
    they declare."""
    if not getattr(model, "_supports_attention_backend", False):
        raise ConfigError(f"{type(model).__name__} does not compute attention through "
                          "transformers' AttentionInterface: spans cannot be attached")
    previous = model.config._attn_implementation
    model.set_attn_implementation(NAME)
    try:
        device = next(model.parameters()).device
        with probing() as found:
            model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    if not found:
        raise ConfigError(f"{type(model).__name__}'s attention never called the "
                          "AttentionInterface: spans cannot be attached")
    if not all(getattr(m, "is_causal", True) for m, _ in found):
        raise ConfigError(f"{type(model).__name__} attends to later tokens: spans are for "
                          "causal language models")
    return [m for m, _ in found], [w for _, w in found if w is not None]


def _check_max_span(model: nn.Module, max_span: int | None, windows: list[int]) -> int:
    """``max_span`` (default: the model's positions, or its sliding window if shorter), no
    longer than either."""
    positions = getattr(model.config, "max_position_embeddings", None)
    limits = [n for n in (positions, *windows) if n]
    if max_span is None:
        if not limits:
            raise ConfigError("the model's config gives no max_position_embeddings: give max_span")
        return min(limits)
    require("max_span", max_span, lambda n: isinstance(n, int) and n >= 1, "a positive integer")
    if limits and max_span > min(limits):
        raise ConfigError(f"max_span={max_span} is longer than the model's positions or "
                          f"sliding window ({min(limits)})")
    return max_span


def key_value_heads(config) -> int:
    """A model's key/value heads per layer: ``num_key_value_heads``, or its query heads where
    the config has none (GPT-2)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def add_spans(model: nn.Module, max_span: int | None = None, ramp: int = 32, init: float = 1.0,
              per_layer: bool = False, per_kv_head: bool = False, sinks: int = 0) -> nn.Module:
    """Attach an ``AdaptiveSpan`` (S = ``max_span``, ramp R, z' = ``init``) to every attention
    module of ``model`` and switch it to the ``adaptive_span`` attention; returns ``model``.
    One z per query head, or per layer (``per_layer``), or per key/value head, shared by the
    query heads that read it (``per_kv_head``: the span penalty then counts the positions the
    cache holds). The first ``sinks`` positions of a sequence weigh 1 for every query,
    whatever its span (attention sinks)."""
    require("ramp", ramp, lambda r: isinstance(r, int) and r >= 1, "a positive integer")
    require("sinks", sinks, lambda n: isinstance(n, int) and n >= 0, "a whole number")
    require("init", init, lambda z: 0.0 <= z <= 1.0, "z' = z / max_span in [0, 1]")
    if per_layer and per_kv_head:
        raise ConfigError("per_layer and per_kv_head exclude each other: one z per layer, or "
                          "one per key/value head")
    modules, windows = attention_modules(model)
    max_span = _check_max_span(model, max_span, windows)
    n_heads = key_value_heads(model.config) if per_kv_head else model.config.num_attention_heads
    param = next(model.parameters())
    for module in modules:
        span = AdaptiveSpan(n_heads, max_span, ramp, init=init, per_layer=per_layer)
        span.sinks = sinks  # read by the attention function and SpanCache
        setattr(module, NAME, span.to(device=param.device))
    model.config.adaptive_span = {"max_span": max_span, "ramp": ramp, "per_layer": per_layer,
                                  "per_kv_head": per_kv_head, "sinks": sinks}
    model.set_attn_implementation(NAME)
    return model


def save_spans(model: nn.Module, directory: str | Path) -> None:
    """Write the spans next to ``model.save_pretrained(directory)``: z' of every layer
    (safetensors) and the span settings with each head's span min(S, z + R) (JSON)."""
    spans, directory = attached_spans(model), Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({f"layers.{i}.z_frac": s.z_frac.detach().float().cpu().contiguous()
               for i, s in enumerate(spans)}, str(directory / SPANS_FILE))
    settings = {**model.config.adaptive_span,
                "spans": [s.spans().tolist() for s in spans]}
    (directory / SETTINGS_FILE).write_text(json.dumps(settings, indent=1) + "\n")


def save_model(model: nn.Module, directory: str | Path, tokenizer: Any = None) -> None:
    """``model.save_pretrained(directory)`` without the spans, then the spans
    (:func:`save_spans`) and the file that has ``from_pretrained(directory,
    trust_remote_code=True)`` attach them (``autoload.write_loader``); and, where given,
    ``tokenizer.save_pretrained(directory)`` (``adaspan longeval`` reads it there)."""
    from .autoload import write_loader

    weights = {k: v for k, v in model.state_dict().items() if f".{NAME}." not in k}
    model.save_pretrained(directory, state_dict=weights)
    save_spans(model, directory)
    write_loader(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)


def load_spans(model: nn.Module, directory: str | Path) -> nn.Module:
    """Attach the spans saved in ``directory`` (:func:`save_spans`) to ``model``."""
    directory = Path(directory)
    try:
        settings = json.loads((directory / SETTINGS_FILE).read_text())
        options = {key: settings[key] for key in ("max_span", "ramp", "per_layer")}
        options["per_kv_head"] = settings.get("per_kv_head", False)  # before 0.13: per query head
        options["sinks"] = settings.get("sinks", 0)  # before 0.14: none
        tensors = load_file(str(directory / SPANS_FILE))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"no spans in {directory}: {one_line(exc)}") from None
    add_spans(model, **options)
    spans = span_modules(model)
    if len(tensors) != len(spans):
        raise UserError(f"{directory} holds the spans of {len(tensors)} layers, the model has "
                        f"{len(spans)}")
    with torch.no_grad():
        for i, span in enumerate(spans):
            span.z_frac.copy_(tensors[f"layers.{i}.z_frac"])
    return model


def load_pretrained(directory: str | Path, **from_pretrained: object) -> nn.Module:
    """The causal LM saved in ``directory`` (:func:`save_model`) with its spans attached;
    keyword arguments go to ``AutoModelForCausalLM.from_pretrained``."""
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), **from_pretrained)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"cannot load a model from {directory}: {one_line(exc)}") from None
    return load_spans(model, directory)
