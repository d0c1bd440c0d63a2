"""Kernel launches of one training step, one evaluation block and one generated token, counted
on the CPU.

    python scripts/bench/count_launches.py [--kernel fused|grouped] [--layers 12 --d 512 --heads 8
        --span 8192 --block 512 --spans 32,32,48,...] [--run]

On a GPU nearly every ATen operator is one kernel launch, views excepted (they launch nothing),
so the count bounds a step's host time from below (~5-10 us a launch) whatever its FLOPs. A
training step is the forward and backward pass of the mean log-probability plus the span
penalty (no optimiser step), with hidden states cached; an evaluation block a forward pass
under ``no_grad`` with a key/value cache; a generated token one step of each decoder of
:mod:`adaspan.model.decode` (``decode``: the CPU's :class:`Decoder`; ``static_decode``: the
:class:`StaticDecoder` that CUDA captures in a graph, its token's write included) after a
prompt of 16 tokens; each counted after one warm-up call. The count is
that of the ATen operators (views excluded) plus each launch of a Triton kernel of
:mod:`adaspan.attention.fused`; those are not run (their outputs are left unset) unless ``--run``
(Triton's interpreter on the CPU: slow). ``--kernel`` picks the path of every layer
(:func:`adaspan.attention.span_attention.use_kernel`): ``fused``, the one CUDA takes;
``grouped``, the CPU's. Defaults: the paper's small model with spans spread from 32 to 4096,
batch 1. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adaspan import ModelConfig, SpanLM
from adaspan.attention import fused
from adaspan.attention.span_attention import use_kernel
from adaspan.model.decode import Decoder, StaticDecoder

# ATen operators that only make views: no kernel on a GPU
VIEWS = {"detach", "view", "_unsafe_view", "alias", "t", "expand", "unsqueeze", "squeeze",
         "permute", "transpose", "slice", "select", "as_strided", "unflatten", "split", "unbind",
         "split_with_sizes", "_reshape_alias", "reshape", "flatten", "narrow", "diagonal",
         "lift_fresh", "view_as"}
PAPER_SPANS = "32,32,48,64,96,128,256,512,1024,2048,32,40,64,160,320,4096"


class LaunchCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched (views excluded) and the fused kernels' launches,
    by name (``ops``); ``run`` says whether those kernels run."""

    def __init__(self, run: bool = False) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.run = run
        self._launches = fused.observe_launches(self._launch)

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def _launch(self, name: str) -> bool:
        self.ops[f"triton.{name}"] += 1
        return self.run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name.split(".", 1)[-1] not in VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> LaunchCounter:
        self._launches.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._launches.__exit__(*exc)


def model_of(layers: int, d: int, heads: int, span: int, spans: list[int]) -> SpanLM:
    """``SpanLM`` at this shape, its heads given ``spans`` in turn (R 32, no dropout,
    feed-forward 4 d), seeded."""
    torch.manual_seed(0)
    config = ModelConfig(d_model=d, n_heads=heads, n_layers=layers, d_inner=4 * d,
                         max_span=span, attention="adaptive", dropout=0.0)
    model = SpanLM(config)
    model.set_spans([[spans[(i * heads + h) % len(spans)] for h in range(heads)]
                     for i in range(layers)])
    return model


def build(layers: int, d: int, heads: int, span: int, spans: list[int], block: int,
          batch: int, kernel: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """A training step and an evaluation block of :func:`model_of`'s model, every layer on
    ``kernel``."""
    model = model_of(layers, d, heads, span, spans)
    use_kernel(model, kernel)
    tokens = torch.randint(0, model.config.vocab_size, (batch, block))

    def train() -> None:
        log_probs, _ = model(tokens, model.empty_cache(batch))
        (log_probs.mean() + model.span_loss()).backward()

    def evaluate() -> None:
        with torch.no_grad():
            model(tokens, model.empty_cache(batch, keys_values=True))

    return train, evaluate


@torch.no_grad()
def decode_steps(model: SpanLM) -> dict[str, Callable[[], None]]:
    """A generated token of each decoder, by name, after a prompt of 16 tokens (eval mode)."""
    model.eval()
    _, cache = model(torch.arange(16)[None], model.empty_cache(1, keys_values=True))
    steps = {"decode": Decoder(model, cache, 16).step,
             "static_decode": StaticDecoder(model, cache, 16)}
    return {name: torch.no_grad()(functools.partial(step, 1)) for name, step in steps.items()}


def count(step: Callable[[], None], run: bool = False) -> LaunchCounter:
    """The launches of ``step``, after one warm-up call (spans read, head groups made)."""
    with fused.observe_launches(lambda name: run):
        step()
    with LaunchCounter(run) as counter:
        step()
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", default="fused", choices=["fused", "grouped"])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--span", type=int, default=8192)
    parser.add_argument("--spans", default=PAPER_SPANS)
    parser.add_argument("--block", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--run", action="store_true", help="run the Triton kernels (slow)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spans = [int(s) for s in args.spans.split(",")]
    shape = args.layers, args.d, args.heads, args.span, spans
    train, evaluate = build(*shape, args.block, args.batch, args.kernel)
    result = {"shape": vars(args)}
    for name, step in (("train", train), ("eval", evaluate)):
        counter = count(step, args.run)
        result[f"{name}_launches"] = counter.total
        result[f"{name}_top"] = counter.ops.most_common(10)
        result[f"{name}_slice_backward"] = counter.ops["aten.slice_backward"]
    for name, step in decode_steps(model_of(*shape)).items():
        result[f"{name}_launches"] = count(step).total
    print(json.dumps(result))


if __name__ == "__main__":
    main()
