"""Shared fixtures. One torch thread per test process: `pytest -n 2` then uses both cores
without contention. Plain helper functions are in ``helpers.py`` (``from helpers import ...``)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import Tensor, nn

from adaspan.attention.cache import fit_cache
from adaspan.attention.registry import ATTENTIONS, register_attention
from adaspan.attention.span import FixedSpan
from adaspan.attention.span_attention import Attention
from adaspan.config import ModelConfig
from adaspan.data.corpora import load_corpus
from adaspan.runtime import precision

torch.set_num_threads(1)
if not torch.cuda.is_available():  # the fused kernel runs in Triton's interpreter: chosen
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton


def pytest_report_header(config) -> str:
    """Whether dtype=auto trains in bf16 here: the CPU's answer, or ADASPAN_CPU_FAST_BF16's
    (which the processes the tests start inherit). The suite passes under both claims."""
    claim = os.environ.get(precision.CPU_FAST_BF16)
    source = f"{precision.CPU_FAST_BF16}={claim}" if claim else "detected"
    return f"fast bf16 on this CPU: {precision.cpu_fast_bfloat16()} ({source})"


@pytest.fixture(scope="session")
def corpus_file(tmp_path_factory) -> str:
    """800 bytes of the bundled corpus: 720 train bytes = 5 blocks of 4 x 32, so runs wrap."""
    path = tmp_path_factory.mktemp("data") / "tiny.txt"
    path.write_bytes(load_corpus("kjv", progress=False).train[:800].tobytes())
    return str(path)


class PreviousToken(Attention):
    """A toy variant, defined outside the package: each token reads the previous one only
    (span 1) through W_v and W_o; the cache is the last state of the block."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.d_head = config.d_model, config.n_heads, config.d_head
        self.v, self.o = (nn.Linear(config.d_model, config.d_model, bias=False)
                          for _ in range(2))
        self.span = FixedSpan(config.n_heads, 1, config.ramp)

    def forward(self, x: Tensor, cache: Tensor, pos: Tensor | None = None) -> tuple[Tensor, Tensor]:
        states = torch.cat([fit_cache(cache, 1).to(x), x], dim=1)
        return self.o(self.v(states[:, :-1])), states[:, -1:].detach()


@pytest.fixture
def toy_attention():
    """The name of :class:`PreviousToken`, registered for the test and removed after it."""
    name = "toy-previous-token"
    assert name not in ATTENTIONS
    register_attention(name)(PreviousToken)
    try:
        yield name
    finally:
        ATTENTIONS.pop(name, None)


@pytest.fixture(params=["one group", "a group per window"])
def span_groups(request, monkeypatch) -> str:
    """``SpanCache`` layers handing the attention all their heads at once (groups costing more
    than any padding), or one group per window of key/value heads (groups costing nothing)."""
    from adaspan.hf import span_cache

    monkeypatch.setattr(span_cache, "PART_BYTES", 0 if request.param != "one group" else 1e18)
    return request.param
