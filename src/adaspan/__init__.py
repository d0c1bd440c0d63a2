"""adaspan: Transformers whose attention heads learn their own context size.

Implements "Adaptive Attention Span in Transformers" (Sukhbaatar et al., ACL 2019) and the
attention methods it is compared against.

The package is nine parts, each a folder that imports only the parts before it:
``attention`` -> ``model`` -> ``data`` -> ``runtime`` -> ``run`` -> ``training`` ->
``measure`` -> ``experiments`` -> ``hf`` (learned spans in Hugging Face models, optional),
above ``errors`` and ``config`` (the options, which the parts register their choices with),
and the command line (``cli``) on top (docs/architecture.md).
"""

import sys

from ._version import __version__
from .attention import registry
from .attention.band import banded_attention
from .attention.baselines import FactorizedAttention, VanillaAttention, XLAttention
from .attention.core import span_attention
from .attention.registry import ATTENTIONS, register_attention
from .attention.span import (
    AdaptiveSpan,
    DynamicSpan,
    FixedSpan,
    Span,
    clamp_spans,
    key_window,
    soft_mask,
    span_loss,
)
from .attention.span_attention import Attention, SpanAttention
from .config import ModelConfig, TrainConfig
from .measure.generate import generate
from .model.lm import SpanLM
from .run.checkpoint import load_model
from .training.evaluate import evaluate
from .training.train import train

__all__ = [
    "ATTENTIONS",
    "AdaptiveSpan",
    "Attention",
    "DynamicSpan",
    "FactorizedAttention",
    "FixedSpan",
    "ModelConfig",
    "Span",
    "SpanAttention",
    "SpanLM",
    "TrainConfig",
    "VanillaAttention",
    "XLAttention",
    "__version__",
    "banded_attention",
    "clamp_spans",
    "evaluate",
    "generate",
    "key_window",
    "load_model",
    "register_attention",
    "soft_mask",
    "span_attention",
    "span_loss",
    "train",
]

# where the modules that users import directly were before the package had folders
sys.modules[f"{__name__}.registry"] = registry
