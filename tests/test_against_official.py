"""scripts/bench/against_official.py runs the authors' benchmark script with its spans held: its
Adagrad's learning rate is pinned (a stand-in script here: tests never run the authors' code)."""

from __future__ import annotations

import torch
from helpers import load_script

STAND_IN = """
import json, sys, torch
optimizer = torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], lr=0.07)
print("a line before the figures")
print(json.dumps({"lr": optimizer.defaults["lr"], "argv": sys.argv[1:], "file": __file__}))
"""


def test_the_authors_learning_rate_is_pinned_unless_run_as_provided(tmp_path):
    against_official = load_script("against_official")
    stand_in = tmp_path / "bench_official.py"
    stand_in.write_text(STAND_IN)
    config = against_official.CONFIGS["reference"]
    pinned = against_official.authors(stand_in, config, steps=3)
    provided = against_official.authors(stand_in, config, steps=3, as_provided=True)
    assert pinned["lr"] == 1e-9 and provided["lr"] == 0.07
    assert pinned["argv"] == provided["argv"]  # the same arguments reach the script
    assert pinned["argv"][pinned["argv"].index("--spans") + 1] == "32,64,128,1024"
    assert pinned["file"] == provided["file"] == str(stand_in)


def test_every_configuration_is_one_adaspan_builds_with_its_spans():
    """Each configuration of the side-by-side, as the options adaspan bench receives, is a
    valid adaspan model whose heads get the spans the authors' script is given (cycled over
    the heads, as both scripts do)."""
    from adaspan.measure.bench import build_bench_model
    from adaspan.resolve import resolve_config

    against_official = load_script("against_official")
    for name, config in against_official.CONFIGS.items():
        layers, heads, span, spans = config[0], config[2], config[4], config[5]
        model_config, _ = resolve_config(overrides=against_official.model_options(config))
        model = build_bench_model(model_config, spans, torch.device("cpu"))
        if spans == "fixed":
            expected = [float(span)] * heads
        else:
            values = [float(s) for s in spans.split(",")]
            expected = [values[h % len(values)] for h in range(heads)]
        assert model.spans() == [expected] * layers, name
        assert model_config.max_span == span and model_config.dropout == 0, name
