"""The cache policies of ``adaspan longeval``: how a model holds keys and values while it
answers a prompt, by name.

A policy is a :class:`CachePolicy` built for one model by the factory registered under its
name (:func:`register_policy`, one call, where the policy is defined): ``full``
(transformers' ``DynamicCache``) and ``spans`` (``SpanCache``) are here. A module of other
policies registers them when imported; ``adaspan.hf.longeval`` imports adaspan's own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import Cache

from ..attention.span import AdaptiveSpan, exact_fraction
from ..errors import UserError
from .attention import span_modules
from .span_cache import SpanCache
from .spans import SETTINGS_FILE


class CachePolicy:
    """How one model holds keys and values while it answers a prompt. Built for the model by
    the factory registered under its ``name`` (:func:`build_policy`); a factory refuses a
    model the policy cannot serve (a one-line ``UserError``)."""

    name = ""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def cache(self, prompt_tokens: int) -> Cache:
        """A new cache for one prompt of ``prompt_tokens`` tokens."""
        raise NotImplementedError

    @contextmanager
    def applied(self, prompt_tokens: int) -> Iterator[Cache]:
        """The cache of one ``generate`` call on a prompt of ``prompt_tokens`` tokens; within
        the block the model runs as the policy needs it (here, unchanged: a policy that
        changes the model's attention for the call overrides this)."""
        yield self.cache(prompt_tokens)


class FullPolicy(CachePolicy):
    """transformers' ``DynamicCache``: every key and value of the prompt."""

    def cache(self, prompt_tokens: int) -> Cache:
        return DynamicCache()


class SpansPolicy(CachePolicy):
    """``adaspan.hf.SpanCache``: per key/value head, the positions its spans can see. Some
    spans can be changed for each prompt and put back after it, to see which spans cost an
    answer and what keeping more would hold: ``full_layers`` (layer numbers joined by ``+``,
    e.g. ``spans:full_layers=0+2``) sets those layers' spans to z = S; ``windows``
    (``LAYER.HEAD@WINDOW`` joined by ``+``, e.g. ``spans:windows=0.0@1024``) sets span HEAD of
    layer LAYER (a key/value head's, with spans per key/value head) to z = WINDOW - R, so that
    it holds WINDOW positions."""

    def __init__(self, model: nn.Module, full_layers: str = "", windows: str = "") -> None:
        spans = span_modules(model)
        if not spans:
            raise UserError("cache policy 'spans' needs a model with spans: a directory with "
                            f"{SETTINGS_FILE} (adaspan retrofit writes one)")
        super().__init__(model)
        self.edits = [(spans[layer], slice(None), 1.0)
                      for layer in layer_numbers(full_layers, len(spans))]
        self.edits += head_windows_option(windows, spans)

    def cache(self, prompt_tokens: int) -> Cache:
        return SpanCache(self.model)

    @contextmanager
    def applied(self, prompt_tokens: int) -> Iterator[Cache]:
        changed = list({id(span): span for span, _, _ in self.edits}.values())
        learned = [span.z_frac.detach().clone() for span in changed]
        with torch.no_grad():
            for span, heads, z_frac in self.edits:
                span.z_frac[heads] = z_frac
        try:
            yield self.cache(prompt_tokens)
        finally:
            with torch.no_grad():
                for span, z_frac in zip(changed, learned, strict=True):
                    span.z_frac.copy_(z_frac)


def whole_option(policy: str, name: str, value: str | int, least: int,
                 most: int | None = None) -> int:
    """Option ``name`` of a cache policy as a whole number of at least ``least`` (and at most
    ``most``), else a one-line ``UserError``."""
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least or (most is not None and number > most):
        bounds = f"of at least {least}" if most is None else f"in [{least}, {most}]"
        raise UserError(f"cache policy {policy!r}: {name} is a whole number {bounds}, got "
                        f"{value!r}")
    return number


def layer_numbers(text: str, layers: int) -> list[int]:
    """The layer numbers of ``text`` (``0+2``), each in [0, ``layers``); else a UserError."""
    parts = [part for part in text.split("+") if part]
    return sorted({whole_option("spans", "full_layers", part, 0, layers - 1) for part in parts})


def head_windows_option(text: str, spans: list[AdaptiveSpan]
                        ) -> list[tuple[AdaptiveSpan, int, float]]:
    """``(span, head, z')`` of each ``LAYER.HEAD@WINDOW`` in ``text`` (joined by ``+``):
    S z' = WINDOW - R (:func:`exact_fraction`), WINDOW in [R, S]; else a one-line UserError."""
    edits = []
    for part in (part for part in text.split("+") if part):
        where, sep, window = part.partition("@")
        layer, dot, head = where.partition(".")
        if not sep or not dot:
            raise UserError(f"cache policy 'spans': windows are LAYER.HEAD@WINDOW joined by +, "
                            f"got {part!r}")
        span = spans[whole_option("spans", "windows' layer", layer, 0, len(spans) - 1)]
        h = whole_option("spans", "windows' head", head, 0, span.z_frac.numel() - 1)
        w = whole_option("spans", "windows' window", window, span.ramp, span.max_span)
        edits.append((span, h, exact_fraction(w - span.ramp, span.max_span)))
    return edits


POLICIES: dict[str, Callable[..., CachePolicy]] = {}


def register_policy(name: str, factory: Callable[..., CachePolicy]) -> None:
    """Make ``factory(model, **options)`` the cache policy ``name`` (``--cache name``, or
    ``--cache name:key=value,...`` with options, handed over as text)."""
    POLICIES[name] = factory


def build_policy(spec: str, model: nn.Module) -> CachePolicy:
    """The cache policy of ``spec`` (``name`` or ``name:key=value,...``) for ``model``,
    reporting ``spec`` as its name; an unknown name or option is a one-line ``UserError``."""
    name, _, text = spec.partition(":")
    if name not in POLICIES:
        raise UserError(f"unknown cache policy {name!r}; the policies are {', '.join(POLICIES)}")
    items = [item.partition("=") for item in text.split(",") if item]
    if any(not key or not sep for key, sep, _ in items):
        raise UserError(f"cache policy options are key=value separated by commas, got {text!r}")
    options = {key: value for key, _, value in items}
    try:
        inspect.signature(POLICIES[name]).bind(model, **options)
    except TypeError as exc:
        raise UserError(f"cache policy {name!r}: {exc}") from None
    policy = POLICIES[name](model, **options)
    policy.name = spec if options else name
    return policy


register_policy("full", FullPolicy)
register_policy("spans", SpansPolicy)
