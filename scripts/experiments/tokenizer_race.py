"""The same model trained for the same wall-clock on the bundled corpus with bytes, words and
byte-level BPE tokens, each scored in bits per byte on the same validation text.

Usage:
    python scripts/experiments/tokenizer_race.py [--seconds 300] [--out runs/tokenizer-race]
        [--threads N] [--max-chars N]

Runs ``adaspan train`` three times (one after the other, so they do not share the cores), each
with ``time_budget`` seconds, then ``adaspan evaluate`` on the whole valid split of each run
(fp32, 8 streams), and prints one JSON line per run: steps, tokens/s and bytes/s of training,
bits per byte (``bpc_lower_bound``: whether bytes were under ``<unk>``, none for the tokenizers
adaspan trains), perplexity per token, the heads' average and longest span in tokens and in
bytes (at the valid split's average bytes per token), and the share of the valid split's bytes
spelled byte by byte (words outside the vocabulary). ``--threads N`` sets torch's threads of
every run (a shared machine: fewer threads than cores keep others' work from stalling them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from adaspan.run.checkpoint import load_model
from adaspan.run.tokens import outside, run_split, saved_tokenizer

MODEL = ["n_layers=3", "d_model=192", "n_heads=4", "d_inner=768", "max_span=512", "ramp=32",
         "dropout=0.1", "span_loss_coef=2e-6"]
TRAIN = ["data=kjv", "optimizer=adamw", "lr=3e-3", "warmup=100", "clip=1.0", "clip_mode=global",
         "weight_decay=0.01", "batch_size=8", "block_size=64", "steps=1000000",
         "eval_interval=1000000", "checkpoint_interval=1000000", "log_interval=200",
         "eval_chars=8192", "tensorboard=false"]
TOKENS = {
    "bytes": ["tokenizer=bytes", "vocab_size=256"],
    "words": ["tokenizer=words", "vocab_size=8192", "adaptive_io=true", "cutoffs=1024,4096",
              "div_val=4", "tie_io=false"],
    "bpe": ["tokenizer=bpe", "vocab_size=2048"],
}
TOKENS["words-tied"] = [*TOKENS["words"][:-1], "tie_io=true"]  # the authors' tie (not by default)


def adaspan(*args: str) -> str:
    """The standard output of ``adaspan ARGS`` (its errors go to this process's stderr)."""
    done = subprocess.run([sys.executable, "-m", "adaspan.cli", *args], check=True,
                          stdout=subprocess.PIPE, text=True)
    return done.stdout


def race(name: str, out: Path, seconds: float, threads: int | None,
         max_chars: int | None = None) -> dict:
    """Train and score one tokenizer's run (the first ``max_chars`` tokens of the valid split
    where given): its row of the table."""
    run = out / name
    summary = json.loads(adaspan("train", "--run-dir", str(run), "--no-progress", *MODEL,
                                 *TRAIN, *TOKENS[name], f"threads={threads}",
                                 f"time_budget={seconds}").strip().splitlines()[-1])
    limit = ["--max-chars", str(max_chars)] if max_chars else []
    scored = json.loads(adaspan("evaluate", str(run), "--split", "valid", "--no-progress",
                                *limit, "--json").strip().splitlines()[-1])
    split = run_split(run, "valid", progress=False)
    per_token = 1.0 if split.ends is None else float(split.ends[-1]) / len(split.tokens)
    spelled = outside(saved_tokenizer(run), split.tokens, split.ends)[1]
    model = load_model(run)
    spans = [s for layer in model.spans() for s in layer]
    average = sum(spans) / len(spans)
    return {"tokenizer": name, "vocab_size": model.config.vocab_size, "steps": summary["steps"],
            "seconds": summary["elapsed"], "tokens_per_s": summary["chars_per_s"],
            "bytes_per_s": summary["chars_per_s"] * per_token,
            "bits_per_byte": scored["bpc"], "perplexity": scored["perplexity"],
            "bits_per_token": scored["bits_per_token"], "valid_bytes": scored["bytes"],
            "valid_tokens": scored["chars"], "bytes_per_token": per_token,
            "bpc_lower_bound": scored["bpc_lower_bound"], "unk_share": scored["unk_share"],
            "spelled_share": spelled,
            "avg_span_tokens": average, "avg_span_bytes": average * per_token,
            "max_span_tokens": max(spans), "max_span_bytes": max(spans) * per_token,
            "parameters": model.num_parameters(), "precision": summary["precision"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("runs/tokenizer-race"))
    parser.add_argument("--tokenizers", default="bytes,words,bpe",
                        help=f"comma-separated, of {', '.join(TOKENS)}")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--max-chars", type=int,
                        help="score only the first tokens of the valid split (default: all)")
    args = parser.parse_args()
    for name in args.tokenizers.split(","):
        print(json.dumps(race(name, args.out, args.seconds, args.threads, args.max_chars)),
              flush=True)


if __name__ == "__main__":
    main()
