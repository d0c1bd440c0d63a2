"""Learned spans against the key/value-cache methods users would pick instead, on long-context
retrieval at one cache budget, side by side on one model, and print the comparison as JSON.

    python scripts/experiments/retrieval_budget.py /work/evidence/llama-retrieval \
        --data /work/shared/corpora/gcide.txt.gz --haystack kjv --out /work/evidence/budget \
        --context 4096 --lengths 2048,4096 --steps 60 --span-loss 1e-5

1. ``adaspan retrofit`` learns spans (``--method spans``, penalty per byte of cache, sinks, one
   span per key/value head; ``--span-optimizer``, ``--span-lr``, ``--cache-ratio``,
   ``--average-steps``, ``--reallocate``, ``--reallocate-guard``) and
   DuoAttention's gates (``--method duo``, Adam at ``--lr``) with the same data and steps:
   windows of ``--data`` of which ``--retrieval`` are ``--retrieval-tasks`` prompts (pass key
   alone by default).
2. The budget is the mean of the bytes the spans' cache holds after the longest prompts.
3. ``adaspan longeval`` scores, on the ``--haystack`` text (which the spans did not train on)
   and every task (most of which they did not see): the model with full attention (``full``),
   with its spans (``spans``), and at the spans' budget StreamingLLM (``streaming``),
   DuoAttention's binarised heads (``duo``) and SnapKV (``snapkv``); ``--policies`` scores
   fewer of the three.

4. Held-out bits per byte, as the retrofit's report scores them, with full attention, the spans,
   and StreamingLLM's and DuoAttention's windows at the budget (``heldout``). SnapKV picks its
   keys after a prompt; text scored token by token has none, so it is not scored.

Output: ``--out`` holds each run (``spans/``, ``duo/``, ``eval-POLICY/`` with the heatmaps) and
``retrieval_budget.json``: per policy the mean accuracy per task and length, the bytes held,
the prompts it lost and gained against full attention on the same prompts with the sign test's
p (``against_full``); ``heldout``; and the spans' retrofit report (the spans and their
history, held-out bits per byte, decode speed).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path

import torch

from adaspan.cli import main as adaspan
from adaspan.config import LR_SCHEDULES, RETRIEVAL_LOSSES, RETROFIT_OPTIMIZERS, RetrofitConfig
from adaspan.hf.cache_policies import build_policy
from adaspan.hf.longeval import load_model_dir, paired
from adaspan.hf.report import heldout as heldout_ids
from adaspan.hf.report import policy_quality

POLICIES = ("full", "spans", "streaming", "duo", "snapkv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("model_dir", type=Path, help="a Hugging Face causal LM trained with full attention")
    add("--data", required=True, help="the text of the retrofits' windows and haystacks")
    add("--haystack", required=True, help="the text of the evaluation's haystacks")
    add("--out", type=Path, required=True)
    add("--context", type=int, default=4096)
    add("--lengths", default="2048,4096")
    add("--depths", default="0,0.25,0.5,0.75,1")
    add("--tasks", default="passkey,single_needle,multi_key,multi_value,variable_tracking")
    add("--samples", type=int, default=2)
    add("--steps", type=int, default=60)
    add("--batch-size", type=int, default=2)
    add("--micro-batch", type=int, help="windows per forward and backward in both retrofits "
        "(adaspan retrofit --micro-batch; memory only)")
    add("--span-loss", type=float, default=1e-5, help="bits of loss per byte of cache")
    add("--duo-loss", type=float, default=0.05, help="DuoAttention's L1 coefficient")
    add("--lr", type=float, default=0.02)
    add("--lr-schedule", choices=LR_SCHEDULES, default="constant",
        help="both methods' learning-rate schedule (adaspan retrofit --lr-schedule)")
    add("--lr-decay-steps", type=int, help="the schedule decays over the last N steps "
        "(adaspan retrofit --lr-decay-steps; default: all)")
    add("--span-optimizer", choices=RETROFIT_OPTIMIZERS, default="adam",
        help="the spans' optimiser (DuoAttention's gates keep Adam)")
    add("--span-lr", type=float, help="the spans' learning rate (default: --lr)")
    add("--ramp", type=int, default=RetrofitConfig.ramp, help="the spans' ramp R")
    add("--seed", type=int, help="both retrofits' windows are drawn from (seed, step) "
        "(adaspan retrofit --seed; default: its own)")
    add("--cache-ratio", type=float, help="the spans' cache held RATIO times smaller than full "
        "attention's at the context (adaspan retrofit --cache-ratio; default: no bound)")
    add("--average-steps", type=int, help="the spans keep the mean of z' over the last N "
        "steps (adaspan retrofit --average-steps; default: the last step's)")
    add("--reallocate", type=int, help="the spans' rounds of moves between heads after the "
        "last step (adaspan retrofit --reallocate; default: none)")
    add("--reallocate-guard", type=int, help="batches of retrieval prompts whose loss a move "
        "may not raise (adaspan retrofit --reallocate-guard; default: none)")
    add("--sinks", type=int, default=4)
    add("--streaming-window", type=int, default=256)
    add("--retrieval", type=float, default=0.5)
    add("--retrieval-tasks", default="passkey")
    add("--retrieval-loss", choices=RETRIEVAL_LOSSES, default=RetrofitConfig.retrieval_loss)
    add("--retrieval-far", type=float, default=0.0,
        help="share of the retrieval prompts with the needle in the haystack's first tenth")
    add("--retrieval-min-length", type=int, help="the shortest retrieval prompt in tokens "
        "(lengths uniform from it to the context; default: the context)")
    add("--retrieval-far-full", type=float, default=1.0, help="the share of the prompts with "
        "the needle in the first tenth that fill the context anyway")
    add("--retrieval-weight", type=float, default=1.0, help="a retrieval prompt's weight in "
        "the loss, a window of text's being 1")
    add("--policies", default=",".join(POLICIES), help="the policies scored, comma-separated "
        "(full and spans always; duo's retrofit runs only for duo)")
    add("--eval-bytes", type=int, default=65536)
    add("--decode-tokens", type=int, default=64)
    add("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    args = parser.parse_args(argv)
    chosen = set(args.policies.split(",")) | {"full", "spans"}
    if chosen - set(POLICIES):
        parser.error(f"--policies: unknown {', '.join(sorted(chosen - set(POLICIES)))}; "
                     f"the policies are {', '.join(POLICIES)}")
    args.policies = [name for name in POLICIES if name in chosen]
    return args


def run(*argv: str) -> dict:
    """``adaspan ARGV --json``'s output, parsed (a failure stops the script)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = adaspan([*argv, "--json", "--no-progress"])
    if status:
        raise SystemExit(f"adaspan {' '.join(argv)} failed with status {status}")
    return json.loads(out.getvalue().strip().splitlines()[-1])


