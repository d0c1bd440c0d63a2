"""Host-device synchronisations per step, counted on the CPU with :class:`syncs.SyncCounter`
(each one would drain the GPU's queue): a training forward, an evaluation block, a whole
training step. Counted in the steady state: after the first step, which builds the head groups'
index tensors (again only when a grouping changes)."""

from __future__ import annotations

import pytest
import torch
from helpers import TRAIN_MODEL, run_quietly, tiny, tiny_train_config
from syncs import SyncCounter

from adaspan.attention.cache import StreamCache
from adaspan.config import TrainConfig
from adaspan.training.optim import build_optimizer, build_scheduler
from adaspan.training.train import _Loop, train_step

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


def test_a_whole_training_step_of_the_loop_waits_at_most_twice(tmp_path, corpus_file):
    """Every step of :func:`adaspan.training.train` between records: the data upload and the
    spans."""
    steps = _loop_waits(tmp_path / "run", corpus_file)
    assert len(steps) == 6 and all(len(calls) <= 2 for calls in steps[1:-1]), steps


def test_evaluation_waits_once_per_block_for_its_upload():
    from adaspan.training.evaluate import evaluate

    model = _model("adaptive", 6)
    tokens = torch.randint(0, 32, (2 * 8 * 16 + 1,)).numpy()  # 8 blocks of 2 x 16
    evaluate(model, tokens[:33], batch_size=2, block_size=16)  # builds the head groups
    with SyncCounter() as syncs:
        result = evaluate(model, tokens, batch_size=2, block_size=16)
    assert result["chars"] == 2 * 8 * 16
    # per block: its upload; once: moving the model to its device, reading the sum
    assert syncs.count <= 8 + 2, syncs.report()


# What each variant waits for in the steady state, with L layers (docs/precision.md's table): a
# training step's forward and backward (train_step, without the loop's upload of the block),
# an evaluation block (without its upload), a generated token of the decoder (without the read
# that samples it). Reading spans that moved: 1 for all layers; spans that depend on the tokens
# (dynamic) and memories that expire (expire) decide each layer's window on the host.
WAITS = {  # variant: (training step, evaluation block, generated token), as functions of L
    "fixed": (lambda L: 0, lambda L: 0, lambda L: 0),
    "adaptive": (lambda L: 1, lambda L: 0, lambda L: 0),
    "dynamic": (lambda L: L, lambda L: L, lambda L: 0),
    "vanilla": (lambda L: 0, lambda L: 0, lambda L: 1),
    "xl": (lambda L: 0, lambda L: 0, lambda L: 1),
    "factorized": (lambda L: 0, lambda L: 0, lambda L: 1),
    "expire": (lambda L: L, lambda L: L, lambda L: L + 1),
    "persistent": (lambda L: 1, lambda L: 0, lambda L: 1),
}


def _steady_counts(attention: str, n_layers: int) -> tuple[int, int, float]:
    """Waits of a training step, an evaluation block and a generated token (mean of 4)."""
    from adaspan.model.decode import decoder

    model = tiny(attention, n_layers=n_layers).train()
    config = TrainConfig(batch_size=2, optimizer="adamw", lr=1e-6, warmup=0, clip=1.0,
                         dtype="float32")
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    cache, x = StreamCache(model.empty_cache(2)), torch.randint(0, 32, (2, 16))
    for _ in range(2):  # the second step: the steady state
        with SyncCounter() as train:
            _, cache = train_step(model, optimizer, scheduler, x, x, cache, config)
    model.eval()
    with torch.no_grad():
        _, kv = model(x, model.empty_cache(2, keys_values=True))
        evaluation = _count(lambda: model(x, kv))
        _, kv = model(x[:1], model.empty_cache(1, keys_values=True))
        step = decoder(model, kv, 16)
        step(0)
        tokens = _count(lambda: [step(t) for t in range(4)])
    return train.count, evaluation.count, tokens.count / 4


def test_every_variant_waits_as_the_docs_state():
    from adaspan.attention.registry import ATTENTIONS

    assert set(WAITS) == set(ATTENTIONS)
    for attention, expected in WAITS.items():
        counts = _steady_counts(attention, n_layers=3)
        assert counts == tuple(f(3) for f in expected), attention


def _loop_worker(rank: int, store, data: str, out) -> None:
    """One of 2 torchrun-like processes: the waits of each step of the training loop."""
    import json
    import os

    import torch.distributed as torch_dist

    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch_dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                  world_size=2)
    try:
        steps = _loop_waits(out / "run", data)
    finally:
        torch_dist.destroy_process_group()
    (out / f"waits-{rank}.json").write_text(json.dumps(steps))


def _loop_waits(run_dir, data: str) -> list[list[str]]:
    """The waits of each step of :func:`adaspan.training.train` (the step, then the loop's check
    for a record or a checkpoint), 6 steps recorded and saved at the last only."""
    counts = []

    def counted(method):
        def run(loop, *args):
            with SyncCounter() as syncs:
                method(loop, *args)
            counts.append(syncs.calls)
        return run

    original = _Loop._step, _Loop._record_and_save
    _Loop._step, _Loop._record_and_save = (counted(m) for m in original)
    try:
        config = tiny_train_config(str(data), steps=6, log_interval=6, eval_interval=6,
                                   checkpoint_interval=6, batch_size=4)
        run_quietly(run_dir, config, TRAIN_MODEL)
    finally:
        _Loop._step, _Loop._record_and_save = original
    return [counts[i] + counts[i + 1] for i in range(0, len(counts), 2)]


def test_two_processes_wait_as_one_between_records(tmp_path, corpus_file):
    """Under torchrun, agreeing on stopping (time budget, signals) is an exchange of host
    values over gloo: a step of each process waits for its GPU no more than one process's."""
    import json

    from helpers import run_processes

    run_processes(_loop_worker, (tmp_path / "store", corpus_file, tmp_path),
                  "the 2 processes")
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"waits-{rank}.json").read_text())
        assert len(steps) == 6 and all(len(calls) <= 2 for calls in steps[1:-1]), steps
