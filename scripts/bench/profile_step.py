"""Where a training step's time goes, and how near the matrix units' rate it runs:
``torch.profiler`` over a few steps of ``adaspan train``'s step
(:func:`adaspan.measure.bench.training_step`: forward, backward, per-tensor clipping, Adagrad)
on the race configuration (4 layers, d 256, 4 heads, FF 1024, S 1024, spans 93/60/56/38, batch
8 x 256), after two warm-up steps. Prints one JSON line:

- ``step_ms``: the median milliseconds of ``--steps`` steps timed without the profiler (which
  slows the step: ``profiled_step_ms``, the mean of the profiled steps, ran ~20% slower on
  the race model at 2 threads);
- ``ops``: the operators taking the most self CPU time, with ms and calls per step, and share;
- ``model_gflops``: the step's model FLOPs rate (the paper's FLOPs, 3 x forward, as
  ``adaspan bench``'s ``train_gflops``);
- ``matmul``: the rate of the step's own products (every ``mm``/``addmm``/``bmm`` shape it ran,
  weighted by FLOPs and calls), timed in this process in bfloat16 and float32;
- ``share``: model_gflops over the bf16 matmul rate (``share_float32``: over the fp32 rate):
  the fraction of the matrix units' rate on these shapes that the step achieves, a figure
  comparable between machines;
- ``products_ms``: the milliseconds per step of the products themselves, each call timed
  where the step runs it (``--steps`` more steps under a ``TorchDispatchMode``), and
  ``share_ceiling``: the share the step would have if everything else took no time (model
  FLOPs over ``products_ms``, over the bf16 matmul rate).

    python scripts/bench/profile_step.py [--steps 5] [--top 15] [--dtype auto] [--compile]
        [--batch 8] [--block 256] [--repeats 5] [--threads N]
        [--model KEY=VALUE ...] [--spans 93,60,56,38]

``--model`` changes the race model (e.g. ``d_model=512 n_heads=8 d_inner=2048 max_span=8192``)
and ``--spans`` sets its spans, cycled over the heads (as ``adaspan bench --spans``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from adaspan.config import ModelConfig, TrainConfig
from adaspan.measure.bench import build_bench_model, seconds, training_step
from adaspan.model.analysis import flops_per_char
from adaspan.resolve import resolve_config
from adaspan.runtime.precision import choose

RACE = ModelConfig(vocab_size=256, d_model=256, n_heads=4, n_layers=4, d_inner=1024,
                   max_span=1024, ramp=32, dropout=0.0)
SHOWN = ("n_layers", "d_model", "n_heads", "d_inner", "max_span", "ramp")  # printed
PRODUCTS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1)}  # operand indices


def products(events, steps: int) -> dict[tuple[tuple[int, ...], tuple[int, ...]], float]:
    """The step's matrix products: operand shapes -> calls per step."""
    found: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
    for event in events:
        if event.key in PRODUCTS and event.input_shapes:
            a, b = (tuple(event.input_shapes[i]) for i in PRODUCTS[event.key])
            found[a, b] = found.get((a, b), 0.0) + event.count / steps
    return found


class ProductClock(TorchDispatchMode):
    """Seconds spent in the matrix products (:data:`PRODUCTS`, and ``baddbmm``) of what runs
    under it, forward and backward, each call timed alone."""

    NAMES = {name.removeprefix("aten::") for name in PRODUCTS} | {"baddbmm"}

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in self.NAMES:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds += time.perf_counter() - start
        return out


def model_config(items: list[str]) -> ModelConfig:
    """:data:`RACE` with ``KEY=VALUE`` fields changed, read as ``adaspan`` reads them."""
    return resolve_config(overrides=items, base=(RACE, TrainConfig()))[0]


def _seconds(step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def matmul_rate(shapes: dict, dtype: torch.dtype, repeats: int) -> float:
    """GFLOP/s of the products ``shapes`` in ``dtype``, each weighted by its calls per step."""
    flops = total = 0.0
    for (a, b), calls in shapes.items():
        x, y = torch.randn(a, dtype=dtype), torch.randn(b, dtype=dtype)
        product = 2 * math.prod(a) * b[-1]
        flops += calls * product
        total += calls * seconds(lambda x=x, y=y: x @ y, repeats, None)
    return flops / total / 1e9 if total else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timings of each product")
    parser.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="fields of the race model to change")
    parser.add_argument("--spans", default="93,60,56,38", help="cycled over the heads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = model_config(args.model)
    model = build_bench_model(config, args.spans, torch.device("cpu"))
    if args.compile:
        model.compile_dense()
    precision = choose(args.dtype, torch.device("cpu"), "train")
    step = training_step(model, args.batch, args.block, precision)
    for _ in range(2):  # warm-up (and compile)
        step()
    elapsed = statistics.median(_seconds(step) for _ in range(args.steps))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        profiled = (time.perf_counter() - start) / args.steps
    with ProductClock() as clock:
        for _ in range(args.steps):
            step()
    products_s = clock.seconds / args.steps
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    shapes = products(prof.key_averages(group_by_input_shape=True), args.steps)
    rates = {name: matmul_rate(shapes, dtype, args.repeats)
             for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))}
    model_gflop = 2 * 3 * flops_per_char(model, args.block) * args.batch * args.block / 1e9
    model_gflops = model_gflop / elapsed
    print(json.dumps({
        "precision": precision.describe(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "spans": args.spans,
        "model": {key: getattr(config, key) for key in SHOWN},
        "step_ms": 1e3 * elapsed, "profiled_step_ms": 1e3 * profiled,
        "model_gflops": model_gflops,
        "matmul": {f"{name}_gflops": rate for name, rate in rates.items()}
        | {"shapes": len(shapes)},
        "share": model_gflops / rates["bfloat16"],
        "share_float32": model_gflops / rates["float32"],
        "products_ms": 1e3 * products_s,
        "share_ceiling": model_gflop / products_s / rates["bfloat16"],
        "ops": [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / args.steps,
                 "calls_per_step": e.count / args.steps,
                 "share": e.self_cpu_time_total / total} for e in events[: args.top]],
    }))


if __name__ == "__main__":
    main()
