"""Spans moved between heads after the last step (adaspan.hf.reallocate), against losses whose
best allocation is known, and in a retrofit of the tiny Llama."""

from __future__ import annotations

import pytest
import torch
from helpers import retrofit_options as options
from helpers import tiny_hf, tiny_llama

from adaspan.errors import ConfigError
from adaspan.hf import add_spans, span_modules
from adaspan.hf.budget import span_cache_bytes
from adaspan.hf.reallocate import movable, reallocate
from adaspan.hf.retrofit import Retrofit, objective, reallocation_batches, retrofit
from adaspan.runtime.precision import choose

FP32 = choose("float32", torch.device("cpu"))
S, CONTEXT = 64, 80


def spanned(z: list[float]):
    """The tiny Llama with one span per key/value head (2 layers of 2), z given in positions."""
    model = add_spans(tiny_hf("llama"), max_span=S, ramp=4, per_kv_head=True)
    with torch.no_grad():
        for i, span in enumerate(span_modules(model)):
            span.z_frac.copy_(torch.tensor(z[2 * i:2 * i + 2]) / S)
    return model


def zs(model) -> list[float]:
    return [v * S for span in span_modules(model) for v in span.z_frac.tolist()]


def quadratic(model, target: list[float], weight: list[float]):
    """sum_h w_h (z_h - t_h)^2."""
    def loss() -> float:
        return sum(w * (z - t) ** 2 for z, t, w in zip(zs(model), target, weight, strict=True))
    return loss


def test_the_exchange_finds_the_best_allocation_of_a_separable_loss():
    """Targets that sum to the positions held: the moves reach them to the least step, the
    bytes held do not rise (a move that rounds a window up is trimmed) and every kept move
    lowers the loss."""
    model = spanned([20.3, 19.6, 20.2, 19.9])
    target = [4, 36, 29, 11]
    start = span_cache_bytes(model, CONTEXT, 2)
    log = reallocate(model, quadratic(model, target, [1, 2, 3, 1]), rounds=40,
                     step=16, context=CONTEXT)
    assert zs(model) == pytest.approx(target, abs=1.0)
    assert span_cache_bytes(model, CONTEXT, 2) <= start
    for record in log:
        assert (record["moved"] < record["loss"]) == record["kept"]
    kept = [r for r in log if r["kept"]]
    assert [r["loss"] for r in kept[1:]] == [r["moved"] for r in kept[:-1]]
    assert log[-1]["step"] == 1.0


def test_a_move_that_does_not_lower_the_loss_is_undone_and_the_step_halves():
    model = spanned([20, 20, 20, 20])
    log = reallocate(model, quadratic(model, [20, 20, 20, 20], [1, 1, 1, 1]), rounds=3,
                     step=8, context=CONTEXT)
    assert zs(model) == [20, 20, 20, 20]
    assert [(r["step"], r["kept"]) for r in log] == [(8, False), (4, False), (2, False)]


def test_heads_at_s_neither_give_nor_take():
    """A loss that wants the head at S (z + R = S: its window holds every position) to give
    its positions: it keeps them."""
    model = spanned([20, 20, 20, S - 4])
    donors, receivers = movable(model, 16)
    assert (1, 1) not in donors and (1, 1) not in receivers
    reallocate(model, quadratic(model, [20, 20, 20, 0], [1, 1, 1, 1]), rounds=5,
               step=16, context=CONTEXT)
    assert zs(model) == [20, 20, 20, S - 4]
    assert (1, 1) in movable(spanned([20, 20, 20, S - 4.5]), 16)[0]
    assert movable(spanned([0, 20, 20, 20]), 16)[0] == [(0, 1), (1, 0), (1, 1)]  # z < step


def test_a_guard_keeps_only_the_moves_that_do_not_raise_it():
    """The loss wants 16 positions of head 0 in head 1; a guard that rises once head 0 holds
    fewer than 16 lets it give 4 (of the 16, 8, 4 tried): a move is kept only if the loss
    falls and the guard does not rise, each measured before and with it; unguarded, head 0
    gives all 16."""
    target, weight = [4, 36, 20, 20], [1, 1, 1, 1]
    model = spanned([20, 20, 20, 20])
    log = reallocate(model, quadratic(model, target, weight), rounds=10, step=16,
                     context=CONTEXT, guard=lambda: max(0.0, 16 - zs(model)[0]))
    assert zs(model) == [16, 24, 20, 20]
    assert [(r["step"], r["guard_moved"], r["kept"]) for r in log[:3]] == [
        (16, 12, False), (8, 4, False), (4, 0, True)]
    for record in log:
        assert record["guard_loss"] == 0
        assert record["kept"] == (record["moved"] < record["loss"]
                                  and record["guard_moved"] == 0)
        assert (record["guard_moved"] is None) == (record["moved"] >= record["loss"])
    unguarded = spanned([20, 20, 20, 20])
    reallocate(unguarded, quadratic(unguarded, target, weight), rounds=10, step=16,
               context=CONTEXT)
    assert zs(unguarded) == target


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"))


