"""adaspan retrofit: spans learned for a frozen Hugging Face causal LM (a tiny random Llama)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import LLAMA_CONTEXT as CONTEXT
from helpers import LLAMA_D_HEAD as D_HEAD
from helpers import LLAMA_KV_HEADS as KV_HEADS
from helpers import LLAMA_LAYERS as LAYERS
from helpers import load_script, tiny_llama
from helpers import retrofit_options as options
from transformers import AutoModelForCausalLM, AutoTokenizer

from adaspan.cli import main
from adaspan.data.corpora import load_corpus
from adaspan.errors import ConfigError
from adaspan.hf import load_pretrained, span_modules
from adaspan.hf.budget import full_cache_bytes, span_cache_bytes
from adaspan.hf.report import REPORT_FILE, measure_retrofit
from adaspan.hf.retrofit import IterateMean, Retrofit, cache_budget, follow, retrofit
from adaspan.run.lock import RunLockedError, WriterLock
from adaspan.runtime.precision import choose

FP32 = choose("float32", torch.device("cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama"))


def z_fracs(run: Retrofit) -> list[torch.Tensor]:
    return [span.z_frac.detach().clone() for span in span_modules(run.model)]


def test_spans_shrink_and_weights_stay(model_dir, tmp_path):
    run = retrofit(options(model_dir, tmp_path / "out"), FP32, progress=False)
    spans = torch.stack([span.spans() for span in span_modules(run.model)])
    assert (spans < CONTEXT).all()  # from S = 64: the penalty shrank every head
    before = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    after = load_pretrained(tmp_path / "out").state_dict()
    assert set(before) <= set(after)  # and the spans
    for name in before:
        assert torch.equal(before[name], after[name]), name
    saved = [span.spans() for span in span_modules(load_pretrained(tmp_path / "out"))]
    assert torch.equal(torch.stack(saved), spans)


def test_without_penalty_distillation_keeps_full_spans(model_dir, tmp_path):
    """At z' = 1 the spans model is the full model: no gradient moves z' above 1."""
    run = retrofit(options(model_dir, tmp_path / "out", span_loss=0.0), FP32, progress=False)
    assert all((z == 1).all() for z in z_fracs(run))


@pytest.mark.parametrize("optimizer, step", [("sgd", 0.05 * 0.1 * CONTEXT / 4), ("adam", 0.05)])
def test_the_first_step_moves_z_by_the_optimizer_s_rule(model_dir, tmp_path, optimizer, step):
    """At z' = 1 every key of a window lies inside the span, so only the penalty lambda / M sum
    z (z = S z', M = 4 heads) has a gradient, lambda S / M per head: SGD steps z' by lr times
    it, Adam's first step by lr whatever its size."""
    run = retrofit(options(model_dir, tmp_path / "out", steps=1, optimizer=optimizer), FP32,
                   progress=False)
    for z in z_fracs(run):
        torch.testing.assert_close(z, torch.full_like(z, 1 - step))


@pytest.mark.parametrize(("schedule", "decay", "budgets"), [
    ("constant", None, [1000, 812.5, 625, 250]), ("cosine", None, [1000, 812.5, 625, 250]),
    ("cosine", 4, [1000, 625, 250, 250]), ("linear", 8, [1000, 812.5, 625, 250])])
def test_the_cache_budget_tightens_until_the_rate_decays(model_dir, tmp_path, schedule, decay,
                                                         budgets):
    config = options(model_dir, tmp_path, steps=8, cache_ratio=4.0, lr_schedule=schedule,
                     lr_decay_steps=decay)
    assert [cache_budget(config, 1000, step) for step in (0, 2, 4, 8)] == budgets


def test_a_cache_ratio_scales_the_penalty_and_meets_the_budget_at_the_end(model_dir, tmp_path):
    """The tiny model's spans shrink by Adam's rate, slower than the budget: the penalty is
    scaled up after every step but the last, which lowers z' to the budget, no further."""
    config = options(model_dir, tmp_path / "out", cache_ratio=2.5, checkpoint_interval=1)
    run = retrofit(config, FP32, progress=False)
    full = full_cache_bytes(run.model.config, CONTEXT, 2)
    held = span_cache_bytes(run.model, CONTEXT, 2)
    assert full / 2.5 - LAYERS * KV_HEADS * 2 * D_HEAD * 2 < held <= full / 2.5
    scales = [entry["penalty_scale"] for entry in run.history]
    assert min(scales[:-1]) > 1 and scales[-1] == 1  # above the budget until the last step


@pytest.mark.parametrize("ratio", [None, 2.5])
def test_averaged_spans_are_the_mean_of_the_last_steps_z(model_dir, tmp_path, monkeypatch,
                                                          ratio):
    """With average_steps = 3 of 6 the steps are those of the run without it, and the z' kept
    is the mean of the clamped z' of steps 4, 5 and 6; under a budget, that mean lowered by
    one shared amount to meet it."""
    after = IterateMean.after

    def runs(name: str, **change) -> tuple[list, Retrofit]:
        seen = []

        def recorded(self, config, step, params):
            seen.append([p.detach().clone() for p in params])  # after the step and its clamp
            after(self, config, step, params)

        monkeypatch.setattr(IterateMean, "after", recorded)
        run = retrofit(options(model_dir, tmp_path / name, cache_ratio=ratio, **change), FP32,
                       progress=False)
        return seen, run

    last, _ = runs("last")
    seen, run = runs("mean", average_steps=3)
    for a, b in zip(last, seen, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    mean = [(a + b + c) / 3 for a, b, c in zip(*seen[3:], strict=True)]
    kept = [p.detach() for p in run.trained()]
    assert not all(torch.equal(m, z) for m, z in zip(mean, seen[-1], strict=True))
    if ratio is None:
        assert all(torch.equal(m, z) for m, z in zip(mean, kept, strict=True))
        return
    full = full_cache_bytes(run.model.config, CONTEXT, 2)
    assert span_cache_bytes(run.model, CONTEXT, 2) <= full / ratio
    lowered = torch.cat([(m - z)[(m < 1) & (z > 0)] for m, z in zip(mean, kept, strict=True)])
    assert lowered.numel() and (lowered > 0).all()
    torch.testing.assert_close(lowered, torch.full_like(lowered, lowered[0].item()))


@pytest.mark.parametrize("steps", [0, 7, 2.5])
def test_average_steps_outside_the_run_are_refused(model_dir, tmp_path, steps):
    with pytest.raises(ConfigError, match=f"average_steps must be an integer from 1 to "
                                          f"steps=6, got {steps}"):
        options(model_dir, tmp_path / "out", average_steps=steps)


@pytest.mark.parametrize(("held", "budget", "scale"), [
    (100, 100, 1.0), (90, 100, 1.0), (105, 100, math.e), (110, 100, math.e ** 2)])
def test_the_penalty_scale_follows_the_budget(held, budget, scale):
    assert follow(held, budget) == pytest.approx(scale, rel=1e-12)


@pytest.mark.parametrize(("name", "message"), [
    ("optimizer", "optimizer must be one of adam, sgd, got 'lbfgs'"),
    ("retrieval_loss", "retrieval_loss must be one of answer, answer_sum, all, got 'lbfgs'")])
def test_an_unknown_choice_is_refused(model_dir, tmp_path, name, message):
    with pytest.raises(ConfigError, match=message):
        options(model_dir, tmp_path / "out", **{name: "lbfgs"})


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_a_retrieval_weight_not_above_zero_is_refused(model_dir, tmp_path, weight):
    with pytest.raises(ConfigError, match="retrieval_weight must be a number > 0"):
        options(model_dir, tmp_path / "out", retrieval_weight=weight)


@pytest.mark.parametrize(("change", "message"), [
    ({"lr_schedule": "step"}, "lr_schedule must be one of constant, cosine, linear, got 'step'"),
    ({"lr_end_factor": 1.5}, r"lr_end_factor must lie in \[0, 1\], got 1.5"),
    ({"lr_end_factor": float("nan")}, r"lr_end_factor must lie in \[0, 1\], got nan"),
    ({"lr_schedule": "cosine", "lr_decay_steps": 0}, "lr_decay_steps must be a positive int"),
    ({"lr_decay_steps": 3}, "lr_decay_steps sets how long the rate decays: give it with")])
def test_a_bad_learning_rate_schedule_is_refused(model_dir, tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        options(model_dir, tmp_path / "out", **change)


@pytest.mark.parametrize(("schedule", "decay_steps", "rate"), [
    ("constant", None, lambda t: 1.0),
    ("cosine", None, lambda t: 0.25 + 0.75 * (1 + math.cos(math.pi * t / 5)) / 2),
    ("linear", None, lambda t: 0.25 + 0.75 * (1 - t / 5)),
    ("linear", 3, lambda t: 1.0 if t < 3 else 0.25 + 0.75 * (1 - (t - 3) / 2)),
    ("cosine", 9, lambda t: 0.25 + 0.75 * (1 + math.cos(math.pi * t / 5)) / 2)])
def test_each_step_takes_the_learning_rate_of_its_schedule(model_dir, tmp_path, monkeypatch,
                                                          schedule, decay_steps, rate):
    """Step t of 6 (from 0) runs at lr * rate(t): from lr to lr * lr_end_factor at t = 5,
    over the last ``lr_decay_steps`` steps (all 6 where it is None or more)."""
    used = []
    step = Retrofit.train_step

    def recorded(self, precision):
        losses = step(self, precision)
        used.append(self.optimizer.param_groups[0]["lr"])
        return losses

    monkeypatch.setattr(Retrofit, "train_step", recorded)
    retrofit(options(model_dir, tmp_path / "out", lr_schedule=schedule, lr_end_factor=0.25,
                     lr_decay_steps=decay_steps), FP32, progress=False)
    assert used == pytest.approx([0.05 * rate(t) for t in range(6)], rel=1e-12)


@pytest.mark.parametrize(("schedule", "ratio", "average"), [
    ("constant", None, None), ("cosine", None, None), ("constant", 3.0, None),
    ("cosine", 3.0, 4)])
def test_interrupted_and_resumed_gives_the_same_spans(model_dir, tmp_path, monkeypatch,
                                                      schedule, ratio, average):
    first = retrofit(options(model_dir, tmp_path / "whole", lr_schedule=schedule,
                             cache_ratio=ratio, average_steps=average), FP32, progress=False)
    whole = z_fracs(first)
    step = Retrofit.train_step

    def interrupted(self, precision):
        if self.step == 3:  # after the checkpoint of step 2: step 3 saved on the interrupt
            raise KeyboardInterrupt
        return step(self, precision)

    monkeypatch.setattr(Retrofit, "train_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        retrofit(options(model_dir, tmp_path / "parts", lr_schedule=schedule,
                         cache_ratio=ratio, average_steps=average), FP32, progress=False)
    monkeypatch.setattr(Retrofit, "train_step", step)
    shutil.copytree(tmp_path / "parts", tmp_path / "moved")  # resumed where it was copied to
    resumed = retrofit(options(model_dir, tmp_path / "moved", lr_schedule=schedule,
                               cache_ratio=ratio, average_steps=average), FP32, resume=True,
                       progress=False)
    assert resumed.step == 6
    for a, b in zip(whole, z_fracs(resumed), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(whole[0], torch.ones_like(whole[0]))  # the spans did move
    assert resumed.history == first.history  # steps 2, 4 and 6, wherever the run stopped


def test_history_holds_the_spans_after_each_checkpoint(model_dir, tmp_path, monkeypatch):
    """Steps 2, 4 and 6 (a checkpoint every 2 of 6): that step's loss terms and spans."""
    seen = {}
    step = Retrofit.train_step

    def watched(self, precision):
        losses = step(self, precision)
        seen[self.step] = (losses, [span.spans().tolist() for span in span_modules(self.model)])
        return losses

    monkeypatch.setattr(Retrofit, "train_step", watched)
    run = retrofit(options(model_dir, tmp_path / "out", steps=5), FP32, progress=False)
    assert [record["step"] for record in run.history] == [2, 4, 5]  # and the last step
    for record in run.history:
        assert (record["losses"], record["spans"]) == seen[record["step"]]
    assert run.history[-1]["spans"] == [span.spans().tolist() for span in
                                        span_modules(run.model)]
    assert run.history[0]["spans"] != run.history[-1]["spans"]


def test_report_numbers_against_direct_computation(model_dir, tmp_path):
    run = retrofit(options(model_dir, tmp_path / "out"), FP32, progress=False)
    report = measure_retrofit(run, choose("float32", torch.device("cpu"), "score"),
                              eval_bytes=CONTEXT, new_tokens=4, rounds=1)
    # one window of 64 byte tokens: the model's own loss over its 63 predictions
    text = bytes(load_corpus("kjv").valid[:CONTEXT])
    ids = AutoTokenizer.from_pretrained(model_dir)(text.decode(), add_special_tokens=False)
    ids = torch.tensor(ids["input_ids"])[None]
    own = AutoModelForCausalLM.from_pretrained(model_dir)(input_ids=ids, labels=ids).loss.item()
    full = report["heldout"]["full"]
    assert full["perplexity"] == pytest.approx(math.exp(own), rel=1e-5)
    assert full["bits_per_byte"] == pytest.approx(own * 63 / math.log(2) / CONTEXT, rel=1e-5)
    kv = report["cache"]["kv_bytes"]
    assert kv["full"] == kv["full_formula"] == LAYERS * 2 * KV_HEADS * CONTEXT * D_HEAD * 4
    # the span cache keeps, per layer, the window - 1 keys before the next token
    windows = [min(CONTEXT, math.ceil(max(layer))) for layer in report["spans"]]
    assert kv["spans"] == sum(2 * KV_HEADS * (w - 1) * D_HEAD * 4 for w in windows)
    assert report["spans"] == [s.spans().tolist() for s in span_modules(run.model)]


def test_cli_writes_the_report(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["retrofit", str(model_dir), "--data", "kjv", "--out", str(out), "--steps",
                 "2", "--context", "64", "--ramp", "4", "--eval-bytes", "100",
                 "--decode-tokens", "2", "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / REPORT_FILE).read_text())
    assert printed.keys() == written.keys()  # printed rounded to 6 digits
    assert printed["cache"]["kv_bytes"] == written["cache"]["kv_bytes"]
    assert printed["steps"] == 2 and len(printed["spans"]) == LAYERS
    assert [record["step"] for record in written["history"]] == [2]  # the last step
    cpu = torch.device("cpu")
    assert written["training_precision"] == choose("auto", cpu, "train").record()
    assert written["precision"] == choose("auto", cpu, "score").record()
    trained = written["training_precision"]["dtype"]
    assert f"trained in {trained}, scored in float32 on cpu" in (out / "retrofit.md").read_text()
    assert written["history"][0]["spans"] == written["spans"]
    row = "| 2 | " + " | ".join(f"{s:,.0f}" for layer in written["spans"] for s in layer) + " |"
    assert row in (out / "retrofit.md").read_text().splitlines()


@pytest.mark.parametrize("change, message", [
    (["--span-loss", "-1"], "span_loss must be a number >= 0"),
    (["--context", "128"], "max_span=128 is longer than the model's positions"),
    (["--resume"], "holds no retrofit to resume"),
    (["--lr-schedule", "cosine", "--lr-end-factor", "2"], "lr_end_factor must lie in [0, 1]"),
    (["--lr-decay-steps", "3"], "lr_decay_steps sets how long the rate decays"),
    (["--cache-ratio", "0.5"], "cache_ratio must be a number >= 1"),
    (["--method", "duo", "--cache-ratio", "2"], "method 'duo' has none"),
    (["--span-loss", "0", "--cache-ratio", "2"], "give it a span_loss > 0"),
    (["--reallocate", "-1"], "reallocate must be an integer >= 0"),
    (["--method", "duo", "--reallocate", "2"], "reallocate acts on spans"),
    (["--reallocate", "2", "--reallocate-guard", "1"], "give it with reallocate and retrieval"),
    (["--context", "64", "--ramp", "4", "--cache-ratio", "1000"],
     "cannot be met: ask for less, or a shorter ramp"),
])
def test_cli_one_line_errors(model_dir, tmp_path, capsys, change, message):
    args = ["retrofit", str(model_dir), "--data", "kjv", "--out", str(tmp_path / "o"),
            "--steps", "1", "--no-progress", *change]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_cli_refuses_a_missing_model_and_a_used_out(model_dir, tmp_path, capsys):
    assert main(["retrofit", str(tmp_path / "none"), "--data", "kjv", "--out",
                 str(tmp_path / "o")]) == 2
    assert "no model directory" in capsys.readouterr().err
    retrofit(options(model_dir, tmp_path / "used", steps=1), FP32, progress=False)
    assert main(["retrofit", str(model_dir), "--data", "kjv", "--out",
                 str(tmp_path / "used")]) == 2
    err = capsys.readouterr().err
    assert "holds a retrofit: --resume continues it" in err and err.count("\n") == 1
    assert main(["retrofit", str(model_dir), "--data", "kjv", "--out", str(tmp_path / "used"),
                 "--resume", "--steps", "2"]) == 2  # other options than its own
    assert "retrofitted with other options (ramp, context" in capsys.readouterr().err


def test_train_hf_model_script(tmp_path):
    script = load_script("train_hf_model")
    out = tmp_path / "llama"
    result = script.train(script.parse_args([
        "--data", "kjv", "--out", str(out), "--steps", "3", "--context", "32",
        "--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--d-ff", "64",
        "--batch-size", "2", "--warmup", "1", "--valid-bytes", "100", "--threads", "0"]))
    assert result["steps"] == 3 and 0 < result["valid_bpb"] < 9 and result["marked_nll"] == {}
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("hé", add_special_tokens=False)["input_ids"] == [
        b + script.OFFSET for b in "hé".encode()]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_key_value_heads == 2 and model.config.max_position_embeddings == 32


def test_train_hf_model_gives_the_same_weights_for_a_seed(tmp_path, capsys):
    """Text, copy and retrieval steps on two threads: one seed gives the same weights to the
    bit on one machine; another seed gives other weights."""
    script = load_script("train_hf_model")

    def weights(seed: int, name: str) -> dict[str, torch.Tensor]:
        script.train(script.parse_args([
            "--data", "kjv", "--out", str(tmp_path / name), "--steps", "6", "--context", "512",
            "--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--d-ff",
            "64", "--copy", "0.4", "--retrieval", "0.4", "--lengths", "512", "--copy-length",
            "64", "--tokens-per-step", "512", "--warmup", "1", "--valid-bytes", "100",
            "--haystack-bytes", "20000", "--threads", "2", "--seed", str(seed),
            "--log-every", "1"]))
        return AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()

    first, again, other = weights(0, "a"), weights(0, "b"), weights(1, "c")
    kinds = {json.loads(line)["kind"] for line in capsys.readouterr().out.splitlines()
             if line.startswith('{"step"')}
    assert kinds == {"text", "copy", "retrieval"}
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not all(torch.equal(first[name], other[name]) for name in first)


def test_train_hf_model_reports_the_late_loss_of_the_marked_tokens(tmp_path, capsys):
    """The result holds, per kind of marked step, the mean marked NLL of its last tenth of
    steps (as logged at every step here); text steps mark nothing."""
    script = load_script("train_hf_model")
    assert script.late_mean([5.0, 4.0, 3.0, 2.0, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0]) == 4.0
    assert script.late_mean([9.0, 3.0, 1.0], share=0.5) == 2.0
    assert script.late_mean([7.0]) == 7.0
    result = script.train(script.parse_args([
        "--data", "kjv", "--out", str(tmp_path / "m"), "--steps", "20", "--context", "64",
        "--d-model", "32", "--layers", "1", "--heads", "4", "--kv-heads", "2", "--d-ff", "64",
        "--copy", "1", "--copy-length", "64", "--tokens-per-step", "256", "--answer-weight",
        "3", "--warmup", "1", "--valid-bytes", "100", "--threads", "0", "--log-every", "1"]))
    logged = [json.loads(line) for line in capsys.readouterr().out.splitlines()
              if line.startswith('{"step"')]
    assert [r["kind"] for r in logged] == ["copy"] * 20
    assert set(result["marked_nll"]) == {"copy"}
    assert result["marked_nll"]["copy"] == pytest.approx(
        sum(r["marked_nll"] for r in logged[-2:]) / 2, abs=1e-3)


def test_train_hf_model_copies_stretches_at_random_distances():
    """Each copy row repeats stretches of 8 to 32 tokens of itself further on, the copies'
    targets after their first weighed apart."""
    script = load_script("train_hf_model")
    tokens = np.random.default_rng(0).integers(0, 256, 10_000).astype(np.uint8)
    rows, weights = script.copy_batch(tokens, np.random.default_rng(1), 16, 128, 5.0)
    assert rows.shape == (16, 128) and weights.shape == (16, 127)
    assert weights.unique().tolist() == [1.0, 5.0] and ((weights == 5).sum(1) >= 7).all()
    distances = set()
    for row in rows.tolist():
        found = [(a, b) for a in range(120) for b in range(a + 8, 121)
                 if row[a:a + 8] == row[b:b + 8]]
        assert found  # random bytes repeat 8 in a row only where copied
        distances |= {b - a for a, b in found}
    assert len(distances) > 8  # not one fixed distance back


@pytest.mark.parametrize("far", [0.0, 0.5, 1.0])
def test_train_hf_model_puts_a_share_of_needles_far_back(far, monkeypatch):
    """With ``--far P`` a share of about P of the retrieval prompts has its needle in the first
    tenth of the haystack, the others anywhere in it."""
    script = load_script("train_hf_model")
    depths, original = [], script.make

    def make(*args):
        depths.append(args[3])
        return original(*args)

    args = script.parse_args(["--data", "kjv", "--out", "unused", "--context", "512",
                              "--retrieval", "1", "--tokens-per-step", "512", "--far", str(far)])
    text = bytes(load_corpus("kjv", progress=False).train[:50_000]).decode()
    haystack = script.Haystack(text, script.ByT5Tokenizer(extra_ids=0))
    monkeypatch.setattr(script, "make", make)
    rng = np.random.default_rng(0)
    for step in range(60):
        script.retrieval_batch(args, haystack, rng, step)
    near_start = sum(depth <= 0.1 for depth in depths)
    expected = 60 * (0.1 + 0.9 * far)  # the others fall in the first tenth by chance
    assert len(depths) == 60 and min(depths) >= 0 and abs(near_start - expected) < 15
    assert far == 1 or max(depths) > 0.8


def test_evidence_model_stages():
    """Six stages, the last with far needles; a stage of 0 steps or left off is skipped (by
    default ``final``)."""
    script = load_script("evidence_model")
    base = ["--data", "kjv", "--out", "unused"]
    stages = dict(script.stages(script.parse_args(base)))
    assert list(stages) == ["copy", "short", "long", "longest", "far"]
    far = stages["far"]
    assert far[far.index("--far") + 1] == "0.5" and far[-1] == "1500"
    assert sum(int(options[-1]) for options in stages.values()) == 8000
    every = dict(script.stages(script.parse_args([*base, "--steps", "1,2,3,4,5,6"])))
    assert list(every) == ["copy", "short", "long", "longest", "final", "far"]
    for steps in ("1,2,3,4,5", "1,2,3,4,5,0"):
        stages = script.stages(script.parse_args([*base, "--steps", steps]))
        assert [options[-1] for _, options in stages] == ["1", "2", "3", "4", "5"]
    with pytest.raises(SystemExit):
        script.parse_args([*base, "--steps", "1,2,3,4,5,6,7"])


def test_evidence_model_script(tmp_path, capsys):
    """The stages and the evaluation run end to end at a tiny size; a second run keeps the
    stages saved and scores again."""
    script = load_script("evidence_model")
    argv = ["--data", "kjv", "--out", str(tmp_path / "ev"), "--context", "512", "--shape",
            "1,32,4,2,64", "--steps", "2,2,2,2,2,2", "--short-lengths", "384", "--long-lengths",
            "512", "--copy-length", "64", "--tokens-per-step", "1024", "--eval-lengths", "512",
            "--depths", "0.5", "--samples", "1", "--threads", "1"]
    result = script.main(argv)
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
    assert [stage["stage"] for stage in result["stages"]] == ["copy", "short", "long", "longest",
                                                               "final", "far"]
    assert all(stage["steps"] == 2 for stage in result["stages"])
    assert set(result["haystacks"]) == {"test", "kjv"}
    assert result["machine"]["cpu"] and result["machine"]["threads"] == 1
    assert result["machine"]["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()
    for scored in result["haystacks"].values():
        assert set(scored["accuracy"]) == {"passkey", "single_needle"}
        assert 0 <= scored["least_cell"] <= min(scored["accuracy"]["passkey"].values())
    test_split = bytes(load_corpus("kjv", progress=False).split("test"))
    assert (tmp_path / "ev" / "test-haystack.txt").read_bytes() == test_split
    saved = (tmp_path / "ev" / "copy" / "model.safetensors").stat().st_mtime
    assert script.main(argv)["stages"] == result["stages"]
    assert (tmp_path / "ev" / "copy" / "model.safetensors").stat().st_mtime == saved


def test_retrofit_experiment_script(model_dir, tmp_path, capsys):
    script = load_script("retrofit_experiment")
    args = [str(model_dir), "--data", "kjv", "--out", str(tmp_path / "x"), "--span-losses",
            "0,0.5", "--steps", "3", "--context", "64", "--ramp", "4", "--lr", "0.1"]
    assert script.main([*args, "--train-only"]) == [{"span_loss": 0.0, "steps": 3},
                                                    {"span_loss": 0.5, "steps": 3}]
    capsys.readouterr()
    results = script.main([*args, "--eval-bytes", "100", "--decode-tokens", "2", "--rounds",
                           "1", "--lock", str(tmp_path / "lock")])  # measured, not retrained
    assert json.loads(capsys.readouterr().out) == results
    free, penalised = results
    # at S: the span cache holds the S - 1 keys before the next token, the full cache S
    assert free["kv_smaller"] == 64 / 63
    assert free["bits_per_byte_change"] == pytest.approx(0.0, abs=1e-6)
    assert penalised["kv_bytes_spans"] < penalised["kv_bytes"]
    assert max(map(max, penalised["spans"])) < 64


def test_one_writer(model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lock = WriterLock(out)
    lock.acquire()
    try:
        with pytest.raises(RunLockedError, match="being written by another process"):
            retrofit(options(model_dir, out), FP32, progress=False)
    finally:
        lock.release()


def test_spans_per_key_value_head_shrink_and_resume_a_run_saved_without_the_option(
        model_dir, tmp_path):
    """--per-kv-head: one span per key/value head, shrunk by the penalty; a run whose settings
    predate the option (no per_kv_head saved) resumes as one span per query head."""
    run = retrofit(options(model_dir, tmp_path / "kv", per_kv_head=True), FP32, progress=False)
    kv_heads = run.model.config.num_key_value_heads
    assert [s.n_heads for s in span_modules(run.model)] == [kv_heads] * len(z_fracs(run))
    assert all((s.spans() < CONTEXT).all() for s in span_modules(run.model))
    out = tmp_path / "old"
    retrofit(options(model_dir, out, steps=2), FP32, progress=False)
    settings = json.loads((out / "retrofit_settings.json").read_text())
    del settings["per_kv_head"]
    (out / "retrofit_settings.json").write_text(json.dumps(settings))
    resumed = retrofit(options(model_dir, out, steps=4), FP32, resume=True, progress=False)
    assert resumed.step == 4
    with pytest.raises(ConfigError, match="per_kv_head must be true or false"):
        options(model_dir, out, per_kv_head="yes")
