"""adaspan longeval: a tiny random Llama (byte tokenizer) scored end to end, through the
command line, with the full cache and the span cache; adaspan report of its outputs, one and
side by side."""

from __future__ import annotations

import base64
import html
import itertools
import json
import math
import re
import statistics
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from helpers import load_script
from transformers import ByT5Tokenizer, DynamicCache, LlamaConfig, LlamaForCausalLM

from adaspan.attention.span import AdaptiveSpan, exact_fraction
from adaspan.cli import main
from adaspan.errors import UserError
from adaspan.hf import add_spans, head_windows, load_pretrained, save_model
from adaspan.hf import cache_policies as cp
from adaspan.hf import longeval as le
from adaspan.hf.needles import TASKS, Haystack, make
from adaspan.runtime.precision import choose

LAYERS, KV_HEADS, D_HEAD, POSITIONS = 2, 2, 8, 1024
FP32 = choose("float32", torch.device("cpu"), "score")
GRID = ["--lengths", "600,900", "--depths", "0,0.5,1", "--samples", "1", "--no-progress"]


def tiny_llama(folder: Path, spans: bool) -> Path:
    """A random Llama (2 layers, 4 query heads of 8, 2 key/value heads, 1,024 positions)
    with a byte tokenizer; with ``spans``, z of about 31 tokens (S = 1,024, R = 8)."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=POSITIONS)
    model = LlamaForCausalLM(config)
    tokenizer = ByT5Tokenizer(extra_ids=0)
    if spans:
        add_spans(model, ramp=8, init=0.03)
        save_model(model, folder, tokenizer)  # the tokenizer beside them: longeval reads it
    else:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("plain"), spans=False)


@pytest.fixture(scope="module")
def spans_dir(tmp_path_factory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("spans"), spans=True)


def run_printed(capsys, model_dir: Path, *options: str) -> tuple[dict, str]:
    """``adaspan longeval --json``'s results, and what it printed on stderr."""
    assert main(["longeval", str(model_dir), "--haystack", "kjv", *GRID, "--json",
                 *options]) == 0
    printed = capsys.readouterr()
    return json.loads(printed.out), printed.err


def run(capsys, model_dir: Path, *options: str) -> dict:
    return run_printed(capsys, model_dir, *options)[0]


def test_full_and_span_caches_end_to_end(spans_dir, tmp_path, capsys):
    spans = run(capsys, spans_dir, "--cache", "spans", "--out", str(tmp_path / "spans"))
    full, err = run_printed(capsys, spans_dir, "--out", str(tmp_path / "full"), "--no-plots")
    # --cache full on a model with spans: one line says the spans still weigh the keys
    assert err == (f"adaspan: note: {spans_dir} has spans: --cache full holds every key "
                   "and value, but the spans still weigh them; for full attention, "
                   "score the model they were retrofitted from\n")
    assert full["cache"] == "full" and spans["cache"] == "spans"
    assert spans["tasks"] == list(TASKS) and spans["lengths"] == [600, 900]
    assert spans["depths"] == [0.0, 0.5, 1.0] and spans["samples"] == 1
    for task in TASKS:
        for length in ("600", "900"):
            cell = spans["results"][task][length]
            assert set(cell) == {"accuracy", "mean", "kv_bytes", "prompt_tokens"}
            assert set(cell["accuracy"]) == {"0", "0.5", "1"}
            assert cell["mean"] == pytest.approx(sum(cell["accuracy"].values()) / 3)
    assert len(spans["prompts"]) == len(full["prompts"]) == len(TASKS) * 2 * 3
    # the same answers (the span cache drops only keys of weight 0), fewer bytes held
    windows = [max(layer) for layer in head_windows(load_pretrained(spans_dir))]
    held = sum(2 * KV_HEADS * (w - 1) * D_HEAD * 4 for w in windows)
    for a, b in zip(spans["prompts"], full["prompts"], strict=True):
        assert a["output"] == b["output"] and a["correct"] == b["correct"]
        assert a["kv_bytes"] == held < b["kv_bytes"]
        assert b["kv_bytes"] == LAYERS * 2 * KV_HEADS * a["tokens"] * D_HEAD * 4
        assert a["tokens"] <= a["length"] - 13  # room for the answer (13 tokens at least)
    assert all(v["kv_bytes"] == held for v in spans["mean"].values())
    assert full["mean"]["900"]["kv_bytes"] > full["mean"]["600"]["kv_bytes"] > held
    written = tmp_path / "spans"
    assert json.loads((written / "longeval.json").read_text())["mean"] == spans["mean"]
    assert "| passkey | 600 |" in (written / "longeval.md").read_text()
    assert {p.name for p in written.glob("*.png")} == {f"longeval_{t}.png" for t in TASKS}
    assert (written / "longeval_passkey.png").read_bytes()[:4] == b"\x89PNG"
    assert not list((tmp_path / "full").glob("*.png"))


