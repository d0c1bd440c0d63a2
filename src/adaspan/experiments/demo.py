"""``adaspan demo``: train the demo preset on the bundled corpus, then evaluate, show the
learned spans and sample from the model: the whole pipeline in a few minutes on a CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..data.corpora import load_corpus
from ..measure.generate import generate
from ..measure.tables import span_table
from ..resolve import resolve_config
from ..run.checkpoint import load_model, new_run_dir
from ..training.evaluate import evaluate
from ..training.train import train

PROMPT = b"And God said"


def _say(message: str) -> None:
    print(message, flush=True)


def run_demo(
    minutes: float,
    run_dir: Path | None = None,
    progress: bool = True,
    say: Callable[[str], None] = _say,
) -> Path:
    """Train for at most ``minutes``, report through ``say``; return the run directory."""
    run_dir = run_dir or new_run_dir("demo")
    model_config, train_config = resolve_config("demo", overrides=[f"time_budget={minutes * 60}"])
    say(f"training the demo model for up to {minutes:g} minutes in {run_dir}")
    train(model_config, train_config, run_dir, progress=progress)
    model = load_model(run_dir)
    corpus = load_corpus(train_config.data)
    result = evaluate(model, corpus.valid, batch_size=8, block_size=train_config.block_size,
                      progress=progress)
    say(f"validation: {result['bpc']:.3f} bits per character over {result['chars']:,} "
        f"characters, scored in {result['precision']['dtype']} (uniform over bytes: 8 bits)")
    say("learned span of every head (tokens):\n" + span_table(model.spans()))
    sample = generate(model, PROMPT, 300, temperature=0.8,
                      generator=torch.Generator().manual_seed(0))
    say("sample:\n" + (PROMPT + sample).decode("utf-8", errors="replace"))
    say(f"run saved in {run_dir}: try `adaspan inspect {run_dir} --plot {run_dir}`")
    return run_dir