def retrofit(args: argparse.Namespace, method: str, coef: float) -> dict:
    """The retrofit of ``method`` into ``--out/method`` (kept when already there)."""
    out = args.out / method
    if (out / ("duo_gates.json" if method == "duo" else "retrofit.json")).exists():
        return (json.loads((out / "retrofit.json").read_text()) if method == "spans"
                else {"gates": str(out)})
    spans = method == "spans"
    optimizer = args.span_optimizer if spans else "adam"
    lr = args.span_lr if spans and args.span_lr else args.lr
    return run("retrofit", str(args.model_dir), "--data", args.data, "--out", str(out),
               "--method", method, "--context", str(args.context), "--steps", str(args.steps),
               "--ramp", str(args.ramp), "--retrieval-loss", args.retrieval_loss,
               "--batch-size", str(args.batch_size), "--lr", str(lr), "--optimizer",
               optimizer, "--span-loss",
               str(coef), "--penalty", "byte", "--per-kv-head", "--sinks", str(args.sinks),
               "--streaming-window", str(args.streaming_window), "--retrieval",
               str(args.retrieval), "--retrieval-tasks", args.retrieval_tasks,
               "--retrieval-far", str(args.retrieval_far), "--eval-bytes",
               str(args.eval_bytes), "--decode-tokens", str(args.decode_tokens), "--threads",
               str(args.threads), "--retrieval-far-full", str(args.retrieval_far_full),
               "--retrieval-weight", str(args.retrieval_weight),
               "--lr-schedule", args.lr_schedule,
               *given(args, "retrieval_min_length", "lr_decay_steps", "seed", "micro_batch"),
               *(given(args, "cache_ratio", "average_steps", "reallocate",
                           "reallocate_guard") if spans else ()))


