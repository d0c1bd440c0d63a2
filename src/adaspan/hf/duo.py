"""DuoAttention's method (Xiao et al. 2025) on a Hugging Face model, written from the paper:
one gate alpha in [0, 1] per key/value head, trained with the model frozen, mixes the head's
full attention and its streaming attention (the first ``sinks`` positions and the last
``window``),

    y = alpha * attention over every position + (1 - alpha) * attention over sinks + window,

then binarised at a budget: the heads of the greatest alpha keep every position ("retrieval
heads"), the others sinks + window ("streaming heads"), as many of the first as the budget in
bytes holds. The attention ``"duo"`` (registered with transformers) computes the mixture for
training; the binarised model runs as :func:`adaspan.hf.streaming.hard_windows` over a
``SpanCache`` (cache policy ``duo``). ``adaspan retrofit --method duo`` trains the gates
with the spans' data, steps and distillation loss.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..attention.core import span_attention
from ..attention.sinks import Sinks
from ..config import RetrofitConfig
from ..errors import UserError, one_line
from .budget import position_bytes
from .cache_policies import CachePolicy, register_policy, whole_option
from .methods import Method, register_method
from .span_cache import SpanCache
from .spans import attention_modules, key_value_heads
from .streaming import hard_windows

NAME = "duo"  # the attention implementation and the attribute of each attention module
GATES_FILE = "duo_gates.json"


class DuoGate(nn.Module):
    """The gates of one attention layer: alpha per key/value head (``alpha``, starting at 1:
    the model unchanged), and the streaming heads' ``window`` and ``sinks``."""

    def __init__(self, kv_heads: int, window: int, sinks: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(kv_heads))
        self.window, self.sinks = window, sinks


def gates(model: nn.Module) -> list[DuoGate]:
    """The gates of a model's attention modules, in layer order."""
    return [m for m in model.modules() if isinstance(m, DuoGate)]