def test_the_table_without_json(plain_dir, capsys):
    assert main(["longeval", str(plain_dir), "--haystack", "kjv", "--tasks", "passkey",
                 "--lengths", "500", "--depths", "0.5", "--samples", "2", "--no-progress"]) == 0
    printed = capsys.readouterr()
    table = printed.out
    assert table.startswith(f"# Long-context retrieval of {plain_dir} (cache: full)")
    assert printed.err == ""  # no spans: no note
    assert "| passkey | 500 | " in table and "Prompts per cell: 2 (seed 0)" in table


@pytest.mark.parametrize("change, message", [
    (["--tasks", "passkey,nope"], "unknown task 'nope'; the tasks are passkey"),
    (["--lengths", "2048"], "a length of 2048 tokens is longer than the model's 1024 positions"),
    (["--cache", "spans"], "cache policy 'spans' needs a model with spans"),
    (["--cache", "nope"], "unknown cache policy 'nope'; the policies are full, spans"),
    (["--cache", "full:window=4"], "cache policy 'full': got an unexpected keyword argument"),
    (["--cache", "full:4"], "cache policy options are key=value separated by commas, got '4'"),
    (["--lengths", "100"], "a length of 100 is too short"),
])
def test_bad_input_is_one_line(plain_dir, capsys, change, message):
    assert main(["longeval", str(plain_dir), "--haystack", "kjv", *GRID, *change]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_a_missing_model_and_bad_depths_are_refused(tmp_path, capsys):
    assert main(["longeval", str(tmp_path / "none"), "--haystack", "kjv"]) == 2
    assert "no model directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["longeval", str(tmp_path), "--haystack", "kjv", "--depths", "0,2"])
    assert "not a list of numbers in [0, 1]" in capsys.readouterr().err


class Recording(cp.CachePolicy):
    """A policy as another module would add one: its cache, and the model changed (here its
    attention implementation swapped, an option) only while it answers."""

    def __init__(self, model, calls: list[tuple[int, str]], attention: str = "sdpa") -> None:
        super().__init__(model)
        self.calls, self.attention = calls, attention

    def cache(self, prompt_tokens: int) -> DynamicCache:
        return DynamicCache()

    @contextmanager
    def applied(self, prompt_tokens: int):
        before = self.model.config._attn_implementation
        self.model.set_attn_implementation(self.attention)
        try:
            self.calls.append((prompt_tokens, self.model.config._attn_implementation))
            yield self.cache(prompt_tokens)
        finally:
            self.model.set_attn_implementation(before)


def test_a_registered_policy_is_one_call(plain_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(cp, "POLICIES", dict(cp.POLICIES))  # the registry as it was, after
    cp.register_policy("recording", lambda model, attention="sdpa": Recording(model, calls,
                                                                             attention))
    grid = le.Grid(("passkey",), (500,), (0.0, 1.0), samples=2)
    results = le.longeval(plain_dir, "kjv", grid, "recording:attention=eager", FP32,
                          progress=False)
    assert results["cache"] == "recording:attention=eager"
    assert [tokens for tokens, _ in calls] == [r["tokens"] for r in results["prompts"]]
    assert {implementation for _, implementation in calls} == {"eager"}


def test_spans_with_whole_layers(spans_dir, plain_dir):
    grid = le.Grid(("passkey", "single_needle"), (600,), (0.0, 1.0), samples=1)
    full = le.longeval(plain_dir, "kjv", grid, "full", FP32, progress=False)  # same weights
    whole = le.longeval(spans_dir, "kjv", grid, "spans:full_layers=1+0", FP32, progress=False)
    one = le.longeval(spans_dir, "kjv", grid, "spans:full_layers=1", FP32, progress=False)
    assert whole["cache"] == "spans:full_layers=1+0"
    window = max(head_windows(load_pretrained(spans_dir))[0])
    for a, b, c in zip(whole["prompts"], full["prompts"], one["prompts"], strict=True):
        assert a["output"] == b["output"] and a["kv_bytes"] == b["kv_bytes"]  # the model's own
        assert c["kv_bytes"] == 2 * KV_HEADS * (a["tokens"] + window - 1) * D_HEAD * 4


def test_whole_layers_are_put_back_and_bad_ones_refused(spans_dir):
    model = load_pretrained(spans_dir)
    learned = [z.tolist() for z in (span.z() for span in cp.span_modules(model))]
    policy = cp.build_policy("spans:full_layers=0", model)
    with policy.applied(100):
        assert cp.span_modules(model)[0].z().tolist() == [POSITIONS] * 4
        assert cp.span_modules(model)[1].z().tolist() == learned[1]
    assert [span.z().tolist() for span in cp.span_modules(model)] == learned
    for bad in ("2", "a", "0+-1"):
        with pytest.raises(UserError, match="full_layers"):
            cp.build_policy(f"spans:full_layers={bad}", model)


def test_spans_with_head_windows(spans_dir):
    """``windows`` at S on every head of layer 0 holds and answers as ``full_layers=0`` (the
    prompts are shorter than S - R); one head's window sets what its key/value head holds."""
    grid = le.Grid(("passkey",), (600,), (0.0, 1.0), samples=1)
    whole = le.longeval(spans_dir, "kjv", grid, "spans:full_layers=0", FP32, progress=False)
    heads = "+".join(f"0.{h}@{POSITIONS}" for h in range(4))
    at_s = le.longeval(spans_dir, "kjv", grid, f"spans:windows={heads}", FP32, progress=False)
    one = le.longeval(spans_dir, "kjv", grid, "spans:windows=0.1@200", FP32, progress=False)
    learned = head_windows(load_pretrained(spans_dir))
    kept = [200 - 1, max(learned[0][2:]) - 1, max(learned[1][:2]) - 1, max(learned[1][2:]) - 1]
    for a, b, c in zip(at_s["prompts"], whole["prompts"], one["prompts"], strict=True):
        assert a["output"] == b["output"] and a["kv_bytes"] == b["kv_bytes"]
        assert c["kv_bytes"] == 2 * sum(kept) * D_HEAD * 4


def test_a_head_window_is_exact_in_the_spans_precision():
    """Every window in [R, S], at an S (777) where (W - R) / S in float32 often rounds up."""
    span = AdaptiveSpan(4, 777, 13)
    for window in range(13, 778):
        with torch.no_grad():
            span.z_frac[1] = exact_fraction(window - span.ramp, span.max_span)
        assert span.windows(None)[1] == window


def test_head_windows_are_exact_put_back_and_bad_ones_refused(spans_dir):
    model = load_pretrained(spans_dir)
    learned = head_windows(model)
    policy = cp.build_policy("spans:windows=1.2@300+0.0@8", model)
    with policy.applied(100):
        assert head_windows(model) == [[8, *learned[0][1:]],
                                       [*learned[1][:2], 300, learned[1][3]]]
    assert head_windows(model) == learned
    for bad in ("0.0", "0@9", "2.0@9", "0.4@9", "0.0@7", f"0.0@{POSITIONS + 1}", "a.0@9"):
        with pytest.raises(UserError, match="windows"):
            cp.build_policy(f"spans:windows={bad}", model)


def test_scores_of_right_wrong_and_partial_answers(plain_dir, monkeypatch):
    """Every answer given in full scores 1; multi_value's first value alone scores 0."""
    model, tokenizer = le.load_model_dir(plain_dir, torch.device("cpu"))
    haystack = Haystack("A sentence. Another one.", tokenizer)

    def oracle(model, sample, policy, pad):
        given = sample.answers[:1] if sample.task == "multi_value" else sample.answers
        return tokenizer(" " + ", ".join(given), add_special_tokens=False)["input_ids"], 7

    monkeypatch.setattr(le, "respond", oracle)
    grid = le.Grid(lengths=(600,), depths=(0.0, 1.0), samples=2)
    records = le.evaluate(model, tokenizer, haystack, grid, cp.build_policy("full", model),
                          FP32, progress=False)
    summary = le.summarise(records, grid)
    assert {task: cells["600"]["mean"] for task, cells in summary["results"].items()} == {
        task: float(task != "multi_value") for task in TASKS}
    right = len(TASKS) - 1
    assert summary["mean"]["600"] == {"accuracy": pytest.approx(right / len(TASKS)),
                                      "kv_bytes": 7}
    assert math.isclose(sum(r["correct"] for r in records), right * 2 * 2)


def test_sign_test_against_every_split_enumerated():
    """p is the share of the 2^n equally likely splits of n discordant prompts at least as
    uneven as the one seen (counted one by one), and 1 when none differ."""
    for lost, gained in [(0, 0), (3, 0), (0, 10), (2, 5), (4, 4), (1, 6), (7, 2)]:
        n, seen = lost + gained, abs(lost - gained)
        uneven = sum(abs(2 * sum(bits) - n) >= seen
                     for bits in itertools.product((0, 1), repeat=n))
        assert math.isclose(le.sign_test(lost, gained), uneven / 2 ** n)
    assert le.sign_test(3, 0) == 0.25


def test_paired_counts_prompts_lost_and_gained_on_the_same_prompts():
    """Matched by task, length, depth, sample and answer: a prompt right in the reference and
    wrong in the other is lost, the reverse gained; different prompts are refused."""
    def record(task, length, depth, sample, correct):
        return {"task": task, "length": length, "depth": depth, "sample": sample,
                "answers": [f"{task}{sample}{depth}"], "correct": correct}

    cells = list(itertools.product(("passkey", "single_needle"), (512, 1024), (0.0, 1.0),
                                   range(5)))
    full = [record(*c, correct=c[3] != 4) for c in cells]
    lose = {("passkey", 1024, 0.0, 0), ("passkey", 1024, 1.0, 1), ("passkey", 1024, 1.0, 2)}
    other = [record(*c, correct=(c[:4] not in lose and c[3] != 4) or c[:4] ==
                    ("single_needle", 512, 0.0, 4)) for c in reversed(cells)]
    result = le.paired(full, other)
    assert result["passkey"]["1024"] == {"prompts": 10, "lost": 3, "gained": 0,
                                         "difference": -0.3, "p": 0.25}
    assert result["single_needle"]["512"] == {"prompts": 10, "lost": 0, "gained": 1,
                                              "difference": 0.1, "p": 1.0}
    assert result["passkey"]["512"]["lost"] == result["passkey"]["512"]["gained"] == 0
    with pytest.raises(UserError, match="same prompts"):
        le.paired(full, other[1:])
    moved = [dict(r, answers=["other"]) if r is other[0] else r for r in other]
    with pytest.raises(UserError, match="same prompts"):
        le.paired(full, moved)


# --------------------------------------------------------------------------- adaspan report

REPORT_GRID = ["--tasks", "passkey,multi_value", "--lengths", "600,900", "--depths", "0,0.5,1",
               "--samples", "2", "--no-progress", "--json"]
REPORT_TASKS = ["passkey", "multi_value"]


@pytest.fixture(scope="module")
def outputs(spans_dir, tmp_path_factory) -> dict[str, Path]:
    """longeval --out of the model with spans, with the full cache and the span cache. The
    model answers (and its cache holds its bytes), but the answer is then replaced by the right
    one for some prompts, so that the accuracies differ by task, length, depth and policy."""
    root, respond = tmp_path_factory.mktemp("longeval"), le.respond
    tokenizer = ByT5Tokenizer(extra_ids=0)

    def partly_right(model, sample, policy, pad):
        new, held = respond(model, sample, policy, pad)
        right = ((sample.seed == 0 and (policy.name == "full" or sample.length == 600))
                 or (sample.task == "passkey" and sample.depth == 0))
        answer = " " + ", ".join(sample.answers)
        return (tokenizer(answer, add_special_tokens=False)["input_ids"] if right else new), held

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(le, "respond", partly_right)
        for cache in ("full", "spans"):
            assert main(["longeval", str(spans_dir), "--haystack", "kjv", *REPORT_GRID,
                         "--cache", cache, "--out", str(root / cache)]) == 0
    return {cache: root / cache for cache in ("full", "spans")}


def _report(capsys, *argv: str) -> tuple[str, Path]:
    """The page ``adaspan report ARGV`` writes, and its path (from what the command prints)."""
    assert main(["report", *argv]) == 0
    path = Path(capsys.readouterr().out.strip().removeprefix("wrote "))
    return path.read_text(), path


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"src='data:image/png;base64,([^']+)'", page)]


