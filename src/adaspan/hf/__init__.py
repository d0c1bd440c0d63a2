"""Learned spans in Hugging Face ``transformers`` causal LMs (optional: ``pip install
'adaspan[hf]'``).

``add_spans`` attaches an adaptive span to every attention layer of a model whose attention
goes through ``AttentionInterface`` (Llama, Mistral, Qwen2, Qwen3, GPT-2, ...) and switches it
to the ``adaptive_span`` attention (``attention``); ``save_model``/``load_pretrained``
(``spans``; ``load_model``, its former name, still works); ``span_loss`` and ``clamp_spans``
(of ``attention.span``); ``SpanCache``, a key/value cache for ``generate`` that keeps only the
keys each layer's heads can see (``span_cache``), and ``SpanStaticCache``, its fixed-size
form for ``torch.compile`` (``static_cache``). ``adaspan retrofit`` is here too: the spans of
a frozen model trained alone (``retrofit``) and its report (``report``).

The Hugging Face feature sits above the rest of the package (it reads ``attention``,
``data``, ``training``'s runtime and ``measure``'s tables) and needs ``transformers``.
"""

from ..attention.span import clamp_spans, span_loss
from . import support  # noqa: F401 (before transformers is used: a missing or old one refused)
from .attention import NAME, register, span_modules
from .autoload import watch_loading
from .span_cache import SpanCache, SpanLayer, cache_argument, head_windows, kv_bytes, windows
from .spans import add_spans, load_pretrained, load_spans, save_model, save_spans
from .static_cache import SpanStaticCache

load_model = load_pretrained  # its name before 0.13

register()
watch_loading()  # a model of save_model loaded without its spans: one warning

from . import duo  # noqa: E402, F401 (registers the attention, retrofit method and policy duo)

__all__ = ["NAME", "SpanCache", "SpanLayer", "SpanStaticCache", "add_spans", "cache_argument",
           "clamp_spans", "head_windows", "kv_bytes", "load_model", "load_pretrained",
           "load_spans", "save_model", "save_spans", "span_loss", "span_modules", "windows"]
