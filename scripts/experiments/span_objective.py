"""The retrofit's own objective for a model's spans as learned and with some spans edited: does
an edit that answers more prompts also lower what the retrofit minimises? Print it as JSON.

    python scripts/experiments/span_objective.py /work/ev28/r128/spans \
        --edits "spans:windows=0.0@1024;spans:full_layers=0" --steps 8

The model directory is a retrofit's output (``retrofit_settings.json``, the spans). Its
settings give the frozen model, the data and the loss. Batches are drawn as the retrofit draws
them (:class:`adaspan.hf.retrofit_data.TrainData`), from step ``--first`` on; by default the
first step after those it trained on. Each batch is scored, in float32, with the spans as
learned (``spans``) and with each edit of ``--edits``: ``spans`` cache-policy specs joined by
``;`` (``full_layers=``, ``windows=``; see ``adaspan.hf.cache_policies.SpansPolicy``).

Output, per policy, means over the steps, in nats: ``kl_windows`` (the text windows' rows),
``kl_prompts`` (the retrieval prompts' rows, at the positions the retrofit scores), ``kl`` (all
rows, the retrofit's term), ``penalty`` and ``total`` (``kl + penalty``); and, for each edit,
``change`` (its terms less the learned spans', step by step, then averaged).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from adaspan.config import RetrofitConfig
from adaspan.errors import UserError
from adaspan.hf.cache_policies import SpansPolicy, build_policy
from adaspan.hf.retrofit import SETTINGS_FILE, load_frozen, span_losses
from adaspan.hf.retrofit_data import TrainData
from adaspan.hf.spans import load_spans

TERMS = ("kl_windows", "kl_prompts", "kl", "penalty", "total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("spans_dir", type=Path, help="the output directory of adaspan retrofit --method spans")
    add("--edits", default="", help="spans cache policies joined by ';'")
    add("--steps", type=int, default=8, help="batches scored")
    add("--first", type=int, help="the step of the first batch (default: the steps trained)")
    add("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    return parser.parse_args(argv)


def read_config(spans_dir: Path) -> RetrofitConfig:
    """The retrofit's settings; a directory without them is a one-line UserError."""
    try:
        config = RetrofitConfig(**json.loads((spans_dir / SETTINGS_FILE).read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise UserError(f"no retrofit settings in {spans_dir}: {exc}") from None
    if config.method != "spans" or config.loss != "distill":
        raise UserError(f"{spans_dir} is a retrofit of {config.method} with loss {config.loss}; "
                        "this script scores spans trained by distillation")
    return config


def terms(model, original: str, x: torch.Tensor, scored: torch.Tensor,
          config: RetrofitConfig, prompts: int) -> dict[str, float]:
    """The objective's terms on one batch whose last ``prompts`` rows are retrieval prompts."""
    rows = len(x)
    windows = rows - prompts
    out = {"kl_windows": 0.0, "kl_prompts": 0.0}
    for name, part in (("kl_windows", slice(0, windows)), ("kl_prompts", slice(windows, rows))):
        if part.stop > part.start:
            losses = span_losses(model, original, x[part], scored[part], config)
            out[name], out["penalty"] = losses["kl"].item(), losses["penalty"].item()
    out["kl"] = (windows * out["kl_windows"] + prompts * out["kl_prompts"]) / rows
    out["total"] = out["kl"] + out["penalty"]
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = read_config(args.spans_dir)
        model, tokenizer = load_frozen(config.model_dir)
        original = model.config._attn_implementation
        load_spans(model, args.spans_dir)
        specs = ["spans", *(spec for spec in args.edits.split(";") if spec)]
        policies = [build_policy(spec, model) for spec in specs]
        data = TrainData.read(config, tokenizer)
    except UserError as exc:  # ConfigError is one too
        raise SystemExit(f"error: {exc}") from None
    if not all(isinstance(policy, SpansPolicy) for policy in policies):
        raise SystemExit("error: --edits are spans cache policies (spans:...)")
    prompts = config.retrieval_rows
    first = config.steps if args.first is None else args.first
    scores: dict[str, list[dict[str, float]]] = {spec: [] for spec in specs}
    with torch.no_grad():
        for step in range(first, first + args.steps):
            x, scored = data.batch(step)
            for spec, policy in zip(specs, policies, strict=True):
                with policy.applied(config.context):
                    scores[spec].append(terms(model, original, x, scored, config, prompts))

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    result = {"spans_dir": str(args.spans_dir), "model": config.model_dir,
              "steps": [first, first + args.steps - 1], "rows": config.batch_size,
              "prompts": prompts, "policies": {}}
    for spec in specs:
        entry = {term: mean([s[term] for s in scores[spec]]) for term in TERMS}
        if spec != "spans":
            entry["change"] = {term: mean([s[term] - base[term] for s, base in
                                           zip(scores[spec], scores["spans"], strict=True)])
                               for term in TERMS}
        result["policies"][spec] = entry
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