def _cells(page: str) -> list[list[str]]:
    """The cells (th or td) of every row of the page's tables."""
    return [[html.unescape(c) for c in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", page)]


def _rows(page: str) -> dict[str, list[str]]:
    """The rows of the page's tables by their first cell: the other cells (the first row of a
    key)."""
    rows = {}
    for cells in _cells(page):
        rows.setdefault(cells[0], cells[1:])
    return rows


def test_report_of_one_output(outputs, capsys):
    page, path = _report(capsys, str(outputs["spans"]))
    results = json.loads((outputs["spans"] / "longeval.json").read_text())
    assert path == outputs["spans"] / "report.html"
    # the heatmaps longeval drew, embedded: the same figures
    assert _images(page) == [(outputs["spans"] / f"longeval_{t}.png").read_bytes()
                             for t in REPORT_TASKS]
    facts = _rows(page)
    assert facts[""] == ["spans"] and facts["cache policy"] == ["spans"]
    assert facts["model"] == [str(results["model"])] and facts["haystack"] == ["kjv"]
    assert facts["tasks"] == ["passkey, multi_value"] and facts["depths"] == ["0, 0.5, 1"]
    assert facts["context lengths (tokens)"] == ["600, 900"]
    assert facts["prompts per cell"] == ["2 (seed 0)"]
    assert facts["kv bytes after the prompt, by length"] == ["; ".join(
        f"{n}: {results['mean'][n]['kv_bytes']:,}" for n in ("600", "900"))]
    rows = {(cells[0], cells[1]): cells[2:] for cells in _cells(page)
            if cells[0] in REPORT_TASKS and len(cells) == 7}  # by task, length and depth
    for task in REPORT_TASKS:
        for length in ("600", "900"):
            cell = results["results"][task][length]
            assert rows[task, length] == [f"{cell['accuracy'][d]:.2f}" for d in ("0", "0.5", "1")
                                          ] + [f"{cell['mean']:.2f}", f"{cell['kv_bytes']:,}"]
    assert len({cells[0] for cells in rows.values()}) > 1  # not all alike: real values


def test_report_of_two_outputs_side_by_side(outputs, tmp_path, capsys):
    page, path = _report(capsys, str(outputs["full"]), str(outputs["spans"]),
                         "--out", str(tmp_path / "both"))
    assert path == tmp_path / "both" / "report.html"
    results = {c: json.loads((outputs[c] / "longeval.json").read_text()) for c in outputs}
    assert re.findall(r"<h3>(.*?)</h3>", page) == ["full", "spans"]  # a heatmap row each
    assert _images(page) == [(outputs[c] / f"longeval_{t}.png").read_bytes()
                             for c in ("full", "spans") for t in REPORT_TASKS]
    table = _rows(page.partition("<section id='accuracy'>")[2])
    assert table["task"] == ["full", "spans"]
    for task in REPORT_TASKS:  # the mean over lengths and depths
        assert table[task] == [
            f"{statistics.fmean(cell['mean'] for cell in r['results'][task].values()):.2f}"
            for r in results.values()]
    assert table["mean over tasks"] == [
        f"{statistics.fmean(v['accuracy'] for v in r['mean'].values()):.2f}"
        for r in results.values()]
    assert table["mean over tasks"][0] != table["mean over tasks"][1]
    for n in ("600", "900"):
        held = [r["mean"][n]["kv_bytes"] for r in results.values()]
        assert table[f"kv bytes after the prompt, length {int(n):,}"] == [f"{b:,}" for b in held]
        assert held[1] < held[0]  # the span cache holds less


REFUSED = {
    "empty": "is neither a training run (no config.json) nor an adaspan longeval output "
             "(no longeval.json)",
    "missing": "no directory",
    "output and empty": "is not an adaspan longeval output (no longeval.json): several",
    "two outputs": "the report of several longeval outputs needs an output directory "
                   "(--out DIR)",
    "broken": "cannot read",
    "not longeval's": "is not an adaspan longeval output: it has no 'haystack'",
}


@pytest.mark.parametrize("what", REFUSED)
def test_report_refuses_what_is_neither_a_run_nor_an_output(outputs, tmp_path, capsys, what):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "longeval.json").write_text("{")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "longeval.json").write_text('{"model": "m"}')
    argv = {"empty": [tmp_path], "missing": [tmp_path / "none"],
            "output and empty": [outputs["full"], tmp_path, "--out", tmp_path / "out"],
            "two outputs": [outputs["full"], outputs["spans"]],
            "broken": [tmp_path / "broken"], "not longeval's": [tmp_path / "other"]}[what]
    assert main(["report", *map(str, argv)]) == 2
    err = capsys.readouterr().err
    assert REFUSED[what] in err and err.count("\n") == 1, err
    assert not (tmp_path / "report.html").exists()


