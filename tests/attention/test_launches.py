"""Kernel launches counted on the CPU by ``scripts/bench/count_launches.py``: on the path CUDA takes
(the fused kernel), a training step and an evaluation block at the paper's small model and at
a 10-minute run's shape launch no more than recorded (docs/performance.md), and at most as many
as the authors' code; a generated token, a fixed dozen per layer (14 for the static step that
CUDA captures in a graph)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_script, tiny

from adaspan.model.decode import Decoder, StaticDecoder

count_launches = load_script("count_launches")

RUN_SPANS = [104, 52, 66, 55, 37, 38, 60, 89, 67, 68, 45, 37, 35, 34, 40, 98]
PAPER_SPANS = [int(s) for s in count_launches.PAPER_SPANS.split(",")]
# shape: (layers, d, heads, S, spans, block), recorded (train, eval), the authors' (train, eval)
# (``python ../shared/anchors/count_launches.py``, their TransformerSeq at the same spans)
SHAPES = {
    "paper-small": ((12, 512, 8, 8192, PAPER_SPANS, 512), (943, 303), (1455, 495)),
    "ten-minute-run": ((4, 256, 4, 1024, RUN_SPANS, 256), (327, 103), (491, 163)),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_path_launches_no_more_than_recorded(shape):
    (layers, *sizes), recorded, authors = SHAPES[shape]
    train, evaluate = count_launches.build(layers, *sizes, batch=1, kernel="fused")
    counts = [count_launches.count(step) for step in (train, evaluate)]
    for counter, limit, theirs in zip(counts, recorded, authors, strict=True):
        assert counter.total <= limit <= theirs, counter.ops.most_common()
        assert counter.ops["aten.slice_backward"] == 0
        assert counter.ops["triton.band_forward"] == layers  # one launch per layer
    assert counts[0].ops["triton.band_backward"] == layers


# per generated token, (per layer, for the rest): its token's write, embedding row, clock, output
DECODE_LAUNCHES = {Decoder: (12, 2), StaticDecoder: (14, 5)}


@pytest.mark.parametrize("kind", [Decoder, StaticDecoder], ids=["host-position", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_generated_token_launches_a_dozen_operators_per_layer_and_casts_nothing(dtype, kind):
    """The decoders' steps (adaspan.model.decode): weights prepared once (in bf16 under bf16
    autocast), so a token launches 12 operators per layer and 2 for the output, none of them a
    cast; the ring of keys and values is written in place (one copy per layer). The static
    step adds per layer the remainder of the clock and the gather of the position scores
    into the ring's order, and per token the write of the token, the embedding's row and the
    clock's tick."""
    model = tiny("adaptive", vocab_size=256)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                         enabled=dtype == torch.bfloat16):
        _, cache = model(torch.arange(8)[None], model.empty_cache(1, keys_values=True))
        decoder = kind(model, cache, 8)
        step = decoder.step if kind is Decoder else decoder
        step(3)
        with count_launches.LaunchCounter() as counter:
            log_probs = step(5)
    layers, (per_layer, rest) = len(model.layers), DECODE_LAUNCHES[kind]
    assert counter.total == per_layer * layers + rest, counter.ops.most_common()
    writes = counter.ops["aten.copy_"] + counter.ops["aten.index_copy_"]
    assert counter.ops["aten._to_copy"] == 0 and writes == layers
    assert log_probs.dtype == torch.float32
