"""Speed of ``adaspan.span_attention`` against dense attention with the same soft mask, side by
side in one run, forward and backward (a prefill: M = T, no cache), and one decoding query
(M = 1 over a cache of T keys).

    python scripts/bench/functional_speed.py [--tokens 2048] [--heads 8] [--kv-heads 2]
        [--d-head 64] [--max-span 1024] [--spans 40,80,150,300] [--runs 5]

The dense path is what a model without truncation computes: the key/value heads repeated for
the query heads, and ``scaled_dot_product_attention`` over all T keys with the mask
``log m_z(x)`` (-inf outside 0 <= x < S) added to the scores. Head h gets span
``spans[h % len(spans)]`` (z = span - R, R = 32). Times are the median of ``runs`` runs after
one warm-up, in float32 on the CPU, with the largest difference of the two outputs. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from adaspan import span_attention
from adaspan.attention.band import log_soft_mask

RAMP = 32.0


def dense(q, k, v, z, max_span: int):
    """Attention over every key with the additive mask log m_z(x) of eq. 2."""
    Hq, M, T = q.shape[1], q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(Hq // t.shape[1], dim=1) for t in (k, v))
    x = (T - M + torch.arange(M))[:, None] - torch.arange(T)[None, :]
    mask = log_soft_mask(x.float(), z.view(Hq, 1, 1), RAMP)
    mask = mask.masked_fill((x < 0) | (x >= max_span), -torch.inf)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def seconds(run, runs: int) -> float:
    """Median seconds of ``run()`` over ``runs`` runs after a warm-up."""
    run()
    times = []
    for _ in range(runs):
        tic = time.perf_counter()
        run()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def timings(args: argparse.Namespace, M: int) -> dict[str, float]:
    """Milliseconds of both paths for M queries over T = ``tokens`` keys (with a backward pass
    where M > 1)."""
    torch.manual_seed(0)
    T, dh = args.tokens, args.d_head
    q = torch.randn(1, args.heads, M, dh, requires_grad=M > 1)
    k, v = (torch.randn(1, args.kv_heads, T, dh, requires_grad=M > 1) for _ in range(2))
    spans = [float(s) for s in args.spans.split(",")]
    z = torch.tensor([spans[h % len(spans)] - RAMP for h in range(args.heads)]).view(-1, 1)
    paths = {"span_attention": lambda: span_attention(q, k, v, z, max_span=args.max_span,
                                                      ramp=RAMP),
             "dense": lambda: dense(q, k, v, z, args.max_span)}

    def run(path):
        out = paths[path]()
        if M > 1:
            out.sum().backward()

    with torch.no_grad():
        difference = (paths["span_attention"]() - paths["dense"]()).abs().max().item()
    return {"max_abs_difference": difference,
            **{path: 1000 * seconds(lambda p=path: run(p), args.runs) for path in paths}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--d-head", type=int, default=64)
    parser.add_argument("--max-span", type=int, default=1024)
    parser.add_argument("--spans", default="40,80,150,300")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(), **vars(args)}
    for name, M in (("prefill", args.tokens), ("decode", 1)):
        ms = timings(args, M)
        difference = ms.pop("max_abs_difference")
        result[name] = {**{f"{p}_ms": round(t, 3) for p, t in ms.items()},
                        "max_abs_difference": difference,
                        "dense_over_span_attention": round(ms["dense"] / ms["span_attention"],
                                                           2)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