def test_answer_margins_script_against_reading_the_answer_token_by_token(plain_dir, spans_dir,
                                                                         capsys):
    """The answer margins of one teacher-forced pass equal those of growing the prompt by one
    answer token at a time, for the plain model and for its spans; a prompt whose margin is
    below 0 is one whose greedy answer leaves the expected tokens; bad input is one line."""
    script = load_script("answer_margins")
    result = script.main([str(plain_dir), str(spans_dir), "--haystack", "kjv", "--tasks",
                          "passkey,single_needle", "--lengths", "500", "--depths", "0,1",
                          "--samples", "1"])
    assert json.loads(capsys.readouterr().out) == result
    assert [(p["task"], p["depth"]) for p in result["prompts"]] == [
        ("passkey", 0.0), ("passkey", 1.0), ("single_needle", 0.0), ("single_needle", 1.0)]
    for path in (plain_dir, spans_dir):
        model, tokenizer = le.load_model_dir(path, torch.device("cpu"))
        haystack = Haystack(le.load_haystack("kjv"), tokenizer)
        policy = cp.build_policy("spans" if path == spans_dir else "full", model)
        for prompt in result["prompts"]:
            sample = make(prompt["task"], haystack, 500, prompt["depth"], 0)
            answer = script.answer_ids(haystack, sample)
            least = math.inf
            with torch.no_grad():
                for j, token in enumerate(answer):
                    logits = model(torch.tensor([[*sample.ids, *answer[:j]]])).logits[0, -1]
                    other = torch.cat([logits[:token], logits[token + 1 :]]).max()
                    least = min(least, (logits[token] - other).item())
            assert prompt["margins"][str(path)] == pytest.approx(least, abs=1e-4)
            new, _ = le.respond(model, sample, policy, tokenizer.pad_token_id)
            assert (new[: len(answer)] == answer) == (least > 0)
        margins = [p["margins"][str(path)] for p in result["prompts"]]
        assert result["summary"][str(path)] == {
            "prompts": 4, "below_zero": sum(m < 0 for m in margins), "least": min(margins),
            "median": statistics.median(margins)}
    with pytest.raises(SystemExit, match=r"^error: .*positions|^error: no model directory"):
        script.main([str(plain_dir / "none"), "--haystack", "kjv"])


