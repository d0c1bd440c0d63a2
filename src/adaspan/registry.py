"""Attention variants by name. Each variant registers itself where it is defined::

    @register_attention("vanilla")
    class VanillaAttention(Attention): ...

Every list of variant names (``ModelConfig.attention``'s choices, the CLI's help, ``adaspan
compare --methods``, the tests' parametrisation) is read from :data:`ATTENTIONS`. Importing
:mod:`adaspan` registers the built-in variants (:mod:`adaspan.attention` and
:mod:`adaspan.baselines`); a variant defined elsewhere is available once its module is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

# name -> callable building the variant's module from a ModelConfig (a class or a function);
# this module sits below the configuration, which reads the names from it
ATTENTIONS: dict[str, Callable[..., nn.Module]] = {}
Builder = TypeVar("Builder", bound=Callable[..., nn.Module])


def register_attention(name: str) -> Callable[[Builder], Builder]:
    """Class or function decorator: ``ModelConfig(attention=name)`` builds layers with it."""

    def register(build: Builder) -> Builder:
        if name in ATTENTIONS and ATTENTIONS[name] is not build:
            raise ValueError(f"attention {name!r} is already registered by "
                             f"{ATTENTIONS[name].__module__}.{ATTENTIONS[name].__qualname__}")
        ATTENTIONS[name] = build
        return build

    return register


def name_of(build: Callable[..., nn.Module]) -> str:
    """The name ``build`` is registered under (a variant is asked for by what it is, not by a
    name written elsewhere)."""
    for name, registered in ATTENTIONS.items():
        if registered is build:
            return name
    raise KeyError(f"{build.__qualname__} is not a registered attention variant")
