"""adaspan: Transformers whose attention heads learn their own context size.

Implements "Adaptive Attention Span in Transformers" (Sukhbaatar et al., ACL 2019) and the
attention methods it is compared against.
"""

from .attention import SpanAttention, banded_attention
from .config import ModelConfig
from .model import SpanLM
from .span import AdaptiveSpan, DynamicSpan, FixedSpan, Span, soft_mask

__version__ = "0.1.0"

__all__ = [
    "AdaptiveSpan",
    "DynamicSpan",
    "FixedSpan",
    "ModelConfig",
    "Span",
    "SpanAttention",
    "SpanLM",
    "banded_attention",
    "soft_mask",
]