def test_answer_margins_summaries_against_the_equations(plain_dir, spans_dir, capsys):
    """A summary of the keys a span drops: ``all`` (the dropped keys' own softmax part) gives
    full attention's margins back; ``mean`` is, for one query of one head, the softmax over
    the span's weighed keys and one key more, the dropped keys' (1 - w)-weighed mean key with
    log n added to its score, holding their mean value."""
    script = load_script("answer_margins")
    result = script.main([str(plain_dir), str(spans_dir), "--haystack", "kjv", "--tasks",
                          "passkey", "--lengths", "300", "--depths", "0,1", "--samples", "1",
                          "--summaries", "mean,all"])
    capsys.readouterr()
    plain, spans = str(plain_dir), str(spans_dir)
    assert set(result["models"]) == {plain, spans, f"{spans}+mean", f"{spans}+all"}
    for prompt in result["prompts"]:
        margins = prompt["margins"]
        assert margins[f"{spans}+all"] == pytest.approx(margins[plain], abs=1e-4)
        assert margins[f"{spans}+mean"] != pytest.approx(margins[spans], abs=1e-4)
    model, _ = le.load_model_dir(spans_dir, torch.device("cpu"))
    module = model.model.layers[0].self_attn
    span = module.adaptive_span
    span.sinks = 2
    torch.manual_seed(1)
    T, d = 80, 8
    q = torch.randn(1, 4, T, d)
    k, v = torch.randn(1, KV_HEADS, T, d), torch.randn(1, KV_HEADS, T, d)
    out, _ = script.summary_attention("mean")(module, q, k, v, None, scaling=0.5)
    head, i, h_kv = 3, T - 1, 1  # query head 3 reads key/value head 1
    z = span.host_z()[head]
    weights, scores = [], []
    for j in range(i + 1):
        x = i - j
        w = 1.0 if j < 2 else max(0.0, min(1.0, (span.ramp + z - x) / span.ramp))
        weights.append(w)
        scores.append(0.5 * float(q[0, head, i] @ k[0, h_kv, j]))
    dropped = torch.tensor([1 - w for w in weights])
    n = float(dropped.sum())
    mean_k, mean_v = dropped @ k[0, h_kv, : i + 1] / n, dropped @ v[0, h_kv, : i + 1] / n
    kept = [j for j, w in enumerate(weights) if w > 0]
    logits = [scores[j] + math.log(weights[j]) for j in kept]
    logits.append(0.5 * float(q[0, head, i] @ mean_k) + math.log(n))
    p = torch.softmax(torch.tensor(logits), 0)
    expected = p[:-1] @ v[0, h_kv, kept] + p[-1] * mean_v
    assert out[0, i, head] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(SystemExit, match=r"^error: unknown summaries sum;"):
        script.main([plain, "--haystack", "kjv", "--summaries", "sum"])


