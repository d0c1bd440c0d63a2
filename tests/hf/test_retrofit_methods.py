"""What adaspan retrofit trains and on what: spans with sinks and a penalty per byte of cache,
DuoAttention's gates (--method duo), retrieval prompts mixed into the windows, a resumed run
given more steps equal to one run of as many, and the objective of spans as learned and as
edited (``scripts/experiments/span_objective.py``)."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from helpers import load_script, tiny_llama
from helpers import retrofit_options as options
from transformers import AutoTokenizer

from adaspan.cli import main
from adaspan.errors import ConfigError
from adaspan.hf import load_pretrained, span_modules
from adaspan.hf.budget import cache_loss, position_bytes
from adaspan.hf.duo import read_gates
from adaspan.hf.methods import METHODS, span_parameters, span_penalty
from adaspan.hf.retrofit import Retrofit, full_attention, load_frozen, retrofit, span_losses
from adaspan.hf.retrofit_data import TrainData, window_batch
from adaspan.runtime.precision import choose

FP32 = choose("float32", torch.device("cpu"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama"), positions=400)


@pytest.mark.parametrize("retrieval_weight", [1.0, 2.5])
@pytest.mark.parametrize("retrieval_loss", ["answer", "answer_sum", "all"])
def test_retrieval_prompts_replace_the_last_windows(model_dir, tmp_path, retrieval_loss,
                                                    retrieval_weight):
    """The last rows are prompts scored where ``retrieval_loss`` says, each scored position
    weighing ``retrieval_weight`` times its loss's weight; the windows' positions weigh 1."""
    config = options(model_dir, tmp_path, context=400, batch_size=4, retrieval=0.5,
                     retrieval_tasks="passkey,single_needle", retrieval_loss=retrieval_loss,
                     retrieval_weight=retrieval_weight)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = TrainData.read(config, tokenizer)
    x, scored = data.batch(3)
    assert x.shape == scored.shape == (4, 400)
    assert all(torch.equal(a, b) for a, b in zip((x, scored), data.batch(3), strict=True))
    assert torch.equal(x[:2], window_batch(data.tokens, config, 3)[:2])
    assert (scored[:2] == 1).all()
    for row, row_scored in zip(x[2:], scored[2:], strict=True):
        text = tokenizer.decode(row, skip_special_tokens=True)
        value = text.rsplit(" ", 1)[-1].rstrip(".")  # the answer, after the question
        assert value.isdigit() and text.count(value) >= 2  # where it was hidden, and answered
        if retrieval_loss == "all":
            assert (row_scored == retrieval_weight).all()
        else:  # exactly the positions whose next token is the answer's
            predicted = row[1:][row_scored[:-1] > 0]
            assert tokenizer.decode(predicted).strip() == f"{value}." and not row_scored[-1]
            weight = len(predicted) if retrieval_loss == "answer_sum" else 1  # sum, or mean
            assert set(row_scored[row_scored > 0].tolist()) == {weight * retrieval_weight}
    assert not torch.equal(x[2:], data.batch(4)[0][2:])


@pytest.mark.parametrize("far", [0.0, 1.0])
def test_retrieval_far_puts_the_needles_in_the_haystack_s_first_tenth(model_dir, tmp_path, far,
                                                                      monkeypatch):
    """``retrieval_far=1``: every training prompt's needle lies in the first tenth of its
    haystack; without it, anywhere."""
    import adaspan.hf.retrofit_data as retrofit_data

    depths, original = [], retrofit_data.make
    monkeypatch.setattr(retrofit_data, "make",
                        lambda *args: depths.append(args[3]) or original(*args))
    config = options(model_dir, tmp_path, context=400, batch_size=4, retrieval=0.5,
                     retrieval_far=far)
    data = TrainData.read(config, AutoTokenizer.from_pretrained(model_dir))
    for step in range(10):
        data.batch(step)
    assert len(depths) == 1 + 20  # TrainData.read's check of the task, then 2 a step
    assert max(depths[1:]) <= 0.1 if far else max(depths[1:]) > 0.5
    with pytest.raises(ConfigError, match="retrieval_far is a share"):
        options(model_dir, tmp_path, retrieval_far=1.5)


@pytest.mark.parametrize(("shortest", "far_full"), [(None, 1.0), (250, 1.0), (250, 0.0)])
def test_retrieval_min_length_draws_each_prompt_s_length(model_dir, tmp_path, shortest,
                                                         far_full, monkeypatch):
    """``retrieval_min_length``: each training prompt's length is drawn from it to the
    context, but one whose needle lies in the first tenth fills the context (unless
    ``retrieval_far_full`` is 0); the prompt (its answer after it, then padding) fills its
    row. Without it every prompt fills the context."""
    import adaspan.hf.retrofit_data as retrofit_data

    samples, original = [], retrofit_data.make
    monkeypatch.setattr(retrofit_data, "make",
                        lambda *args: samples.append(original(*args)) or samples[-1])
    config = options(model_dir, tmp_path, context=400, batch_size=2, retrieval=1.0,
                     retrieval_min_length=shortest, retrieval_far=0.5,
                     retrieval_far_full=far_full)
    data = TrainData.read(config, AutoTokenizer.from_pretrained(model_dir))
    assert samples.pop().length == (shortest or 400)  # the shortest prompt fits
    rows = [data.batch(step) for step in range(8)]
    lengths = [sample.length for sample in samples]
    assert min(lengths) >= (shortest or 400) and max(lengths) <= 400
    assert len(set(lengths)) > 4 if shortest else set(lengths) == {400}
    far = [sample.length for sample in samples if sample.depth <= 0.1]
    assert far and (set(far) == {400}) == (far_full == 1.0)
    for k, sample in enumerate(samples):  # 2 a step, in the order of the rows
        x, scored = rows[k // 2][0][k % 2], rows[k // 2][1][k % 2]
        assert x[: len(sample.ids)].tolist() == list(sample.ids)
        assert scored[len(sample.ids) - 1] > 0 and not scored[: len(sample.ids) - 1].any()
    with pytest.raises(ConfigError, match="retrieval_min_length must lie"):
        options(model_dir, tmp_path, context=400, retrieval_min_length=401)
    with pytest.raises(ConfigError, match="retrieval_far_full is a share"):
        options(model_dir, tmp_path, retrieval_far_full=1.5)


@pytest.mark.parametrize("loss", ["distill", "lm"])
def test_the_loss_is_a_mean_over_rows_of_each_row_s_scored_positions(model_dir, tmp_path, loss):
    """Each row's term: the mean over its scored positions times their weight."""
    config = options(model_dir, tmp_path, loss=loss, span_loss=0.0)
    model, _ = load_frozen(str(model_dir))
    original = model.config._attn_implementation
    METHODS["spans"].attach(model, config)
    with torch.no_grad():
        for param in span_parameters(model):
            param.fill_(0.02)  # spans shorter than the context: student and teacher differ
    x = torch.randint(0, model.config.vocab_size, (3, config.context))
    scored = (torch.rand(x.shape) < 0.3).float()
    scored[:, 0] = 1.0  # every row scores a position that predicts a token
    weight = torch.tensor([1.0, 1.0, 5.0])  # the last row: a prompt's sum over 5 positions
    scored *= weight[:, None]
    with torch.no_grad():
        got = span_losses(model, original, x, scored, config)
        student = model(input_ids=x).logits.double().log_softmax(-1)
        with full_attention(model, original):
            teacher = model(input_ids=x).logits.double().log_softmax(-1)
    rows = []
    for b in range(3):  # the naive reference: one row, one position at a time
        terms = []
        for t in scored[b].nonzero().flatten().tolist():
            if loss == "distill":
                terms.append((teacher[b, t].exp() * (teacher[b, t] - student[b, t])).sum())
            elif t + 1 < config.context:
                terms.append(-student[b, t, x[b, t + 1]])
        rows.append(weight[b] * sum(terms) / len(terms))
    name = "kl" if loss == "distill" else "nll"
    assert got[name].item() == pytest.approx((sum(rows) / 3).item(), rel=1e-4)


