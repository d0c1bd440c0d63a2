"""How far a training step's gradients are from exact: one step of a SpanLM (a block after a
block of history, carried in the cache) in bf16 autocast and in fp32, each against the same
step in float64, on the same weights and bytes. Prints one JSON line: the loss of each, and
per group of parameters (attention, feed-forward, embeddings, positions, spans) the relative
error ``||g − g64|| / ||g64||`` and the cosine. Runs with whatever adaspan is first on the path,
so that two versions compare on the same weights (``PYTHONPATH=TREE/src``):

    python scripts/experiments/gradient_error.py --data TEXT [--weights RUN/model.safetensors] \\
        [--spans 93,60,56,38] [--model KEY=VALUE ...]

Without ``--weights`` the model is freshly initialised (``--seed``); with them, trained
weights of the same configuration (a run's ``model.safetensors``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from adaspan import ModelConfig, SpanLM

MODEL = {"n_layers": 4, "d_model": 256, "n_heads": 4, "d_inner": 1024, "max_span": 1024,
         "ramp": 32, "dropout": 0.0, "span_loss_coef": 2e-6}
GROUPS = {"attention": ("attn.q", "attn.k", "attn.v", "attn.o", "attn.proj", "attn.qkv"),
          "spans": ("span",), "positions": ("pos",), "embeddings": ("embed", "out"),
          "feed_forward": ("ff", "fc"), "norms": ("norm",)}


def group_of(name: str) -> str:
    """The group a parameter's name belongs to (its first matching group, else "other")."""
    for group, parts in GROUPS.items():
        if any(part in name for part in parts):
            return group
    return "other"


def step_gradients(model: SpanLM, blocks: torch.Tensor, dtype: torch.dtype,
                   autocast: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the second block, the first one carried in the cache."""
    model = model.to(dtype)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        with torch.no_grad():
            _, cache = model(blocks[0][:, :-1])
        log_probs, _ = model(blocks[1][:, :-1], cache, targets=blocks[1][:, 1:])
        loss = -log_probs.double().mean() + model.span_loss()
    loss.backward()
    return loss.item(), {n: p.grad.detach().double().clone()
                         for n, p in model.named_parameters() if p.grad is not None}


def compare(grads: dict[str, torch.Tensor], exact: dict[str, torch.Tensor]) -> dict:
    """Relative error and cosine of ``grads`` against ``exact``, per group and overall."""
    out = {}
    for group in [*sorted({group_of(n) for n in exact}), "all"]:
        names = [n for n in exact if group in ("all", group_of(n))]
        g = torch.cat([grads[n].flatten() for n in names])
        e = torch.cat([exact[n].flatten() for n in names])
        out[group] = {"relative_error": ((g - e).norm() / e.norm()).item(),
                      "cosine": torch.nn.functional.cosine_similarity(g, e, dim=0).item()}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="a text file: its first bytes are the batch")
    p.add_argument("--weights", help="a run's model.safetensors (default: initialised)")
    p.add_argument("--spans", default="", help="spans cycled over the heads (default: as is)")
    p.add_argument("--model", nargs="*", default=[], help="KEY=VALUE over the recipe's model")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    options = dict(MODEL)  # parsed here, not by adaspan's resolve: older trees run this too
    for item in args.model:
        key, value = item.split("=", 1)
        options[key] = type(options[key])(value) if key in options else int(value)
    torch.manual_seed(args.seed)
    model = SpanLM(ModelConfig(**options))
    if args.weights:
        model.load_state_dict(load_file(args.weights))
    if args.spans:
        spans = [float(s) for s in args.spans.split(",")]
        n_heads = options["n_heads"]
        model.set_spans([spans[i % len(spans)] for i in range(n_heads)])
    size = args.batch * (args.block + 1)
    raw = Path(args.data).read_bytes()[: 2 * size]
    blocks = torch.tensor(list(raw), dtype=torch.long).view(2, args.batch, args.block + 1)
    exact_loss, exact = step_gradients(model, blocks, torch.float64, autocast=False)
    result = {"model": options, "batch": args.batch, "block": args.block,
              "weights": args.weights, "loss_float64": exact_loss,
              "threads": torch.get_num_threads(), "torch": torch.__version__}
    for name, dtype, autocast in (("float32", torch.float32, False),
                                  ("bfloat16", torch.float32, True)):
        loss, grads = step_gradients(model, blocks, dtype, autocast)
        result[f"loss_{name}"] = loss
        result[name] = compare(grads, exact)
    assert math.isfinite(result["loss_bfloat16"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