@pytest.mark.parametrize("spec", ["full", "streaming:window=16,sinks=2", "spans"])
def test_policy_quality_is_the_loss_of_decoding_token_by_token(plain_dir, spans_dir, spec):
    """The held-out loss of a text read through a policy equals its loss when each token is
    decoded with the policy's cache: every token reads the keys that cache holds."""
    from adaspan.hf.report import policy_quality
    from adaspan.hf.span_cache import cache_argument

    model, _ = le.load_model_dir(spans_dir if spec == "spans" else plain_dir, torch.device("cpu"))
    plain, _ = le.load_model_dir(plain_dir, torch.device("cpu"))
    with torch.no_grad():  # attention sharper and weightier than random weights give
        for layer in (*model.model.layers, *plain.model.layers):
            layer.self_attn.q_proj.weight *= 30
            layer.self_attn.o_proj.weight *= 30
    ids = torch.randint(3, 259, (120,), generator=torch.Generator().manual_seed(0))
    got = policy_quality(model, cp.build_policy(spec, model), ids, 100, context=120)
    full = policy_quality(plain, cp.build_policy("full", plain), ids, 100, context=120)
    assert (abs(got["bits_per_byte"] / full["bits_per_byte"] - 1) > 5e-5) == (spec != "full")
    nll = 0.0
    with torch.no_grad(), cp.build_policy(spec, model).applied(1) as cache:
        for t in range(len(ids) - 1):
            logits = model(input_ids=ids[None, t : t + 1], use_cache=True,
                           **cache_argument(model, cache)).logits[0, -1]
            nll += torch.nn.functional.cross_entropy(logits, ids[t + 1]).item()
    assert got["bits_per_byte"] == pytest.approx(nll / math.log(2) / 100, rel=2e-6)
    assert got["perplexity"] == pytest.approx(math.exp(nll / 119), rel=1e-5)
