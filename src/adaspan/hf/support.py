"""The transformers that ``adaspan.hf`` supports: imported first by the part, it refuses a
missing one, or one older than the oldest the tests run with, in one line. The few interfaces
that changed between the oldest and the newest are bridged here, each by its version."""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor

from .._version import version_tuple
from ..errors import UserError

OLDEST = (4, 56)  # CI runs tests/hf with 4.56.2 and with 5.24.0 (constraints.txt)

try:
    import transformers
except ImportError:
    raise UserError("adaspan.hf needs transformers: pip install 'adaspan[hf]'") from None

VERSION = version_tuple(transformers.__version__)[:2]

if VERSION < OLDEST:
    raise UserError("adaspan.hf needs transformers 4.56 or newer (tested: 4.56 and 5.24), "
                    f"found {transformers.__version__}: pip install 'transformers>=4.56'")

RELATIVE_MASKS = VERSION >= (5, 14)
"""Whether masks take the first query's position from the cache (``Cache.get_query_offset``,
5.14 on), so that a layer's mask sizes may be relative to it; before, they take
``get_seq_length``, so a layer's sizes are relative to position 0."""


def mask_function(function: Callable) -> Callable:
    """An ``AttentionMaskInterface`` function of the queries' count and first position
    (``q_length``, ``q_offset``: what 5.4 on hands), made to take the queries' positions
    (``cache_position``) where transformers hands those instead (before 5.4)."""
    if VERSION >= (5, 4):
        return function

    @functools.wraps(function)
    def of_positions(*args, cache_position: Tensor, **kwargs):
        return function(*args, q_length=cache_position.shape[0], q_offset=cache_position[0],
                        **kwargs)

    return of_positions


def query_length(queries: int | Tensor) -> int:
    """The queries' count from the argument of a cache layer's ``get_mask_sizes``: the count
    itself (5.4 on), or the queries' positions (before)."""
    return queries if isinstance(queries, int) else queries.shape[0]


def layer_states(key_states: Tensor, value_states: Tensor | None) -> tuple[Tensor, ...]:
    """The arguments of a cache layer's ``lazy_initialization``: the keys and values (5.0 on),
    or the keys alone (before, when ``early_initialization`` hands no values either)."""
    return (key_states, value_states) if VERSION >= (5, 0) else (key_states,)
