"""``adaspan retrofit``: learned spans for a frozen Hugging Face causal LM."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import torch

from ..config import (
    LOSSES,
    LR_SCHEDULES,
    PENALTIES,
    RETRIEVAL_LOSSES,
    RETROFIT_OPTIMIZERS,
    RetrofitConfig,
)
from ..data.corpora import resolve_data
from ..runtime.distributed import Distributed, resolve_device
from ..runtime.precision import choose
from .options import (
    add_output,
    add_runtime,
    command,
    json_line,
    positive_float,
    positive_int,
)


def add_retrofit(commands) -> None:

    p = command(commands, "retrofit", _retrofit)
    p.add_argument("model_dir", type=Path, metavar="MODEL_DIR",
                   help="a Hugging Face causal LM and its tokenizer (save_pretrained)")
    p.add_argument("--data", required=True, metavar="TEXT", help="text file (plain, .gz or "
                   ".zip) or corpus name: spans learn on its train split, the report scores "
                   "its valid split (adaspan's 90/5/5 split)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR",
                   help="new directory: the model with its spans, the report, the checkpoint")
    default = RetrofitConfig("", "", "")
    p.add_argument("--max-span", type=positive_int, help="S (default: --context)")
    p.add_argument("--ramp", type=positive_int, default=default.ramp, help="ramp R")
    p.add_argument("--context", type=positive_int, default=default.context,
                   help="tokens per window (training, scoring and decoding)")
    p.add_argument("--steps", type=positive_int, default=default.steps,
                   help="optimiser steps of the spans")
    p.add_argument("--batch-size", type=positive_int, default=default.batch_size,
                   help="windows per step")
    p.add_argument("--micro-batch", type=positive_int, metavar="N", help="windows per "
                   "forward and backward, the step's gradient summed over them: the same steps "
                   "in the memory of N windows (default: the whole batch at once)")
    p.add_argument("--lr", type=positive_float, default=default.lr, help="the optimiser's "
                   "learning rate on z'")
    p.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=default.lr_schedule,
                   help="constant, or a cosine or linear decay to lr * --lr-end-factor at "
                   "the last step")
    p.add_argument("--lr-end-factor", type=float, default=default.lr_end_factor,
                   help="cosine and linear: the factor of --lr at the last step")
    p.add_argument("--lr-decay-steps", type=positive_int,
                   help="cosine and linear: decay over the last N steps only, --lr before "
                   "them (default: all steps)")
    p.add_argument("--average-steps", type=positive_int, metavar="N",
                   help="keep the mean of z' over the last N steps, not the last step's "
                   "(Polyak averaging: Adam's steps leave z' wandering; default: the last)")
    p.add_argument("--optimizer", choices=RETROFIT_OPTIMIZERS, default=default.optimizer,
                   help="adam; sgd: each step in proportion to the gradient, so that the "
                   "penalty's scale sets how fast spans shrink")
    p.add_argument("--span-loss", type=float, default=default.span_loss,
                   help="lambda of the span penalty lambda/M * sum z")
    p.add_argument("--loss", choices=LOSSES, default=default.loss, help="distill: KL to the "
                   "frozen model with full attention; lm: the text's NLL; both: their sum")
    p.add_argument("--seed", type=int, default=default.seed,
                   help="the windows of each step are drawn from (seed, step)")
    p.add_argument("--checkpoint-interval", type=positive_int,
                   default=default.checkpoint_interval, help="steps between checkpoints")
    p.add_argument("--per-kv-head", action="store_true", help="one span per key/value head, "
                   "shared by its query heads (the penalty counts the cache held)")
    _add_method_options(p, default)
    p.add_argument("--resume", action="store_true", help="continue the retrofit in --out")
    p.add_argument("--shard", action="store_true", help="under torchrun, also shard the frozen "
                   "weights over the processes (FSDP2), for a model larger than one device; "
                   "every process then takes part in the report")
    p.add_argument("--eval-bytes", type=positive_int, default=65536,
                   help="held-out bytes the report scores")
    p.add_argument("--decode-tokens", type=positive_int, default=64,
                   help="tokens decoded at the full context for the speed")
    add_runtime(p, "bf16 for training where the device has fast bf16, fp32 for the report")
    add_output(p, "print the report as JSON", progress=True)


def _add_method_options(p: argparse.ArgumentParser, default: RetrofitConfig) -> None:
    """What trains (spans or DuoAttention's gates), its sinks and penalty, and the share of
    retrieval prompts in the training windows."""
    p.add_argument("--method", default=default.method, help="spans: an adaptive span per head; "
                   "duo: DuoAttention's gate per key/value head (full or streaming attention)")
    p.add_argument("--sinks", type=int, default=default.sinks, help="the first positions "
                   "every query reads whatever its span (attention sinks)")
    p.add_argument("--penalty", choices=PENALTIES, default=default.penalty, help="the span "
                   "loss's lambda: per head (lambda/M), or bits of loss per byte of bf16 cache")
    p.add_argument("--cache-ratio", type=positive_float, metavar="RATIO",
                   help="spans: a budget of RATIO times less cache than full attention's at "
                   "--context positions, reached where the rate starts to decay (or at the "
                   "last step): lambda is scaled up while the spans hold more, and the last "
                   "step lowers every z to meet it")
    p.add_argument("--reallocate", type=int, default=default.reallocate, metavar="ROUNDS",
                   help="spans: after the last step, up to ROUNDS rounds moving positions "
                   "from the head whose loss rises least without them to the head whose "
                   "loss falls most with them, each move kept if the measured loss falls; "
                   "the cache held never grows (default: 0, none)")
    p.add_argument("--reallocate-batches", type=positive_int,
                   default=default.reallocate_batches, metavar="N", help="the moves of "
                   "--reallocate are measured on the windows of N steps after the last "
                   "(default: 2)")
    p.add_argument("--reallocate-guard", type=int, default=default.reallocate_guard,
                   metavar="N", help="a move of --reallocate is kept only if it does not "
                   "raise the loss of N batches of retrieval prompts either "
                   "(--retrieval-tasks, of the steps after those windows; default: 0, none)")
    p.add_argument("--retrieval", type=float, default=default.retrieval, help="share of each "
                   "step's windows that are retrieval prompts with their answers (a whole "
                   "number of the batch)")
    p.add_argument("--retrieval-tasks", default=default.retrieval_tasks, help="their tasks "
                   "(adaspan longeval's), comma-separated")
    p.add_argument("--retrieval-loss", choices=RETRIEVAL_LOSSES, default=default.retrieval_loss,
                   help="what of a retrieval prompt the loss scores: the positions that "
                   "predict its answer (their mean, or answer_sum: their sum), or all")
    p.add_argument("--retrieval-far", type=float, default=default.retrieval_far,
                   help="share of the retrieval prompts with the needle in the first tenth "
                   "of the haystack, farthest from the question (the rest anywhere)")
    p.add_argument("--retrieval-min-length", type=positive_int,
                   default=default.retrieval_min_length, help="the shortest retrieval prompt "
                   "in tokens: each prompt's length is drawn uniformly from it to the context "
                   "(default: every prompt fills the context)")
    p.add_argument("--retrieval-far-full", type=float, default=default.retrieval_far_full,
                   help="with --retrieval-min-length: the share of the prompts with the needle "
                   "in the haystack's first tenth that fill the context (default 1: all)")
    p.add_argument("--retrieval-weight", type=float, default=default.retrieval_weight,
                   help="a retrieval prompt's weight in the loss, a window of text's being 1 "
                   "(default 1)")
    p.add_argument("--streaming-window", type=positive_int, default=default.streaming_window,
                   help="duo: the recent positions a streaming head reads")


def _retrofit(args: argparse.Namespace) -> int:
    """Learn a span per head for a frozen Hugging Face causal LM.

    Freeze every weight of MODEL_DIR, attach an adaptive span to each attention layer (at
    its full span S) and train only the spans: distillation towards the model's own
    full-attention outputs (and/or the text's loss) plus the span penalty. Writes to --out the
    model with its spans (adaspan.hf.load_pretrained reads it) and a report, retrofit.json and
    retrofit.md: spans per head, held-out bits per byte, key/value cache bytes and decode
    speed, with full attention and with the spans (see docs/retrofit.md). Under torchrun the
    processes share each step's windows and rank 0 alone writes."""
    from ..hf import duo  # noqa: F401 (registers the method duo)
    from ..hf.report import markdown, write

    config = RetrofitConfig(
        model_dir=str(args.model_dir.resolve()), data=resolve_data(args.data),
        out=str(args.out.resolve()),
        **{f.name: getattr(args, f.name) for f in fields(RetrofitConfig)
           if f.name not in ("model_dir", "data", "out")})
    dist = Distributed.from_env()
    device = _process_device(args.device, dist)
    with dist.joined(device):  # a sharded model is measured by the processes together
        report = _retrofit_and_measure(config, args, device, dist)
    if report is not None:
        write(args.out, report)
        print(json_line(report) if args.json else markdown(report),
              end="\n" if args.json else "")
    return 0


def _retrofit_and_measure(config: RetrofitConfig, args: argparse.Namespace,
                          device: torch.device, dist: Distributed) -> dict | None:
    """The retrofit, then its report: measured by rank 0 alone, or by every process where the
    frozen weights are sharded; None on the ranks other than 0."""
    from ..hf.duo import GATES_FILE, read_gates
    from ..hf.report import measure_retrofit
    from ..hf.retrofit import retrofit

    trained = choose(args.dtype, device, "train")
    run = retrofit(config, trained, args.resume, progress=not args.no_progress,
                   shard=args.shard)
    if not run.method.report:  # duo: the gates, for the cache policy duo of adaspan longeval
        if dist.is_main:
            print(json_line({"method": config.method, "gates": str(args.out / GATES_FILE),
                             **read_gates(args.out)}))
        return None
    if not (dist.is_main or args.shard):
        return None
    report = measure_retrofit(run, choose(args.dtype, device, "score"), args.eval_bytes,
                              args.decode_tokens, trained=trained)
    return report if dist.is_main else None


def _process_device(device: torch.device, dist: Distributed) -> torch.device:
    """This process's device: under torchrun, ``--device cuda`` (or auto, read as GPU 0 before
    the command ran) is the GPU of its local rank; another numbered GPU is refused, as by
    train."""
    if not (dist.active and device.type == "cuda"):
        return device
    name = "cuda" if device.index == 0 else str(device)
    return resolve_device(name, dist.local_rank, dist.world_size)
