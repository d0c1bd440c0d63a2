"""`adaspan report`: the HTML page of a run, the numbers behind its figures (paper Figures 3-5),
the memory probe, and the compare figures."""

from __future__ import annotations

import base64
import itertools
import json
import re
import shutil
import sys
from dataclasses import replace

import pytest
import torch
from helpers import TRAIN_MODEL

from adaspan import ModelConfig, SpanLM, TrainConfig
from adaspan.attention.registry import ATTENTIONS, Variant
from adaspan.attention.span import DynamicSpan
from adaspan.attention.span_attention import SpanAttention
from adaspan.cli import main
from adaspan.data.corpora import load_corpus
from adaspan.measure.plots import compare_figure
from adaspan.measure.report import (
    DATA_FILE,
    FIXED,
    LEARNED,
    REPORT_FILE,
    TEXT_CHARS,
    default_text,
    dynamic_spans,
    flops_curves,
    report_data,
    write_report,
)
from adaspan.run.checkpoint import load_model
from adaspan.training.memory import profiled_peak
from adaspan.training.train import train

MODEL = replace(TRAIN_MODEL, dropout=0.1)
LIMITS = (16, 32, 64, 128)
FIGURES = ["fig-bpc", "fig-span-history", "fig-head-spans", "fig-spans", "fig-cost"]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Tiny fixed, adaptive and dynamic runs of 4 steps on the bundled corpus."""
    root = tmp_path_factory.mktemp("report")
    config = TrainConfig(data="kjv", batch_size=2, block_size=32, steps=4, optimizer="adamw",
                         lr=3e-3, warmup=1, eval_interval=2, eval_chars=128, log_interval=1,
                         checkpoint_interval=4, device="cpu", tensorboard=False)
    paths = {}
    for attention in ("fixed", "adaptive", "dynamic"):
        paths[attention] = root / attention
        train(ModelConfig(**{**MODEL.to_dict(), "attention": attention}), config,
              paths[attention], progress=False, log=lambda message: None)
    return paths


@pytest.fixture(scope="module")
def reports(runs) -> dict:
    """Each run's report (memory probe included) as (html, data)."""
    out = {}
    for attention, run_dir in runs.items():
        page = write_report(run_dir, limits=LIMITS)
        out[attention] = (page.read_text(), json.loads((page.parent / DATA_FILE).read_text()))
    return out


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"src='data:image/png;base64,([^']+)'", page)]


@pytest.mark.parametrize("attention", ["fixed", "adaptive", "dynamic"])
def test_report_embeds_every_figure(reports, attention):
    page, _ = reports[attention]
    expected = FIGURES + (["fig-dynamic"] if attention == "dynamic" else [])
    assert re.findall(r"<section id='(fig-[a-z-]+)'>", page) == sorted(
        expected, key=[*FIGURES, "fig-dynamic"].index)
    images = _images(page)
    assert len(images) == len(expected)
    assert all(image.startswith(PNG) and len(image) > 5000 for image in images)
    assert "http://" not in page and "https://" not in page  # nothing to fetch
    assert ("Figure 5" in page) == (attention == "dynamic")


@pytest.mark.parametrize("attention", ["fixed", "adaptive", "dynamic"])
def test_report_states_configuration_and_parameter_count(runs, reports, attention):
    page, data = reports[attention]
    params = load_model(runs[attention]).num_parameters()
    assert data["parameters"] == params and f"{params:,}" in page
    assert "<th>max_span</th><td>64</td>" in page and f"<td>{attention}</td>" in page
    assert data["learned_spans"] == (attention != "fixed")
    assert data["costs"]["memory_probe"] == {"device": "cpu", "streams": 2, "block_size": 32}
    assert "torch.profiler" in page and "2 streams of 32 characters" in page  # how it was measured


def test_cost_panel_fixed_grows_linearly_learned_stays_flat(reports):
    _, data = reports["adaptive"]
    costs = data["costs"]
    fixed, learned = costs["curves"][FIXED]["flops"], costs["curves"][LEARNED]["flops"]
    assert costs["limits"] == list(LIMITS)
    per_key = 2 * MODEL.d_model * MODEL.n_layers  # 2 d_head per key, every head of every layer
    for i in range(1, len(LIMITS)):
        assert fixed[i] - fixed[i - 1] == pytest.approx(per_key * (LIMITS[i] - LIMITS[i - 1]))
    longest = max(max(layer) for layer in data["spans"])
    assert 16 < longest < 32  # span_init 0.3: z + R = 0.3 * 64 + 8, barely moved in 4 steps
    assert learned[0] == pytest.approx(fixed[0])  # S = 16: every span clipped to S
    assert learned[1] == learned[2] == learned[3] < fixed[1]  # S >= every span: flat


