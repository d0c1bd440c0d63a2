"""Host-device synchronisations per step, counted on the CPU with :class:`syncs.SyncCounter`
(each one would drain the GPU's queue): a training forward, an evaluation block, a whole
training step. Counted in the steady state: after the first step, which builds the head groups'
index tensors (again only when a grouping changes)."""

from __future__ import annotations

import pytest
import torch
from helpers import TRAIN_MODEL, run_quietly, tiny, tiny_train_config
from syncs import SyncCounter

from adaspan.cache import StreamCache
from adaspan.config import TrainConfig
from adaspan.optim import build_optimizer, build_scheduler
from adaspan.train import _Loop, train_step

# spans whose windows form non-adjacent groups (heads 0, 2 and 1, 3) in every layer
SPLIT_GROUPS = [12.5, 36.5, 12.5, 36.5]


def _model(attention: str, n_layers: int):
    model = tiny(attention, n_layers=n_layers).train()
    if attention == "adaptive":
        model.set_spans(SPLIT_GROUPS)
    return model


def _count(call) -> SyncCounter:
    with SyncCounter() as syncs:
        call()
    return syncs


@pytest.mark.parametrize("attention", ["adaptive", "fixed"])
@pytest.mark.parametrize("n_layers", [1, 6])
def test_training_forward_reads_the_spans_once(attention, n_layers):
    model = _model(attention, n_layers)
    x = torch.randint(0, 32, (2, 16))
    model(x)  # builds the head groups
    with torch.no_grad():  # what an optimiser step does: every z' moves
        for layer in model.layers:
            for p in layer.attn.span.parameters():
                p.add_(1e-4)
    syncs = _count(lambda: model(x)[0].sum().backward())
    assert syncs.count <= (attention == "adaptive"), syncs.report()
    assert _count(lambda: model(x)).count == 0  # spans unchanged: nothing to read


@pytest.mark.parametrize("n_layers", [1, 6])
def test_an_evaluation_block_waits_for_nothing(n_layers):
    model = _model("adaptive", n_layers).eval()
    x = torch.randint(0, 32, (2, 16))
    with torch.no_grad():
        _, cache = model(x, model.empty_cache(2, keys_values=True))
        syncs = _count(lambda: model(x, cache))
    assert syncs.count == 0, syncs.report()


@pytest.mark.parametrize("clip_mode", ["global", "per-tensor-lr"])
def test_a_train_step_reads_the_spans_once(clip_mode):
    model = _model("adaptive", 6)
    config = TrainConfig(batch_size=2, batch_split=2, optimizer="adamw", lr=1e-6, warmup=0,
                         clip=1e-3, clip_mode=clip_mode)
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    cache = StreamCache(model.empty_cache(2))
    x = torch.randint(0, 32, (2, 16))
    for _ in range(2):
        with SyncCounter() as syncs:
            _, cache = train_step(model, optimizer, scheduler, x, x, cache, config)
    assert syncs.count <= 1, syncs.report()


def test_a_whole_training_step_of_the_loop_waits_at_most_twice(tmp_path, corpus_file,
                                                               monkeypatch):
    """Every step of :func:`adaspan.train` between records (the step, then the loop's check for
    a record or a checkpoint): the data upload and the spans."""
    counts = []

    def counted(method):
        def run(loop, *args):
            with SyncCounter() as syncs:
                method(loop, *args)
            counts.append(syncs.calls)
        return run

    monkeypatch.setattr(_Loop, "_step", counted(_Loop._step))
    monkeypatch.setattr(_Loop, "_record_and_save", counted(_Loop._record_and_save))
    config = tiny_train_config(str(corpus_file), steps=6, log_interval=6, eval_interval=6,
                               checkpoint_interval=6)
    run_quietly(tmp_path / "run", config, TRAIN_MODEL)
    steps = [counts[i] + counts[i + 1] for i in range(0, len(counts), 2)]
    assert len(steps) == 6 and all(len(calls) <= 2 for calls in steps[1:-1]), steps


def test_evaluation_waits_once_per_block_for_its_upload():
    from adaspan.evaluate import evaluate

    model = _model("adaptive", 6)
    tokens = torch.randint(0, 32, (2 * 8 * 16 + 1,)).numpy()  # 8 blocks of 2 x 16
    evaluate(model, tokens[:33], batch_size=2, block_size=16)  # builds the head groups
    with SyncCounter() as syncs:
        result = evaluate(model, tokens, batch_size=2, block_size=16)
    assert result["chars"] == 2 * 8 * 16
    # per block: its upload; once: moving the model to its device, reading the sum
    assert syncs.count <= 8 + 2, syncs.report()