def test_a_task_longer_than_the_context_is_refused_before_any_step(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="retrieval"):
        options(model_dir, tmp_path, retrieval=1.5)
    with pytest.raises(Exception, match="too short"):
        retrofit(options(model_dir, tmp_path / "out", retrieval=0.5), FP32, progress=False)


def test_a_share_of_retrieval_prompts_that_is_no_whole_number_is_refused(model_dir, tmp_path):
    """3/8 of 4 windows would be rounded to 2, the run then training on half prompts."""
    with pytest.raises(ConfigError, match=r"0.375 x 4 = 1.5"):
        options(model_dir, tmp_path, retrieval=0.375, batch_size=4)
    config = options(model_dir, tmp_path, retrieval=0.375, batch_size=8)
    assert config.retrieval_rows == 3


def test_spans_with_sinks_and_a_penalty_per_byte(model_dir, tmp_path):
    config = options(model_dir, tmp_path / "out", sinks=2, penalty="byte", span_loss=1e-3)
    run = retrofit(config, FP32, progress=False)
    assert span_penalty(run.model, config).item() == pytest.approx(
        cache_loss(run.model, 1e-3, 2).item())
    assert [s.sinks for s in span_modules(load_pretrained(tmp_path / "out"))] == [2, 2]
    assert any((p < 1).any() for p in span_parameters(run.model))


