"""The training loop, its schedule, steps and clipping, resuming, several processes: on tiny
models (run directories and checkpoints: test_checkpoint.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import signal
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing
import torch.nn.functional as F
from helpers import (
    TRAIN_MODEL,
    assert_same_weights,
    run_processes,
    run_quietly,
    tiny_train_config,
    weights,
)

from adaspan import SpanLM
from adaspan.attention.cache import StreamCache
from adaspan.config import TrainConfig
from adaspan.data.corpora import load_corpus
from adaspan.errors import UserError
from adaspan.run.checkpoint import (
    CONFIG_FILE,
    STATE_FILE,
    WEIGHTS_FILE,
    RunDir,
    load_model,
    load_training_state,
    read_state,
)
from adaspan.training.evaluate import evaluate
from adaspan.training.optim import (
    FUSED_DEVICES,
    build_optimizer,
    build_scheduler,
    fused_where_offered,
    lr_factor,
)
from adaspan.training.train import Diverged, RunComplete, train, train_step
from adaspan.training.watch import span_warnings

RECORD_FIELDS = {"step", "train_bpc", "valid_bpc", "lr", "chars_per_s", "avg_span", "max_span",
                 "layer_avg_span", "layer_max_span", "head_spans", "elapsed", "precision"}


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_step(run_dir: Path) -> int:
    """The step of the training state saved in ``run_dir``."""
    model_config, config = RunDir(run_dir).load_config()
    model = SpanLM(model_config)
    optimizer = build_optimizer(model, config)
    return load_training_state(run_dir, model, optimizer, build_scheduler(optimizer, config)).step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_file) -> dict[str, torch.Tensor]:
    """Weights after 8 steps in one go (dropout > 0, so RNG states matter; data wraps at 5)."""
    run_dir = tmp_path_factory.mktemp("runs") / "straight"
    run_quietly(run_dir, tiny_train_config(corpus_file))
    return weights(run_dir)


def test_resume_equals_uninterrupted(tmp_path, corpus_file, uninterrupted):
    first = run_quietly(tmp_path, tiny_train_config(corpus_file, steps=4))
    assert first["steps"] == 4
    with (tmp_path / "metrics.jsonl").open("a") as out:  # as if it crashed after a checkpoint
        out.write(json.dumps({"step": 6, "train_bpc": 1.0}) + "\n" + '{"step": 7, "tr')
    summary = run_quietly(tmp_path, tiny_train_config(corpus_file), resume=True)
    assert summary["steps"] == 8 and summary["stopped"] == "completed"
    assert_same_weights(weights(tmp_path), uninterrupted)
    assert [r["step"] for r in records(tmp_path)] == [2, 4, 6, 8]  # stale records dropped
    files = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")}
    complete = run_quietly(tmp_path, tiny_train_config(corpus_file), resume=True)  # no step left
    assert isinstance(complete, RunComplete) and complete.step == 8  # a result, not an error
    assert str(complete) == f"{tmp_path} is complete at step 8; pass steps=16 to continue"
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")} == files


def test_ctrl_c_saves_a_checkpoint_and_resume_continues_exactly(tmp_path, corpus_file,
                                                                 uninterrupted):
    def press_ctrl_c_at_step_2(message: str) -> None:
        if message.startswith("step 2/"):
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(TRAIN_MODEL, tiny_train_config(corpus_file), tmp_path, progress=False,
              log=press_ctrl_c_at_step_2)
    assert checkpoint_step(tmp_path) == 3  # the step under way was finished
    run_quietly(tmp_path, tiny_train_config(corpus_file), resume=True)
    assert_same_weights(weights(tmp_path), uninterrupted)


def test_an_annealed_run_stopped_by_ctrl_c_resumes_exactly(tmp_path, corpus_file):
    config = tiny_train_config(corpus_file, lr_schedule="cosine", lr_end_factor=0.0)
    run_quietly(tmp_path / "whole", config)

    def press_ctrl_c_at_step_4(message: str) -> None:
        if message.startswith("step 4/"):
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(TRAIN_MODEL, config, tmp_path / "cut", progress=False, log=press_ctrl_c_at_step_4)
    run_quietly(tmp_path / "cut", config, resume=True)
    assert_same_weights(weights(tmp_path / "cut"), weights(tmp_path / "whole"))


def test_divergence_stops_training_with_a_user_error(tmp_path, corpus_file):
    with pytest.raises(Diverged, match="training diverged at step") as diverged:
        run_quietly(tmp_path, tiny_train_config(corpus_file, lr=1e6, clip=0.0))
    assert isinstance(diverged.value, UserError) and isinstance(diverged.value, FloatingPointError)


def test_time_budget_stops_with_a_checkpoint(tmp_path, corpus_file):
    summary = run_quietly(tmp_path, tiny_train_config(corpus_file, time_budget=1e-9))
    assert summary["stopped"] == "time_budget" and summary["steps"] == 1
    assert checkpoint_step(tmp_path) == 1
    assert records(tmp_path)[-1]["valid_bpc"] is not None  # validated before stopping


def test_metrics_records_hold_every_field_and_the_lr_schedule(tmp_path, corpus_file):
    config = tiny_train_config(corpus_file, steps=6, warmup=4, lr_drop_steps=2, log_interval=1,
                         eval_interval=3, tensorboard=True)
    summary = run_quietly(tmp_path, config)
    lines = records(tmp_path)
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5, 6]
    for record in lines:
        assert record.keys() == RECORD_FIELDS
        assert math.isfinite(record["train_bpc"]) and record["chars_per_s"] > 0
        assert 1 <= record["avg_span"] <= record["max_span"] <= TRAIN_MODEL.max_span
        layer_avg, layer_max = record["layer_avg_span"], record["layer_max_span"]
        assert len(layer_avg) == len(layer_max) == TRAIN_MODEL.n_layers
        assert all(a <= m for a, m in zip(layer_avg, layer_max, strict=True))
        assert max(layer_max) == pytest.approx(record["max_span"])
        assert sum(layer_avg) / TRAIN_MODEL.n_layers == pytest.approx(record["avg_span"])
        heads = record["head_spans"]  # every head, to 0.1 token
        assert [len(layer) for layer in heads] == [TRAIN_MODEL.n_heads] * TRAIN_MODEL.n_layers
        assert [max(layer) for layer in heads] == pytest.approx(layer_max, abs=0.05)
        assert [sum(layer) / len(layer) for layer in heads] == pytest.approx(layer_avg, abs=0.05)
    assert [r["valid_bpc"] is not None for r in lines] == [False, False, True, False, False, True]
    # step s is optimiser update s - 1: warm-up 0, 1/4, 2/4, 3/4, then 1, then lr/10 (last 2)
    expected = [0.0, 0.25, 0.5, 0.75, 0.1, 0.1]
    assert [r["lr"] for r in lines] == pytest.approx([config.lr * f for f in expected])
    assert summary["valid_bpc"] == lines[-1]["valid_bpc"]
    if _has_tensorboard():
        assert any((tmp_path / "tb").iterdir())


def _has_tensorboard() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def test_span_warnings_name_the_layers_at_their_minimum_and_the_heads_at_s():
    config = dataclasses.replace(TRAIN_MODEL, span_loss_coef=2e-6)  # R = 8, S = 64
    floored = [[30.0, 64.0], [8.0, 8.0]]  # layer 1: z = 0 for both heads; layer 0 head 1 at S
    warnings = span_warnings(floored, config, before=[[12.0, 40.0], [8.0, 8.2]])
    assert warnings.keys() == {"minimum", "limit"}
    assert "every head of layer 1 stayed at its minimum span R = 8" in warnings["minimum"]
    for advice in ("larger ramp, up to the distance the data needs (now 8)",
                   "span_init > 0 (now 0.3) alone", "smaller span_loss_coef (now 2e-06)"):
        assert advice in warnings["minimum"]
    assert "layer 0 head 1 reached S = 64" in warnings["limit"]
    assert "raise max_span" in warnings["limit"]
    assert span_warnings(floored, config).keys() == {"limit"}  # one record: not "stayed"
    assert span_warnings(floored, config, [[8.0, 8.0], [8.0, 9.0]]).keys() == {"limit"}
    assert span_warnings([[8.0, 8.0], [8.0, 8.0]], config, [[8.0] * 2] * 2)["minimum"].startswith(
        "every head of layers 0, 1 ")
    assert span_warnings([[8.0, 63.0], [8.4, 9.0]], config, [[8.0, 8.0], [8.0, 8.0]]) == {}


@pytest.mark.parametrize("attention", ["adaptive", "fixed"])
def test_spans_stuck_at_their_minimum_are_warned_about_once(tmp_path, corpus_file, attention):
    """A heavy penalty keeps every z at 0 from the start (span_init = 0): warned once, at the
    first record a warm-up after the end of the warm-up; a fixed span (at S) is not learned."""
    model = dataclasses.replace(TRAIN_MODEL, attention=attention, span_init=0.0,
                                span_loss_coef=1.0)
    lines = []
    train(model, tiny_train_config(corpus_file, steps=7, warmup=2, log_interval=1),
          tmp_path, progress=False, log=lines.append)
    warnings = [line for line in lines if "warning" in line]
    if attention == "fixed":
        assert warnings == []
        return
    assert len(warnings) == 1 and warnings[0].startswith("step 4: warning: every head of "
                                                         "layers 0, 1 stayed at its minimum")
    assert records(tmp_path)[-1]["head_spans"] == [[8.0, 8.0], [8.0, 8.0]]


def test_saved_model_reproduces_the_final_validation(tmp_path, corpus_file):
    config = tiny_train_config(corpus_file, steps=3)
    summary = run_quietly(tmp_path, config)
    model = load_model(tmp_path)
    assert not model.training
    valid = load_corpus(corpus_file).valid
    result = evaluate(model, valid, batch_size=4, block_size=32, max_chars=config.eval_chars)
    assert result["bpc"] == summary["valid_bpc"]


def test_run_leaves_no_temporary_files(tmp_path, corpus_file):
    run_quietly(tmp_path, tiny_train_config(corpus_file, steps=3, checkpoint_interval=1))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([CONFIG_FILE, "metrics.jsonl", WEIGHTS_FILE, STATE_FILE,
                            "tokenizer.json"])


def _distributed_worker(rank: int, ports: tuple[int, int], data: str, run_dir: Path) -> None:
    """One of 2 torchrun-like processes: 3 steps, then resume up to 6."""
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    model = dataclasses.replace(TRAIN_MODEL, dropout=0.0)
    for port, steps in zip(ports, (3, 6), strict=True):  # a new port: the old store may linger
        os.environ["MASTER_PORT"] = str(port)
        run_quietly(run_dir, tiny_train_config(data, steps=steps), model, resume=steps > 3)


def _free_ports(count: int) -> tuple[int, ...]:
    with contextlib.ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return tuple(probe.getsockname()[1] for probe in probes)


def test_two_processes_match_one_and_resume(tmp_path, corpus_file):
    run_quietly(tmp_path / "single", tiny_train_config(corpus_file, steps=6),
        dataclasses.replace(TRAIN_MODEL, dropout=0.0))
    run_processes(_distributed_worker, (_free_ports(2), corpus_file, tmp_path / "ddp"),
                  "distributed training")
    single, ddp = weights(tmp_path / "single"), weights(tmp_path / "ddp")
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], atol=1e-6, rtol=0)
    assert [r["step"] for r in records(tmp_path / "ddp")] == [2, 3, 4, 6]  # rank 0 writes


def _step_inputs(seed: int = 0, batch: int = 4, length: int = 24):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, length), generator=generator) for _ in range(4)]


@pytest.mark.parametrize(("optimizer", "lr"), [("adagrad", 0.05), ("adamw", 1e-3)])
def test_batch_split_gives_the_full_batch_gradient(optimizer, lr):
    x1, y1, x2, y2 = _step_inputs()
    results = []
    for split in (1, 2):
        config = TrainConfig(batch_size=4, batch_split=split, optimizer=optimizer, lr=lr,
                             warmup=0, clip=0.0, dtype="float32")
        torch.manual_seed(0)
        model = SpanLM(dataclasses.replace(TRAIN_MODEL, dropout=0.0))
        opt = build_optimizer(model, config)
        scheduler = build_scheduler(opt, config)
        cache, seen = StreamCache(model.empty_cache(4)), []
        for x, y in ((x1, y1), (x2, y2)):  # the second step reads the carried cache
            loss, cache = train_step(model, opt, scheduler, x, y, cache, config)
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            seen.append((loss, grads, [layer.clone() for layer in cache.layers]))
        results.append((seen, model.state_dict()))
    (seen1, state1), (seen2, state2) = results
    for (loss1, grads1, cache1), (loss2, grads2, cache2) in zip(seen1, seen2, strict=True):
        assert float(loss1) == pytest.approx(float(loss2), abs=1e-6)
        for name in grads1:
            torch.testing.assert_close(grads1[name], grads2[name], atol=1e-6, rtol=0)
        for a, b in zip(cache1, cache2, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for name in state1:  # parameters after two steps: fp32 rounding of sums in another order
        torch.testing.assert_close(state1[name], state2[name], atol=1e-6, rtol=1e-5)


def test_per_tensor_clipping_equals_a_hand_computed_adagrad_update():
    """The authors' trainer: per tensor, lr * min(1, clip / ||g||), Adagrad's sum of squares of
    the raw gradients; two steps, so that the second reads the unclipped accumulator."""
    lr, clip, eps = 0.07, 0.03, 1e-10
    config = TrainConfig(batch_size=4, optimizer="adagrad", lr=lr, warmup=0, clip=clip,
                         clip_mode="per-tensor-lr", dtype="float32")
    torch.manual_seed(0)
    model = SpanLM(dataclasses.replace(TRAIN_MODEL, dropout=0.0, span_init=0.5))
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    x1, y1, x2, y2 = _step_inputs()
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    squares = {name: torch.zeros_like(p) for name, p in expected.items()}
    cache, clipped = StreamCache(model.empty_cache(4)), 0
    for x, y in ((x1, y1), (x2, y2)):
        hand = SpanLM(model.config)  # the gradient of the current weights, computed apart
        hand.load_state_dict(model.state_dict())
        log_probs, _ = hand(x, [layer.clone() for layer in cache.layers])
        (F.nll_loss(log_probs.flatten(0, 1), y.flatten()) + hand.span_loss()).backward()
        for name, p in hand.named_parameters():
            g = p.grad
            scale = min(1.0, clip / g.norm().item())
            clipped += scale < 1
            squares[name] += g * g
            expected[name] -= lr * scale * g / (squares[name].sqrt() + eps)
            if name.endswith("z_frac"):
                expected[name].clamp_(0, 1)
        _, cache = train_step(model, optimizer, scheduler, x, y, cache, config)
    assert clipped > 0  # the threshold is active for some tensors
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("optimizer", ["adagrad", "adamw"])
def test_the_optimiser_is_fused_where_torch_offers_it(optimizer):
    """One fused kernel steps every parameter (torch >= 2.4 on the CPU); where the optimiser
    refuses ``fused``, the per-tensor loop, with the same options."""
    model = SpanLM(TRAIN_MODEL)
    built = build_optimizer(model, TrainConfig(optimizer=optimizer, lr=0.5))
    assert built.defaults["fused"] is True and built.defaults["lr"] == 0.5

    class Unfused(torch.optim.Adagrad):
        def __init__(self, params, fused=None, **options):
            if fused:
                raise RuntimeError("fused=True is not supported here")
            super().__init__(params, **options)

    fallback = fused_where_offered(Unfused, model.parameters(), lr=0.25)
    assert not fallback.defaults["fused"] and fallback.defaults["lr"] == 0.25


@pytest.mark.parametrize("kind", [torch.optim.Adagrad, torch.optim.AdamW])
def test_the_optimiser_is_fused_only_on_devices_its_kernel_runs_on(kind):
    """On a device without the optimiser's fused kernel (Adagrad's runs on the CPU only; here
    "meta" stands for CUDA), the per-tensor loop, not an optimiser that fails at its first
    step; on the CPU, fused."""
    assert "cpu" in FUSED_DEVICES[kind] and "meta" not in FUSED_DEVICES[kind]
    assert "cuda" not in FUSED_DEVICES[torch.optim.Adagrad]
    groups = [{"params": [torch.zeros(2, 2, device="meta", requires_grad=True)]}]
    assert not fused_where_offered(kind, groups, lr=0.1).defaults["fused"]
    assert fused_where_offered(kind, [torch.zeros(2, requires_grad=True)],
                               lr=0.1).defaults["fused"] is True


def test_global_clipping_bounds_the_joint_norm_of_the_step():
    config = TrainConfig(batch_size=4, optimizer="adamw", lr=1.0, warmup=0, clip=1e-3,
                         clip_mode="global", weight_decay=0.0)
    model = SpanLM(dataclasses.replace(TRAIN_MODEL, dropout=0.0))
    optimizer = build_optimizer(model, config)
    x, y = _step_inputs()[:2]
    train_step(model, optimizer, build_scheduler(optimizer, config), x, y,
               StreamCache(model.empty_cache(4)), config)
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert grads.norm().item() == pytest.approx(1e-3, rel=1e-4)  # clipped in place


def test_spans_are_clamped_after_a_huge_step():
    config = TrainConfig(batch_size=2, optimizer="adamw", lr=1e3, warmup=0, clip=0.0)
    model = SpanLM(dataclasses.replace(TRAIN_MODEL, span_init=0.5))
    optimizer = build_optimizer(model, config)
    x, y = (t[:2] for t in _step_inputs()[:2])
    train_step(model, optimizer, build_scheduler(optimizer, config), x, y,
               StreamCache(model.empty_cache(2)), config)
    z = torch.cat([layer.attn.span.z_frac.detach() for layer in model.layers])
    assert ((z >= 0) & (z <= 1)).all()
    assert ((z == 0) | (z == 1)).all()  # the step moved every z' far outside [0, 1]


def test_bfloat16_step_runs_under_autocast():
    config = TrainConfig(batch_size=2, optimizer="adamw", lr=1e-3, warmup=0, dtype="bfloat16")
    model = SpanLM(TRAIN_MODEL)
    optimizer = build_optimizer(model, config)
    x, y = (t[:2] for t in _step_inputs()[:2])
    loss, cache = train_step(model, optimizer, build_scheduler(optimizer, config), x, y,
                             StreamCache(model.empty_cache(2)), config)
    assert math.isfinite(loss) and all(layer.shape[0] == 2 for layer in cache.layers)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_lr_factor_warms_up_linearly_then_drops():
    config = TrainConfig(steps=1000, warmup=100, lr_drop_steps=200, lr_drop_factor=0.1)
    assert lr_factor(0, config) == 0.0
    assert lr_factor(50, config) == 0.5
    assert lr_factor(100, config) == 1.0
    assert lr_factor(799, config) == 1.0
    assert lr_factor(800, config) == pytest.approx(0.1)
    assert lr_factor(999, config) == pytest.approx(0.1)
    assert lr_factor(0, dataclasses.replace(config, warmup=0)) == 1.0


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_an_annealed_schedule_decays_from_the_warm_up_to_its_end_factor(schedule):
    """After the warm-up the factor follows end + (1 − end) s(u), u the share of the steps after
    the warm-up done (1 at the last step): s = (1 + cos πu)/2 or 1 − u, written out here at
    u = 0, 1/4, 1/2, 1."""
    config = TrainConfig(steps=501, warmup=100, lr_schedule=schedule, lr_end_factor=0.2)
    shape = {"cosine": [1.0, (1 + math.sqrt(0.5)) / 2, 0.5, 0.0],
             "linear": [1.0, 0.75, 0.5, 0.0]}[schedule]
    assert lr_factor(50, config) == pytest.approx(0.5 * (0.2 + 0.8 * 1.0))  # warming up
    for step, s in zip([100, 200, 300, 500], shape, strict=True):
        assert lr_factor(step, config) == pytest.approx(0.2 + 0.8 * s)
    factors = [lr_factor(step, config) for step in range(100, 501)]  # the steps trained
    assert all(a >= b for a, b in itertools.pairwise(factors))  # never rises again
    # a time budget half used while a tenth of the steps are done: the budget sets the pace
    assert lr_factor(140, config, spent=0.5) == pytest.approx(0.2 + 0.8 * shape[2])
    assert lr_factor(400, config, spent=0.5) == lr_factor(400, config)
    assert lr_factor(140, config, spent=3.0) == pytest.approx(0.2)  # past the budget: the end
    constant = dataclasses.replace(config, lr_schedule="constant")
    assert lr_factor(400, constant, spent=0.9) == 1.0  # the paper's: the budget changes nothing


def test_a_time_budget_anneals_the_run_it_stops(tmp_path, corpus_file):
    """A cosine schedule over a time budget already spent when the first step ends: the
    second step's learning rate is the end factor's, although only 1 of 1,000 steps ran."""
    config = tiny_train_config(corpus_file, steps=1000, warmup=0, lr_schedule="cosine",
                               lr_end_factor=0.25, time_budget=1e-9)
    run_quietly(tmp_path, config)
    state = read_state(tmp_path / STATE_FILE, tensors=False)
    lrs = [group["lr"] for group in state["optimizer"]["param_groups"]]
    assert state["step"] == 1 and lrs == pytest.approx([0.25 * config.lr] * len(lrs))


def test_scheduler_follows_lr_factor():
    config = TrainConfig(steps=10, warmup=4, lr=0.5, lr_drop_steps=3)
    optimizer = build_optimizer(SpanLM(TRAIN_MODEL), config)
    scheduler = build_scheduler(optimizer, config)
    seen = []
    for _ in range(config.steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([0.5 * lr_factor(s, config) for s in range(10)])
    assert seen[:5] == pytest.approx([0.0, 0.125, 0.25, 0.375, 0.5])