def given(args: argparse.Namespace, *names: str) -> list[str]:
    """The options among ``names`` given on the command line, as ``adaspan`` arguments: those
    left out take ``adaspan retrofit``'s defaults, and a bad value (0 too) is its error."""
    return [item for name in names if getattr(args, name) is not None
            for item in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def longeval(args: argparse.Namespace, model: Path, cache: str, name: str) -> dict:
    return run("longeval", str(model), "--haystack", args.haystack, "--tasks", args.tasks,
               "--lengths", args.lengths, "--depths", args.depths, "--samples",
               str(args.samples), "--cache", cache, "--out", str(args.out / f"eval-{name}"),
               "--threads", str(args.threads))


def heldout(args: argparse.Namespace, specs: dict[str, str]) -> dict:
    """Held-out bits per byte (the first ``--eval-bytes`` of ``--data``'s valid split, as the
    retrofit's report scores them) with full attention, the spans, and StreamingLLM's and
    DuoAttention's hard windows at the budget; each policy's change against full attention."""
    if args.threads:
        torch.set_num_threads(args.threads)
    base, tokenizer = load_model_dir(args.model_dir, torch.device("cpu"))
    ids, n_bytes = heldout_ids(args.data, tokenizer, args.eval_bytes)
    models = {"full": (base, "full"), "spans": (load_model_dir(args.out / "spans",
                                                               torch.device("cpu"))[0], "spans"),
              **{name: (base, specs[name]) for name in ("streaming", "duo")
                 if name in args.policies}}
    scores = {name: policy_quality(model, build_policy(spec, model), ids, n_bytes,
                                   args.context) for name, (model, spec) in models.items()}
    full = scores["full"]["bits_per_byte"]
    return {name: {**score, "change": score["bits_per_byte"] / full - 1}
            for name, score in scores.items()}


def summary(result: dict, full: dict) -> dict:
    """Per task and length the mean accuracy over depths; per length the bytes held; per task
    and length the prompts lost and gained against full attention on the same prompts."""
    against = {} if result is full else {"against_full": paired(full["prompts"],
                                                                result["prompts"])}
    return {"accuracy": {task: {n: cell["mean"] for n, cell in lengths.items()}
                         for task, lengths in result["results"].items()},
            "kv_bytes": {n: cell["kv_bytes"] for n, cell in result["mean"].items()},
            "mean": {n: cell["accuracy"] for n, cell in result["mean"].items()}, **against}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = retrofit(args, "spans", args.span_loss)
    if "duo" in args.policies:
        retrofit(args, "duo", args.duo_loss)
    evaluated = {"full": longeval(args, args.model_dir, "full", "full"),
                 "spans": longeval(args, args.out / "spans", "spans", "spans")}
    longest = args.lengths.split(",")[-1]
    budget = evaluated["spans"]["mean"][longest]["kv_bytes"]
    specs = {"streaming": f"streaming:budget={budget},sinks={args.sinks}",
             "duo": f"duo:gates={args.out / 'duo'},budget={budget}",
             "snapkv": f"snapkv:bytes={budget}"}
    for name in (name for name in args.policies if name in specs):
        evaluated[name] = longeval(args, args.model_dir, specs[name], name)
    result = {"model": str(args.model_dir), "budget_bytes": budget, "at_length": longest,
              "options": {k: str(v) for k, v in vars(args).items()},
              "retrofit": {k: report.get(k) for k in ("spans", "history", "heldout", "cache")},
              "heldout": heldout(args, specs),
              "policies": {name: {"cache": evaluated[name]["cache"],
                                  **summary(evaluated[name], evaluated["full"])}
                           for name in args.policies}}
    (args.out / "retrieval_budget.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
