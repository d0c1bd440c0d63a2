"""Retrofit a Hugging Face causal LM at several span penalties and print, per penalty, what the
learned spans cost and save (``adaspan retrofit``'s report: held-out bits per byte, key/value
cache bytes and decode tokens/s, each with full attention and with the spans, side by side),
as one JSON document.

    python scripts/experiments/retrofit_experiment.py /work/evidence/llama \
        --data /work/shared/corpora/gcide.txt.gz --out /work/evidence/retrofit \
        --span-losses 1e-3,3e-3 --steps 200 --lock /tmp/adaspan-bench.lock

Training and scoring run without the lock; the decode timings run holding ``--lock`` (``flock``),
so that it never overlaps another benchmark that takes the same lock. Finished retrofits in
``--out`` are measured again, not retrained: ``--train-only`` runs in parallel, then one call
that measures them all one after the other.
"""

from __future__ import annotations

import argparse
import fcntl
import json
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from adaspan.config import RetrofitConfig
from adaspan.data.corpora import resolve_data
from adaspan.hf.report import measure_retrofit, write
from adaspan.hf.retrofit import STATE_FILE, retrofit
from adaspan.runtime.precision import choose


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("model_dir", type=Path)
    add("--data", required=True)
    add("--out", type=Path, required=True, help="one retrofit per penalty under this folder")
    add("--span-losses", default="1e-3", help="lambdas, separated by commas")
    add("--steps", type=int, default=200)
    add("--context", type=int, default=1024)
    add("--ramp", type=int, default=32)
    add("--batch-size", type=int, default=4)
    add("--lr", type=float, default=0.02)
    add("--loss", default="distill")
    add("--eval-bytes", type=int, default=65536)
    add("--decode-tokens", type=int, default=64)
    add("--rounds", type=int, default=3)
    add("--dtype", default="auto")
    add("--lock", type=Path, help="flock this file while measuring")
    add("--train-only", action="store_true", help="train the spans, measure nothing")
    return parser.parse_args(argv)


@contextmanager
def locked(path: Path):
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def summary(report: dict) -> dict:
    """The figures of a report that the experiment compares."""
    held, cache = report["heldout"], report["cache"]
    kv, speed = cache["kv_bytes"], cache["tokens_per_s"]
    return {"spans": report["spans"], "bits_per_byte": held["full"]["bits_per_byte"],
            "bits_per_byte_spans": held["spans"]["bits_per_byte"],
            "bits_per_byte_change": held["bits_per_byte_change"],
            "kv_bytes": kv["full"], "kv_bytes_spans": kv["spans"],
            "kv_smaller": kv["full"] / kv["spans"], "tokens_per_s": speed["full"],
            "tokens_per_s_spans": speed["spans"], "speedup": speed["spans"] / speed["full"],
            "context": cache["context"], "precision": report["precision"],
            "versions": report["versions"]}


def run_one(args: argparse.Namespace, span_loss: float) -> dict:
    out = args.out / f"lambda-{span_loss:g}"
    config = RetrofitConfig(str(args.model_dir.resolve()), resolve_data(args.data),
                            str(out.resolve()), ramp=args.ramp, context=args.context,
                            steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                            span_loss=span_loss, loss=args.loss)
    cpu = torch.device("cpu")
    trained = choose(args.dtype, cpu, "train")
    run = retrofit(config, trained, resume=(out / STATE_FILE).is_file(), progress=False)
    if args.train_only:
        return {"span_loss": span_loss, "steps": run.step}
    report = measure_retrofit(run, choose(args.dtype, cpu, "score"), args.eval_bytes,
                              args.decode_tokens, args.rounds,
                              locked(args.lock) if args.lock else nullcontext(),
                              trained=trained)
    write(out, report)
    return {"span_loss": span_loss, "steps": run.step, **summary(report)}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    results = [run_one(args, float(value)) for value in args.span_losses.split(",")]
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