@pytest.mark.parametrize("method", ["spans", "duo"])
def test_micro_batches_take_the_step_of_the_whole_batch(model_dir, tmp_path, method):
    """Three rows of 4 per forward and backward, then the fourth alone: each part's terms
    weighted by its share of the rows, the steps are those of the 4 rows at once (to float
    rounding), with the retrieval prompt among the rows and the penalty counted once; a run
    resumed with another micro_batch continues."""
    changes = dict(method=method, batch_size=4, context=400, retrieval=0.25, steps=4,
                   penalty="byte", per_kv_head=True, span_loss=1e-3)
    whole = retrofit(options(model_dir, tmp_path / "whole", **changes), FP32, progress=False)
    config = options(model_dir, tmp_path / "parts", micro_batch=3, **{**changes, "steps": 2})
    retrofit(config, FP32, progress=False)
    parts = retrofit(options(model_dir, tmp_path / "parts", micro_batch=1, **changes), FP32,
                     resume=True, progress=False)
    start = load_frozen(model_dir)[0]
    METHODS[method].attach(start, config)
    trained = (METHODS[method].parameters(m) for m in (start, whole.model, parts.model))
    for a, b, c in zip(*trained, strict=True):
        assert not torch.equal(a, b)  # the steps moved them
        torch.testing.assert_close(b, c, rtol=0, atol=1e-6)
    for a, b in zip(whole.history, parts.history, strict=True):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)


def test_a_micro_batch_below_one_is_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="micro_batch must be a positive integer, got 0"):
        options(model_dir, tmp_path, micro_batch=0)


def test_a_resumed_run_given_more_steps_is_one_run_of_as_many(model_dir, tmp_path):
    whole = retrofit(options(model_dir, tmp_path / "whole"), FP32, progress=False)
    retrofit(options(model_dir, tmp_path / "parts", steps=3), FP32, progress=False)
    resumed = retrofit(options(model_dir, tmp_path / "parts"), FP32, resume=True,
                       progress=False)
    for a, b in zip(span_parameters(whole.model), span_parameters(resumed.model), strict=True):
        assert torch.equal(a, b)


