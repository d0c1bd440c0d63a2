"""The language model: ``SpanLM`` (``lm``), adaptive input and softmax (``adaptive_io``), the
numbers of its spans and costs (``analysis``) and batch-1 decoding one token at a time
(``decode``).

Imports ``attention`` and ``errors``; handed a ``config.ModelConfig`` (named in annotations
only).
"""

from .lm import SpanLM, parameter_count

__all__ = ["SpanLM", "parameter_count"]
