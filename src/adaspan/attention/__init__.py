"""The attention method and the methods it is compared against.

The soft span mask m_z and the span types (``span``), the band kernels over each query's keys
(``band``) and the fused GPU kernel (``fused``), what a layer carries between blocks
(``cache``), the registry of variants (``registry``), span attention itself
(``span_attention``: eqs. 1-3, per-head truncation), the same equations for any queries, keys
and values (``functional``: rotary positions, grouped-query heads, decoding), the paper's
baselines (``baselines``) and
the memory methods that followed (``persistent``, ``expire``), each registered where defined.

Imports nothing of adaspan but ``errors``; variants are handed a ``config.ModelConfig`` (named
in annotations only).
"""

from .span_attention import Attention, SpanAttention, use_kernel

__all__ = ["Attention", "SpanAttention", "use_kernel"]