def test_duo_trains_a_gate_per_key_value_head(model_dir, tmp_path, capsys):
    out = tmp_path / "duo"
    assert main(["retrofit", str(model_dir), "--data", "kjv", "--out", str(out), "--method",
                 "duo", "--steps", "3", "--context", "64", "--batch-size", "2", "--lr", "0.2",
                 "--span-loss", "1", "--streaming-window", "8", "--sinks", "2",
                 "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out)
    gates = read_gates(out)
    assert printed["alpha"] == [pytest.approx(row, rel=1e-5) for row in gates["alpha"]]
    assert (gates["window"], gates["sinks"]) == (8, 2)
    assert len(gates["alpha"]) == 2 and all(len(row) == 2 for row in gates["alpha"])
    assert all(0 <= a < 1 for row in gates["alpha"] for a in row)  # the penalty moved them


def test_an_unknown_method_is_one_line(model_dir, tmp_path, capsys):
    assert main(["retrofit", str(model_dir), "--data", "kjv", "--out", str(tmp_path / "x"),
                 "--method", "magic"]) == 2
    err = capsys.readouterr().err
    assert "method must be one of spans, duo" in err and err.count("\n") == 1


def test_a_signal_stops_after_its_step_and_resumes_exactly(model_dir, tmp_path, monkeypatch):
    """SIGINT in the middle of step 3: the step ends, is saved, and the resumed run equals an
    uninterrupted one."""
    whole = retrofit(options(model_dir, tmp_path / "whole"), FP32, progress=False)
    step = Retrofit.train_step

    def signalled(self, precision):
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return step(self, precision)

    monkeypatch.setattr(Retrofit, "train_step", signalled)
    with pytest.raises(KeyboardInterrupt, match="stopped after step 3"):
        retrofit(options(model_dir, tmp_path / "parts"), FP32, progress=False)
    monkeypatch.setattr(Retrofit, "train_step", step)
    resumed = retrofit(options(model_dir, tmp_path / "parts"), FP32, resume=True,
                       progress=False)
    for a, b in zip(span_parameters(whole.model), span_parameters(resumed.model), strict=True):
        assert torch.equal(a, b)


def test_retrieval_budget_script(model_dir, tmp_path, capsys):
    """The comparison at one budget runs end to end at a tiny size: every policy scored, the
    baselines held within the spans' budget; the spans stepped by SGD at their own rate, the
    gates by Adam, both with the ramp and the retrieval prompts asked for."""
    script = load_script("retrieval_budget")
    result = script.main([str(model_dir), "--data", "kjv", "--haystack", "kjv", "--out",
                          str(tmp_path / "cmp"), "--context", "400", "--lengths", "400",
                          "--depths", "0.5", "--tasks", "passkey,single_needle", "--samples",
                          "1", "--steps", "2", "--sinks", "2", "--streaming-window", "16",
                          "--eval-bytes", "500", "--decode-tokens", "2", "--span-loss", "1e-3",
                          "--span-optimizer", "sgd", "--span-lr", "0.5", "--ramp", "64",
                          "--retrieval-loss", "all", "--retrieval-far", "0.5",
                          "--retrieval-min-length", "300", "--retrieval-weight", "1.5",
                          "--lr-schedule", "linear", "--lr-decay-steps", "1"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
    assert set(result["policies"]) == {"full", "spans", "streaming", "duo", "snapkv"}
    budget = result["budget_bytes"]
    for name in ("streaming", "duo", "snapkv"):
        assert result["policies"][name]["kv_bytes"]["400"] <= budget, name
    assert result["policies"]["spans"]["kv_bytes"]["400"] == budget
    assert set(result["policies"]["spans"]["accuracy"]) == {"passkey", "single_needle"}
    assert "against_full" not in result["policies"]["full"]
    for name in ("spans", "streaming", "duo", "snapkv"):  # the same 2 prompts as full's
        policy = result["policies"][name]
        for task, cell in ((t, c["400"]) for t, c in policy["against_full"].items()):
            assert cell["prompts"] == 1
            assert cell["difference"] == policy["accuracy"][task]["400"] - \
                result["policies"]["full"]["accuracy"][task]["400"]
    assert result["retrofit"]["history"][-1]["spans"] == result["retrofit"]["spans"]
    held, report = result["heldout"], result["retrofit"]["heldout"]
    assert set(held) == {"full", "spans", "streaming", "duo"}  # SnapKV: no prompt in a text
    for name in ("full", "spans"):  # as the retrofit's report scored them
        assert held[name]["bits_per_byte"] == pytest.approx(report[name]["bits_per_byte"],
                                                            rel=1e-6)
    assert held["spans"]["change"] == pytest.approx(report["bits_per_byte_change"], abs=1e-7)
    for name in ("streaming", "duo"):  # windows of the budget, not every position
        assert held[name]["change"] == pytest.approx(
            held[name]["bits_per_byte"] / held["full"]["bits_per_byte"] - 1)
        assert held[name]["bits_per_byte"] != held["full"]["bits_per_byte"]
    settings = {method: json.loads((tmp_path / "cmp" / method / "retrofit_settings.json")
                                   .read_text()) for method in ("spans", "duo")}
    assert (settings["spans"]["optimizer"], settings["spans"]["lr"]) == ("sgd", 0.5)
    assert (settings["duo"]["optimizer"], settings["duo"]["lr"]) == ("adam", 0.02)
    for method in ("spans", "duo"):  # the same data and loss for both
        assert (settings[method]["ramp"], settings[method]["retrieval_loss"],
                settings[method]["retrieval_far"],
                settings[method]["retrieval_min_length"],
                settings[method]["retrieval_weight"],
                settings[method]["lr_schedule"], settings[method]["lr_decay_steps"]) == (
                    64, "all", 0.5, 300, 1.5, "linear", 1)


def test_retrieval_budget_scores_the_policies_asked_for(model_dir, tmp_path, capsys):
    """``--policies snapkv``: full attention, the spans and SnapKV, no gates trained; an unknown
    policy is a usage error."""
    script = load_script("retrieval_budget")
    result = script.main([str(model_dir), "--data", "kjv", "--haystack", "kjv", "--out",
                          str(tmp_path / "cmp"), "--context", "400", "--lengths", "400",
                          "--depths", "0.5", "--tasks", "passkey", "--samples", "1",
                          "--steps", "2", "--eval-bytes", "500", "--decode-tokens", "2",
                          "--policies", "snapkv"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
    assert list(result["policies"]) == ["full", "spans", "snapkv"]
    assert not (tmp_path / "cmp" / "duo").exists()
    with pytest.raises(SystemExit):
        script.parse_args([str(model_dir), "--data", "kjv", "--haystack", "kjv", "--out", "x",
                           "--policies", "spans,h2o"])


@pytest.mark.parametrize(("option", "message"), [
    ("--lr-decay-steps", "--lr-decay-steps: must be a positive integer, got '0'"),
    ("--retrieval-min-length", "--retrieval-min-length: must be a positive integer, got '0'")])
def test_retrieval_budget_passes_a_zero_on_to_be_refused(model_dir, tmp_path, capsys, option,
                                                         message):
    """A 0 is an option given, not one left out: ``adaspan retrofit`` refuses it (its last
    line says why) and the script stops before training anything."""
    script = load_script("retrieval_budget")
    with pytest.raises(SystemExit):
        script.main([str(model_dir), "--data", "kjv", "--haystack", "kjv", "--out",
                     str(tmp_path / "cmp"), "--context", "400", "--steps", "2",
                     "--lr-schedule", "cosine", option, "0"])
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "cmp" / "spans" / "retrofit.json").exists()


def test_retrieval_budget_gives_the_cache_ratio_to_the_spans_alone(tmp_path, monkeypatch):
    """The spans' retrofit follows --cache-ratio, --average-steps, --reallocate and its guard;
    DuoAttention's gates have no spans to bound (adaspan retrofit would refuse the ratio for
    them) and take the last step's gates, as in DuoAttention. Both draw their windows from
    one --seed."""
    script = load_script("retrieval_budget")
    calls = []
    monkeypatch.setattr(script, "run", lambda *argv: calls.append(argv) or {})
    args = script.parse_args(["model", "--data", "kjv", "--haystack", "kjv", "--out",
                              str(tmp_path), "--cache-ratio", "4.05", "--average-steps", "20",
                              "--seed", "7", "--micro-batch", "1", "--reallocate", "5",
                              "--reallocate-guard", "3"])
    script.retrofit(args, "spans", 1e-7)
    script.retrofit(args, "duo", 0.05)
    spans, duo = calls
    assert spans[spans.index("--cache-ratio") + 1] == "4.05" and "--cache-ratio" not in duo
    assert spans[spans.index("--average-steps") + 1] == "20" and "--average-steps" not in duo
    assert spans[spans.index("--reallocate") + 1] == "5" and "--reallocate" not in duo
    assert spans[spans.index("--reallocate-guard") + 1] == "3"
    assert "--reallocate-guard" not in duo
    for option, value in (("--seed", "7"), ("--micro-batch", "1")):
        assert [call[call.index(option) + 1] for call in calls] == [value, value]


def test_span_objective_script_scores_the_retrofit_s_own_loss(model_dir, tmp_path, capsys):
    """The objective of learned and edited spans on the retrofit's batches after its steps:
    the split into windows and prompts averages to the loss of the whole batch; the penalty
    of a layer made whole grows by ln 2 lambda bytes per position (S - z) per key/value head;
    every layer whole gives the frozen model's own distribution (KL 0); the spans are put
    back; bad input is one line."""
    config = options(model_dir, tmp_path / "spans", context=400, batch_size=4, steps=2,
                     retrieval=0.5, per_kv_head=True, sinks=2, penalty="byte", span_loss=1e-4,
                     lr=0.4)
    run = retrofit(config, FP32, progress=False)
    script = load_script("span_objective")
    result = script.main([str(tmp_path / "spans"), "--steps", "2", "--edits",
                          "spans:full_layers=0;spans:full_layers=0+1"])
    assert json.loads(capsys.readouterr().out) == result
    assert result["steps"] == [2, 3] and result["prompts"] == 2
    learned, layer0, whole = result["policies"].values()
    with torch.no_grad():  # the retrofit's loss of its whole batches, step by step
        reference = [span_losses(run.model, run.original, *run.data.batch(step), config)
                     for step in (2, 3)]
    assert learned["kl"] == pytest.approx(sum(r["kl"].item() for r in reference) / 2, rel=1e-5)
    assert learned["penalty"] == pytest.approx(reference[0]["penalty"].item(), rel=1e-6)
    z = span_modules(run.model)[0].z().detach()
    grown = math.log(2) * 1e-4 * position_bytes(run.model.config, 2) * (400 - z).sum().item()
    assert layer0["change"]["penalty"] == pytest.approx(grown, rel=1e-5)
    assert whole["kl"] == pytest.approx(0.0, abs=1e-6) and learned["kl"] > 1e-5, z
    assert layer0["change"]["kl"] < 0 < layer0["change"]["penalty"]
    assert layer0["total"] == pytest.approx(layer0["kl"] + layer0["penalty"])
    saved = load_pretrained(tmp_path / "spans")
    for a, b in zip(span_parameters(saved), span_parameters(run.model), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(SystemExit, match="spans cache policies"):
        script.main([str(tmp_path / "spans"), "--steps", "1", "--edits", "full"])
    with pytest.raises(SystemExit, match=r"^error: no retrofit settings"):
        script.main([str(tmp_path), "--steps", "1"])
