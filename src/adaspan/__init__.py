"""adaspan: Transformers whose attention heads learn their own context size.

Implements "Adaptive Attention Span in Transformers" (Sukhbaatar et al., ACL 2019) and the
attention methods it is compared against.
"""

from ._version import __version__
from .attention import Attention, SpanAttention
from .band import banded_attention
from .baselines import FactorizedAttention, VanillaAttention, XLAttention
from .checkpoint import load_model
from .config import ModelConfig, TrainConfig
from .evaluate import evaluate
from .generate import generate
from .model import SpanLM
from .registry import ATTENTIONS, register_attention
from .span import AdaptiveSpan, DynamicSpan, FixedSpan, Span, soft_mask
from .train import train

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
    "evaluate",
    "generate",
    "load_model",
    "register_attention",
    "soft_mask",
    "train",
]