def duo_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, scaling: float | None = None,
                  dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """``AttentionInterface`` function of training (no cache: the queries are every
    position): each query head's mixture of full causal attention (sdpa) and streaming
    attention (the span attention core with a hard window and sinks) by its key/value head's
    alpha. Returns (B, M, Hq, d)."""
    gate: DuoGate = getattr(module, NAME)
    Hq, M, (Hkv, T) = query.shape[1], query.shape[2], key.shape[1:3]
    if M != T:
        raise UserError("the duo attention trains gates on whole windows, without a cache")
    full = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                          enable_gqa=Hq != Hkv)
    z = [float(gate.window - 1)] * Hq
    stream = span_attention(query, key, value, torch.tensor(z, device=query.device).view(
        1, Hq, 1), max_span=max(T, gate.window), ramp=1.0, scale=scaling, z_host=z,
        sinks=Sinks(key[:, :, :gate.sinks], value[:, :, :gate.sinks], 0)
        if gate.sinks else None)
    alpha = gate.alpha.clamp(0, 1).repeat_interleave(Hq // Hkv).view(1, Hq, 1, 1)
    out = torch.lerp(stream.to(full.dtype), full, alpha.to(full.dtype))  # autocast: sdpa's
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, attention_mask: Tensor | None = None, **kwargs) -> None:
    """``AttentionMaskInterface`` function: the duo attention makes its own causal masks, and
    takes no padding."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise UserError("the duo attention trains gates on unpadded windows")


def add_gates(model: nn.Module, window: int, sinks: int) -> list[DuoGate]:
    """A :class:`DuoGate` per attention module (the modules ``add_spans`` finds), the model
    switched to the ``duo`` attention; returns the gates."""
    modules, _ = attention_modules(model)
    kv, param = key_value_heads(model.config), next(model.parameters())
    for module in modules:
        setattr(module, NAME, DuoGate(kv, window, sinks).to(param.device))
    model.set_attn_implementation(NAME)
    return gates(model)


def gate_loss(model: nn.Module, coef: float) -> Tensor:
    """DuoAttention's L1 penalty: ``coef`` times the sum of alpha over every key/value head
    of every layer, divided by the key/value heads of a layer."""
    alphas = [g.alpha.clamp(0, 1) for g in gates(model)]
    return coef * torch.cat(alphas).sum() / alphas[0].numel()


def clamp_gates(model: nn.Module) -> None:
    """alpha back onto [0, 1] after an optimiser step."""
    with torch.no_grad():
        for gate in gates(model):
            gate.alpha.clamp_(0, 1)


def save_gates(model: nn.Module, directory: str | Path) -> None:
    """The gates (alpha per layer and key/value head, window, sinks) as ``duo_gates.json``."""
    found = gates(model)
    settings = {"window": found[0].window, "sinks": found[0].sinks,
                "alpha": [g.alpha.detach().float().cpu().tolist() for g in found]}
    Path(directory, GATES_FILE).write_text(json.dumps(settings, indent=1) + "\n")


def read_gates(path: str | Path) -> dict:
    """The settings :func:`save_gates` wrote (a directory or the file)."""
    path = Path(path)
    path = path / GATES_FILE if path.is_dir() else path
    try:
        settings = json.loads(path.read_text())
        settings["alpha"] = [[float(a) for a in row] for row in settings["alpha"]]
        return settings
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"no duo gates in {path}: {one_line(exc)}") from None


def binarise(alpha: list[list[float]], budget: int, context: int, window: int, sinks: int,
             per_position: int, max_span: int) -> list[list[int]]:
    """Each key/value head's window: every position up to ``max_span`` for the heads of the
    greatest alpha, as many as ``budget`` bytes hold at ``context`` positions, the others
    ``sinks`` + ``window`` (per position ``per_position`` bytes)."""
    stream = (min(context, sinks) + min(context, window - 1)) * per_position
    full = (min(context, sinks) + min(context, max_span - 1)) * per_position
    spare = budget - stream * sum(map(len, alpha))
    if spare < 0:
        raise UserError(f"a budget of {budget} bytes holds fewer than every head's sinks and "
                        f"window ({stream * sum(map(len, alpha))} bytes)")
    order = sorted(((a, layer, head) for layer, row in enumerate(alpha)
                    for head, a in enumerate(row)), reverse=True)
    retrieval = set() if full <= stream else {
        (layer, head) for _, layer, head in order[:spare // (full - stream)]}
    return [[max_span if (layer, head) in retrieval else window for head in range(len(row))]
            for layer, row in enumerate(alpha)]


class DuoPolicy(CachePolicy):
    """DuoAttention's binarised heads in a ``SpanCache``: ``gates`` (a file or directory of
    :func:`save_gates`) at ``budget`` bytes after the prompt (in the model's dtype)."""

    def __init__(self, model: nn.Module, gates: str, budget: str) -> None:
        super().__init__(model)
        self.settings = read_gates(gates)
        self.budget = whole_option(NAME, "budget", budget, 1)
        self.size = position_bytes(model.config, next(model.parameters()).element_size())

    @contextmanager
    def applied(self, prompt_tokens: int) -> Iterator[SpanCache]:
        settings, config = self.settings, self.model.config
        windows = binarise(settings["alpha"], self.budget, prompt_tokens, settings["window"],
                           settings["sinks"], self.size, config.max_position_embeddings)
        with hard_windows(self.model, windows, settings["sinks"]):
            yield SpanCache(self.model)


def _attach(model: nn.Module, config: RetrofitConfig) -> None:
    add_gates(model, config.streaming_window, config.sinks)


def _alphas(model: nn.Module) -> list[nn.Parameter]:
    return [gate.alpha for gate in gates(model)]


def _penalty(model: nn.Module, config: RetrofitConfig) -> Tensor:
    return gate_loss(model, config.span_loss)


AttentionInterface.register(NAME, duo_attention)
AttentionMaskInterface.register(NAME, no_mask)
register_policy(NAME, DuoPolicy)
register_method(NAME, Method(_attach, _alphas, _penalty, clamp_gates, save_gates, report=False))