def test_a_retrofit_ends_with_the_moves_that_lower_its_loss(model_dir, tmp_path):
    """The same run with and without reallocate: the moves start from the other run's spans,
    lower the loss on the windows after the last step and hold no more bytes."""
    change = dict(cache_ratio=2.0, per_kv_head=True)
    plain = retrofit(options(model_dir, tmp_path / "plain", **change), FP32, progress=False)
    moved = retrofit(options(model_dir, tmp_path / "moved", reallocate=4, **change), FP32,
                     progress=False)
    rounds = moved.reallocation["rounds"]
    assert moved.reallocation["step"] == 6 and 1 <= len(rounds) <= 4
    scored = reallocation_batches(moved)[0]
    before = objective(plain, FP32, scored)
    assert rounds[0]["loss"] == before
    assert objective(moved, FP32, scored) == min(before, *(r["moved"] for r in rounds))
    assert (span_cache_bytes(moved.model, 64, 2) <= span_cache_bytes(plain.model, 64, 2))


def test_a_retrofit_guarded_by_retrieval_prompts_never_ends_above_their_loss(tmp_path):
    """With reallocate_guard, the guard is the loss on the retrieval prompts of the steps
    after the scored windows, first of the plain run's spans; no kept move raises it, so the
    spans end at most at the plain run's, with the last kept move's."""
    model_dir = tiny_llama(tmp_path / "llama", positions=400)
    change = dict(cache_ratio=2.0, per_kv_head=True, context=400, retrieval=0.5)
    plain = retrofit(options(model_dir, tmp_path / "plain", **change), FP32, progress=False)
    guarded = retrofit(options(model_dir, tmp_path / "guarded", reallocate=4,
                               reallocate_guard=2, **change), FP32, progress=False)
    scored, prompts = reallocation_batches(guarded)
    assert len(scored) == 2 and len(prompts) == 2
    assert all(len(x) == 2 and torch.equal(x, guarded.data.retrieval_rows(9 + i, 2)[0])
               for i, (x, _) in enumerate(prompts))
    rounds = guarded.reallocation["rounds"]
    before = objective(plain, FP32, prompts)
    assert rounds and rounds[0]["guard_loss"] == before
    kept = [r for r in rounds if r["kept"]]
    assert all(r["guard_moved"] <= r["guard_loss"] for r in kept)
    assert [r["guard_loss"] for r in rounds[1:]] == [
        *(r["guard_moved"] if r["kept"] else r["guard_loss"] for r in rounds[:-1])]
    assert objective(guarded, FP32, prompts) == (kept[-1]["guard_moved"] if kept else before)


def test_a_finished_retrofit_resumed_with_reallocate_moves_once(model_dir, tmp_path,
                                                                monkeypatch):
    change = dict(cache_ratio=2.0, per_kv_head=True)
    whole = retrofit(options(model_dir, tmp_path / "whole", reallocate=3, **change), FP32,
                     progress=False)
    retrofit(options(model_dir, tmp_path / "later", **change), FP32, progress=False)
    later = retrofit(options(model_dir, tmp_path / "later", reallocate=3, **change), FP32,
                     resume=True, progress=False)
    assert later.reallocation == whole.reallocation
    for a, b in zip(span_modules(whole.model), span_modules(later.model), strict=True):
        assert torch.equal(a.z_frac, b.z_frac)

    def again(*args, **kwargs):
        raise AssertionError("the moves of this step were made")

    monkeypatch.setattr("adaspan.hf.retrofit.reallocate", again)
    retrofit(options(model_dir, tmp_path / "later", reallocate=3, **change), FP32,
             resume=True, progress=False)


@pytest.mark.parametrize(("change", "message"), [
    ({"reallocate": -1}, "reallocate must be an integer >= 0"),
    ({"reallocate": 1.5}, "reallocate must be an integer >= 0"),
    ({"reallocate_batches": 0}, "reallocate_batches must be a positive integer, got 0"),
    ({"reallocate": 2, "method": "duo"}, "method 'duo' has none"),
    ({"reallocate": 2, "retrieval": 0.5, "reallocate_guard": -1},
     "reallocate_guard must be an integer >= 0"),
    ({"reallocate": 2, "reallocate_guard": 1}, "give it with reallocate and retrieval"),
    ({"retrieval": 0.5, "reallocate_guard": 1}, "give it with reallocate and retrieval")])
def test_bad_reallocate_options_are_refused(model_dir, tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        options(model_dir, tmp_path / "out", **change)


def test_reallocate_is_not_taken_before_the_last_step(model_dir, tmp_path, monkeypatch):
    """An interrupted run has made no moves: they come after its last step."""
    step = Retrofit.train_step

    def interrupted(self, precision):
        if self.step == 3:
            raise KeyboardInterrupt
        return step(self, precision)

    monkeypatch.setattr(Retrofit, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        retrofit(options(model_dir, tmp_path / "out", reallocate=2), FP32, progress=False)
    monkeypatch.setattr(Retrofit, "train_step", step)
    run = retrofit(options(model_dir, tmp_path / "out", reallocate=2), FP32, resume=True,
                   progress=False)
    assert run.reallocation["step"] == 6
