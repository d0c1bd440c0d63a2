"""Train a small Hugging Face ``LlamaForCausalLM`` (rotary positions, grouped-query attention,
full attention) on a text corpus with byte tokens, and save it with its tokenizer, ready for
``adaspan retrofit``.

    OMP_NUM_THREADS=1 nice -n 19 python scripts/experiments/train_hf_model.py \
        --data /work/shared/corpora/gcide.txt.gz --out /work/evidence/llama --minutes 35

The corpus is read and split by adaspan (``load_corpus``: 90/5/5, contiguous); training reads
random windows of ``--context`` bytes of the train split, validation scores the first
``--valid-bytes`` of the valid split in windows of ``--context``. Tokens are bytes: the model
directory holds a ``ByT5Tokenizer`` (byte b is id b + 3 after pad, eos, unk), so
``AutoTokenizer.from_pretrained(out)`` encodes text as the model was trained. Each log line is
one JSON record (step, seconds, loss in bits per byte, learning rate).

With ``--retrieval P`` a share P of the steps trains on synthetic retrieval prompts instead
(``adaspan.hf.needles``: ``--tasks``, by default pass-key and single needle), each followed by
its answer, at lengths drawn from ``--lengths``, with haystacks from the train split (the first
``--haystack-bytes``), depths uniform in [0, 1] (a share ``--far`` of them in [0, 0.1]) and
seeds from 10**6 on (evaluation seeds start at 0); a step holds about ``--tokens-per-step``
tokens (rows = tokens / length), and the answer's tokens weigh ``--answer-weight`` in the loss
(the log's ``marked_nll``: their mean NLL).

With ``--copy P`` a share P of the steps trains on copies instead: windows of ``--copy-length``
tokens of the train split in which stretches of 8 to 32 tokens (one per 64 tokens) are
written again further on, at random distances: a copy is predictable only by finding its
first tokens earlier (what induction heads do, the mechanism of retrieval), not by looking a
fixed distance back. About ``--tokens-per-step`` tokens a step; the copies' tokens after their
first weigh ``--answer-weight`` (``marked_nll``: their mean NLL).

The result (printed last, as JSON) holds, per kind of marked step, the mean ``marked_nll`` of
the last tenth of those steps: whether the copies and the answers were learned by the end.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from adaspan.data.corpora import load_corpus
from adaspan.hf.needles import Haystack, draw_depth, make

OFFSET = 3  # ByT5: pad 0, eos 1, unk 2, then the 256 bytes
TRAIN_SEEDS = 10**6  # retrieval prompts of training draw their seeds from here on


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--data", required=True, help="corpus: a text file (plain or .gz) or adaspan corpus name")
    add("--out", type=Path, required=True, help="directory of the saved model and tokenizer")
    add("--context", type=int, default=1024)
    add("--d-model", type=int, default=256)
    add("--layers", type=int, default=4)
    add("--heads", type=int, default=8)
    add("--kv-heads", type=int, default=2)
    add("--d-ff", type=int, default=688)
    add("--batch-size", type=int, default=4)
    add("--lr", type=float, default=2e-3)
    add("--warmup", type=int, default=100)
    add("--steps", type=int, default=1000, help="steps of the schedule (linear decay to 0)")
    add("--minutes", type=float, default=None, help="stop (and save) after this wall time")
    add("--log-every", type=int, default=10)
    add("--save-every", type=int, default=200)
    add("--valid-bytes", type=int, default=65536)
    add("--threads", type=int, default=1, help="torch's CPU threads (0: its default)")
    add("--bf16", action="store_true", help="bf16 autocast (fast where the CPU has bf16)")
    add("--seed", type=int, default=0)
    add("--retrieval", type=float, default=0.0, help="share of steps on retrieval prompts")
    add("--tasks", default="passkey,single_needle", help="retrieval tasks (adaspan.hf.needles)")
    add("--far", type=float, default=0.0, help="share of retrieval prompts with the needle in "
        "the first tenth of the haystack (the farthest back), the rest anywhere")
    add("--lengths", default=None, help="retrieval prompt lengths (default: --context)")
    add("--tokens-per-step", type=int, default=8192, help="tokens of a retrieval step")
    add("--answer-weight", type=float, default=1.0, help="loss weight of an answer's tokens")
    add("--copy", type=float, default=0.0, help="share of steps on copied stretches")
    add("--copy-length", type=int, default=256, help="tokens of a copy row")
    add("--copy-random", action="store_true", help="copy rows of random printable bytes "
        "(only the copies predictable), not of the train split")
    add("--haystack-bytes", type=int, default=2_000_000, help="train text the haystacks use")
    add("--init", type=Path, default=None, help="start from this saved model (a new schedule "
        "and optimiser; the options of its shape are read from it)")
    args = parser.parse_args(argv)
    args.tasks = args.tasks.split(",")
    args.lengths = [int(n) for n in (args.lengths or str(args.context)).split(",")]
    if max(args.lengths) > args.context or (args.copy and args.copy_length > args.context):
        parser.error("--lengths and --copy-length must not exceed --context")
    if not 0 <= args.far <= 1:
        parser.error("--far is a share of the retrieval prompts, in [0, 1]")
    if args.copy + args.retrieval > 1:
        parser.error("--copy and --retrieval share the steps: their sum must be at most 1")
    return args


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    """A Llama of ``--layers`` layers, d_head = d_model / heads, tied embeddings."""
    config = LlamaConfig(
        vocab_size=256 + OFFSET, hidden_size=args.d_model, intermediate_size=args.d_ff,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=args.context,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    return LlamaForCausalLM(config)


def batch(tokens: np.ndarray, rng: np.random.Generator, size: int, context: int) -> torch.Tensor:
    """``size`` random windows of ``context`` token ids (the model predicts all but the first)."""
    starts = rng.integers(0, len(tokens) - context, size)
    rows = np.stack([tokens[s : s + context] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows + OFFSET)


def copy_batch(tokens: np.ndarray, rng: np.random.Generator, rows: int, length: int,
               weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random windows of ``length`` token ids, each with ``length // 64`` stretches of
    8 to 32 tokens (at most ``length // 4``) written again at a random later place; and each
    target's loss weight: ``weight`` for the copies' tokens after their first, else 1."""
    x = batch(tokens, rng, rows, length)
    weights = torch.ones(rows, length - 1)
    for row, w in zip(x, weights, strict=True):
        for _ in range(max(1, length // 64)):
            n = int(rng.integers(8, min(32, length // 4) + 1))
            source = int(rng.integers(0, length - 2 * n))
            target = int(rng.integers(source + n, length - n + 1))
            row[target:target + n] = row[source:source + n].clone()
            w[target:target + n - 1] = weight  # targets of tokens target + 1 .. target + n - 1
    return x, weights


@torch.no_grad()
def bits_per_byte(model: LlamaForCausalLM, tokens: np.ndarray, context: int) -> float:
    """Mean NLL in bits of every byte but the first of each window of ``context`` bytes."""
    model.eval()
    ids = torch.from_numpy(tokens.astype(np.int64) + OFFSET)
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context][None]
        loss = model(window, labels=window).loss
        n = window.shape[1] - 1
        total, count = total + loss.item() * n, count + n
    model.train()
    return total / count / math.log(2)


def retrieval_batch(args: argparse.Namespace, haystack: Haystack, rng: np.random.Generator,
                    step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrieval prompts with their answers, right-padded (pad id 0), at one length drawn
    from ``--lengths``; and each target's loss weight (0 for pads, ``--answer-weight`` for
    the answer's tokens)."""
    length = int(rng.choice(args.lengths))
    rows, weights = [], []
    for row in range(max(1, args.tokens_per_step // length)):
        task = args.tasks[int(rng.integers(len(args.tasks)))]
        sample = make(task, haystack, length, draw_depth(rng, args.far),
                      TRAIN_SEEDS + step * 1000 + row)
        answer = haystack.count_ids(" " + ", ".join(sample.answers) + ".")
        rows.append([*sample.ids, *answer])
        weights.append([1.0] * (len(sample.ids) - 1) + [args.answer_weight] * len(answer))
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    weight = torch.tensor([w + [0.0] * (width - 1 - len(w)) for w in weights])
    return ids, weight


def weighted_loss(model: LlamaForCausalLM, ids: torch.Tensor, weight: torch.Tensor,
                  marked: float) -> tuple[torch.Tensor, float]:
    """Next-token NLL of ``ids`` weighed per target by ``weight`` (B, T - 1), per unit weight
    of the other tokens; and the mean NLL of the targets weighed ``marked`` (answers,
    copies)."""
    logits = model(ids).logits[:, :-1].float()
    nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    answers = weight == marked
    answer_nll = nll.detach()[answers].mean().item() if answers.any() else math.nan
    return (nll * weight).sum() / weight.clamp(max=1).sum(), answer_nll


def step_kind(args: argparse.Namespace, rng: np.random.Generator) -> str:
    """What a step trains on, drawn with the shares ``--retrieval`` and ``--copy``: retrieval,
    copy or text (no draw where both are 0)."""
    draw = rng.random() if args.retrieval or args.copy else 1.0
    if draw < args.retrieval:
        return "retrieval"
    return "copy" if draw < args.retrieval + args.copy else "text"


def step_loss(args: argparse.Namespace, model: LlamaForCausalLM, train: np.ndarray,
              haystack: Haystack | None, rng: np.random.Generator, step: int, kind: str
              ) -> tuple[torch.Tensor, float | None]:
    """The loss of one step of ``kind`` (:func:`step_kind`), and the mean NLL of the answers'
    or copies' tokens (None for text)."""
    if kind == "retrieval":
        return weighted_loss(model, *retrieval_batch(args, haystack, rng, step),
                             args.answer_weight)
    if kind == "copy":
        source = (rng.integers(32, 127, 1 << 16).astype(np.uint8) if args.copy_random
                  else train)
        rows = max(1, args.tokens_per_step // args.copy_length)
        return weighted_loss(model, *copy_batch(source, rng, rows, args.copy_length,
                                                args.answer_weight), args.answer_weight)
    x = batch(train, rng, args.batch_size, args.context)
    return model(x, labels=x).loss, None


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up over ``--warmup`` steps, then linear decay to 0 at ``--steps``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * max(0.0, 1 - (step - args.warmup) / max(1, args.steps - args.warmup))


def late_mean(values: list[float], share: float = 0.1) -> float:
    """The mean of the last ``share`` of ``values`` (at least one)."""
    last = values[-max(1, round(share * len(values))):]
    return sum(last) / len(last)


def save(model: LlamaForCausalLM, out: Path) -> None:
    model.save_pretrained(out)
    ByT5Tokenizer(extra_ids=0).save_pretrained(out)


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = load_corpus(args.data, progress=False)
    rng = np.random.default_rng(args.seed)
    haystack = Haystack(bytes(corpus.train[: args.haystack_bytes]).decode("utf-8", "ignore"),
                        ByT5Tokenizer(extra_ids=0)) if args.retrieval else None
    model = LlamaForCausalLM.from_pretrained(args.init) if args.init else build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98),
                                  weight_decay=0.01)
    start, step, marked = time.perf_counter(), 0, {}
    print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()),
                      "train_bytes": len(corpus.train)}), flush=True)
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(args, step - 1)
        kind = step_kind(args, rng)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, answer_nll = step_loss(args, model, corpus.train, haystack, rng, step, kind)
        if answer_nll is not None:
            marked.setdefault(kind, []).append(answer_nll)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seconds = time.perf_counter() - start
        if step % args.log_every == 0 or step == 1:
            print(json.dumps({"step": step, "seconds": round(seconds, 1), "kind": kind,
                              "bpb": round(loss.item() / math.log(2), 4),
                              "marked_nll": answer_nll and round(answer_nll, 3),
                              "lr": optimizer.param_groups[0]["lr"]}), flush=True)
        if step % args.save_every == 0:
            save(model, args.out)
        if args.minutes is not None and seconds > 60 * args.minutes:
            break
    save(model, args.out)
    valid = corpus.valid[: args.valid_bytes]
    result = {"steps": step, "seconds": round(time.perf_counter() - start, 1),
              "valid_bytes": len(valid), "valid_bpb": bits_per_byte(model, valid, args.context),
              "marked_nll": {kind: late_mean(values) for kind, values in marked.items()}}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    train(parse_args())