def test_cost_panel_memory_grows_linearly_with_fixed_span_only(reports):
    _, data = reports["adaptive"]
    fixed = data["costs"]["curves"][FIXED]["memory_mb"]
    learned = data["costs"]["curves"][LEARNED]["memory_mb"]
    assert len(fixed) == len(learned) == len(LIMITS)
    growth = [b - a for a, b in itertools.pairwise(fixed)]  # S doubles: 16 ... 128
    # about linear in S: the increments double as S doubles (up to the chunking's rounding)
    assert growth[0] > 0 and all(1.8 < b / a < 2.3 for a, b in itertools.pairwise(growth))
    assert learned[0] == pytest.approx(fixed[0], rel=0.01)  # S = 16: every span clipped to S
    assert learned[1:] == pytest.approx([learned[1]] * 3, rel=0.01) and learned[3] < fixed[3]


def test_fixed_run_has_no_learned_curve(reports):
    page, data = reports["fixed"]
    assert list(data["costs"]["curves"]) == [FIXED]
    assert "has no learned spans" in page


def test_flops_curve_of_a_model_with_learned_spans():
    spans = [[8.0, 40.0], [20.0, 100.0]]
    curves = flops_curves(MODEL, spans, [64, 256], block_size=32)
    keys = 2 * (MODEL.d_model // MODEL.n_heads)  # multiply-adds per attended key and head
    assert curves[LEARNED][1] - curves[LEARNED][0] == pytest.approx(keys * (100 - 64))
    assert curves[FIXED][1] - curves[FIXED][0] == pytest.approx(keys * 4 * (256 - 64))


def test_profiled_peak_is_the_maximum_of_live_allocations():
    def allocate():
        big = torch.empty(10_000_000, dtype=torch.uint8)
        del big
        return [torch.empty(n, dtype=torch.uint8) for n in (4_000_000, 3_000_000)]

    peak = profiled_peak(allocate)
    assert 10_000_000 <= peak < 10_100_000
    assert profiled_peak(lambda: torch.empty(12_000_000, dtype=torch.uint8)) >= 12_000_000


def test_dynamic_spans_follow_the_equation_in_the_first_layer(runs, reports):
    _, data = reports["dynamic"]
    text = data["dynamic"]["text"]
    spans = data["dynamic"]["spans"]
    assert len(spans) == MODEL.n_layers and all(len(s) == len(text.encode()) for s in spans)
    model = load_model(runs["dynamic"])
    tokens = torch.tensor(list(text.encode()))
    span = model.layers[0].attn.span  # its input is the embedding: z_t = S sigmoid(v.x_t + b)
    z = MODEL.max_span * torch.sigmoid(model.embed(tokens) @ span.v.t() + span.b)
    want = (z + MODEL.ramp).clamp(max=MODEL.max_span).mean(dim=1)
    assert spans[0] == pytest.approx(want.tolist(), rel=1e-5)
    assert dynamic_spans(model, list(text.encode()))[0] == pytest.approx(spans[0], rel=1e-5)
    assert all(MODEL.ramp <= s <= MODEL.max_span for layer in spans for s in layer)


def test_a_variant_is_reported_by_what_its_span_type_does(tmp_path, monkeypatch):
    """A variant of any name with spans per token gets the Figure 5 spans and a learned curve."""
    def build(config: ModelConfig) -> SpanAttention:
        return SpanAttention(config, DynamicSpan(config.n_heads, config.max_span, config.ramp,
                                                 config.d_model))

    monkeypatch.setitem(ATTENTIONS, "per-token test", Variant(build, span=DynamicSpan))
    model = SpanLM(replace(MODEL, attention="per-token test"))
    data = report_data(model, TrainConfig(block_size=16), tmp_path, "abcd", [16, 32], None)
    assert data["learned_spans"] and len(data["dynamic"]["spans"][0]) == 4
    assert list(data["costs"]["curves"]) == [FIXED, LEARNED]
    assert data["dynamic"]["meaning"] == DynamicSpan.token_span


def test_figure_5_says_what_the_span_of_a_character_is(reports, tmp_path):
    """Each span type that varies per token says what its span at a character means."""
    assert "uses to predict the next character" in reports["dynamic"][0]
    model = SpanLM(replace(MODEL, attention="expire"))
    data = report_data(model, TrainConfig(block_size=16), tmp_path, "abcd", [16, 32], None)
    assert data["dynamic"]["meaning"].startswith("the lifetime min(L, e_i + R)")


def test_default_text_is_a_sentence_of_the_valid_split(runs):
    text = default_text(TrainConfig(data="kjv"))
    valid = bytes(load_corpus("kjv", progress=False).valid[:4000]).decode("ascii")
    assert text in valid and text[0].isupper() and TEXT_CHARS // 2 < len(text) <= TEXT_CHARS
    assert default_text(TrainConfig(data="/no/such/corpus.txt")).startswith("The span")


def test_cli_report_with_text_out_and_no_memory(runs, tmp_path, capsys):
    out = tmp_path / "page"
    assert main(["report", str(runs["dynamic"]), "--out", str(out), "--text", "abc <de>",
                 "--limits", "32,64", "--no-memory"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out / REPORT_FILE}"
    data = json.loads((out / DATA_FILE).read_text())
    assert data["dynamic"]["text"] == "abc <de>" and len(data["dynamic"]["spans"][0]) == 8
    assert data["costs"]["curves"][FIXED]["memory_mb"] == []
    assert data["costs"]["memory_probe"] is None
    page = (out / REPORT_FILE).read_text()
    assert "abc &lt;de&gt;" in page and "peak memory" not in page


def test_old_runs_without_per_layer_records_draw_the_overall_spans(runs, tmp_path):
    run_dir = tmp_path / "old"
    shutil.copytree(runs["adaptive"], run_dir)
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    metrics.write_text("".join(json.dumps({k: v for k, v in r.items()
                                           if "layer" not in k and k != "head_spans"})
                               + "\n" for r in records))
    page = write_report(run_dir, limits=(32,), memory=False).read_text()
    assert "hold no per-layer spans" in page and "hold no per-head spans" in page
    assert len(_images(page)) == len(FIGURES) - 1  # no figure of each head's span


@pytest.mark.parametrize("attention", ["adaptive", "dynamic"])
def test_report_holds_each_heads_span_at_every_record(runs, reports, attention):
    page, data = reports[attention]
    records = [json.loads(line) for line in (runs[attention] / "metrics.jsonl").read_text()
               .splitlines()]
    history = data["head_spans"]
    assert history["steps"] == [r["step"] for r in records] == [1, 2, 3, 4]
    assert [[[r["head_spans"][i][h] for r in records] for h in range(MODEL.n_heads)]
            for i in range(MODEL.n_layers)] == history["spans"]
    assert f"dotted: R = {MODEL.ramp}" in page and "a line per head" in page


def test_missing_matplotlib_is_a_one_line_error(runs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["report", str(runs["fixed"]), "--no-memory"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "adaspan[plot]" in err


@pytest.mark.parametrize("limits", ["64,x", "0,64", ","])
def test_bad_limits_are_usage_errors(runs, limits, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["report", str(runs["fixed"]), "--limits", limits])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and last.startswith("adaspan report: error: argument --limits")
    assert "not a list of whole numbers > 0" in last


def test_compare_figure_draws_every_method_against_time():
    def events(bpc: float) -> list[dict]:
        return [{"step": s, "elapsed": 60.0 * s, "train_bpc": bpc - s / 10,
                 "valid_bpc": bpc - s / 10 if s % 2 == 0 else None, "avg_span": 40.0 + s}
                for s in range(1, 5)]

    fig = compare_figure({"fixed": events(5.0), "adaptive": events(4.0)})
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == ["_nolegend_", "fixed", "_nolegend_", "adaptive"]  # one entry per method
    assert list(fig.axes[0].lines[1].get_xdata()) == [2.0, 4.0]  # minutes: 120 s, 240 s
    assert fig.axes[0].get_xlabel() == "wall time (minutes of training)"
