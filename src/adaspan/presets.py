"""Named configurations: :data:`PRESETS`, each a description and the ``model`` and ``train``
options it sets over the defaults (:func:`adaspan.resolve.resolve_config` applies them).
"""

from __future__ import annotations


def _paper(model: dict, train: dict, description: str) -> dict:
    """A preset following the paper's recipe (§3): Adagrad lr 0.07, 32k warm-up steps,
    clipping at 0.03 per tensor (as the authors' trainer), 64 streams of 512-character blocks,
    R=32, S=8192 with lambda 0.5e-6."""
    return {
        "description": description,
        "model": {"n_heads": 8, "max_span": 8192, "ramp": 32, "span_loss_coef": 0.5e-6,
                  "attention": "adaptive", **model},
        "train": {"batch_size": 64, "block_size": 512, "optimizer": "adagrad", "lr": 0.07,
                  "warmup": 32_000, "clip": 0.03, "clip_mode": "per-tensor-lr",
                  "eval_interval": 1000,
                  "eval_chars": 5_000_000, "checkpoint_interval": 1000, **train},
    }


_SMALL = {"n_layers": 12, "d_model": 512, "d_inner": 2048, "dropout": 0.3}
_LARGE = {"n_layers": 24, "d_model": 768, "d_inner": 4096, "dropout": 0.4}

# Measured on a 2-core CPU (docs/training-log.md): with the authors' per-tensor clipping the
# paper's Adagrad recipe learns as fast per step as AdamW (with the global norm clipped at 0.03
# it stays at unigram level); the CPU presets keep AdamW, slightly ahead after 10 minutes.
_CPU_MODEL = {"n_heads": 4, "dropout": 0.1, "ramp": 32, "span_loss_coef": 2e-6}
_CPU_TRAIN = {"data": "kjv", "optimizer": "adamw", "lr": 3e-3, "clip": 1.0, "clip_mode": "global",
              "weight_decay": 0.01}


def _cpu(model: dict, steps: int, batch: tuple[int, int], warmup: int, every: int, log: int,
         eval_chars: int, description: str, train: dict | None = None) -> dict:
    """A preset with the CPU recipe above: ``steps`` of ``batch`` (streams, block size), with
    validation and a checkpoint ``every`` steps, a log line every ``log`` steps; ``train``:
    more train options."""
    schedule = {"batch_size": batch[0], "block_size": batch[1], "steps": steps,
                "warmup": warmup, "eval_interval": every, "checkpoint_interval": every,
                "log_interval": log, "eval_chars": eval_chars}
    return {"description": description, "model": {**_CPU_MODEL, **model},
            "train": {**_CPU_TRAIN, **schedule, **(train or {})}}


PRESETS: dict[str, dict] = {
    "text8-small": _paper(_SMALL, {"data": "text8", "steps": 900_000},
                          "paper's small model on text8 (Table 1): 12 layers, S=8192"),
    "enwik8-small": _paper(_SMALL, {"data": "enwik8", "steps": 900_000},
                           "paper's small model on enwik8 (Table 2): 12 layers, S=8192"),
    "text8-large": _paper(_LARGE, {"data": "text8", "steps": 270_000, "lr_drop_steps": 20_000},
                          "paper's large model on text8 (Table 1): 24 layers, 250k steps "
                          "+ 20k at lr/10"),
    "enwik8-large": _paper(_LARGE, {"data": "enwik8", "steps": 170_000, "lr_drop_steps": 20_000},
                           "paper's large model on enwik8 (Table 2): 24 layers, 150k steps "
                           "+ 20k at lr/10"),
    "enwik8-8layer": _paper(
        {**_SMALL, "n_layers": 8}, {"data": "enwik8", "steps": 600_000, "batch_split": 2},
        "adaspan's single-GPU configuration (not a paper table row): the small enwik8 model "
        "with 8 layers, the batch of 64 processed in 2 slices",
    ),
    "cpu-small": _cpu(
        {"n_layers": 4, "d_model": 256, "d_inner": 1024, "max_span": 1024},
        steps=2500, batch=(16, 128), warmup=200, every=250, log=50, eval_chars=65_536,
        description="4-layer model for a 2-core CPU, ~40 minutes (bundled King James Bible)",
    ),
    "wt103-all-attention": {
        "description": "persistent-memory paper's all-attention network on WikiText-103 (not "
                       "run by adaspan; pass data=DIR of wiki.train/valid/test.tokens renamed "
                       "train/valid/test.txt): 36 layers, 2048 persistent vectors, adaptive "
                       "input and softmax, 267,735 words",
        "model": {"attention": "persistent", "persistent_span": "adaptive",
                  "persistent_size": 2048, "feed_forward": False, "n_layers": 36,
                  "d_model": 512, "n_heads": 8, "max_span": 2048, "ramp": 32,
                  "span_loss_coef": 5e-7, "dropout": 0.3, "vocab_size": 267_735,
                  "adaptive_io": True, "cutoffs": "20000,40000,200000", "div_val": 4,
                  "tie_io": True},
        "train": {"data": "wikitext-103", "tokenizer": "words", "batch_size": 64,
                  "block_size": 256, "optimizer": "adamw", "lr": 2.5e-4, "weight_decay": 0.0,
                  "warmup": 8000, "clip": 1.0, "clip_mode": "per-tensor-lr",
                  "steps": 850_000, "lr_drop_steps": 50_000, "batch_split": 2,
                  "eval_interval": 1000, "checkpoint_interval": 1000},
    },
    "words-small": _cpu(
        {"n_layers": 3, "d_model": 192, "d_inner": 768, "max_span": 512, "vocab_size": 8192,
         "adaptive_io": True, "cutoffs": "1024,4096", "div_val": 4, "tie_io": False},
        steps=2000, batch=(8, 64), warmup=100, every=400, log=100, eval_chars=8192,
        description="the demo's model on words of the bundled corpus (8,192-word vocabulary, "
                    "adaptive input and softmax, untied), ~3 minutes on a 2-core CPU",
        train={"tokenizer": "words"},
    ),
    "bpe-small": _cpu(
        {"n_layers": 3, "d_model": 192, "d_inner": 768, "max_span": 512, "vocab_size": 2048},
        steps=2000, batch=(8, 64), warmup=100, every=400, log=100, eval_chars=8192,
        description="the demo's model on byte-level BPE tokens of the bundled corpus (2,048 "
                    "trained on its train split), ~3 minutes on a 2-core CPU",
        train={"tokenizer": "bpe"},
    ),
    "demo": _cpu(
        {"n_layers": 3, "d_model": 192, "d_inner": 768, "max_span": 512},
        steps=2400, batch=(8, 64), warmup=100, every=400, log=100, eval_chars=16_384,
        description="3-layer model trained for ~4.5 minutes on a CPU (bundled King James Bible)",
    ),
}
