"""The attention method and the methods it is compared against.

The soft span mask m_z and the span types (``span``), rotary positions (``rotary``), the band
kernels over each query's keys (``band``) and the fused GPU kernel (``fused``), what a layer
carries between blocks (``cache``), the registry of variants (``registry``), the span attention
core (``core``: eqs. 1-3 of any queries, keys and values, one function and its backends), the
paper's layer that projects and calls it (``span_attention``), the core's former functional
names (``functional``), the paper's baselines (``baselines``) and the memory methods that
followed (``persistent``, ``expire``), each registered where defined.

Imports nothing of adaspan but ``errors``; variants are handed a ``config.ModelConfig`` (named
in annotations only).
"""

from .span_attention import Attention, SpanAttention, use_kernel

__all__ = ["Attention", "SpanAttention", "use_kernel"]
