"""scripts/against_official.py runs the authors' benchmark script with its spans held: its
Adagrad's learning rate is pinned (a stand-in script here: tests never run the authors' code)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "against_official.py"
STAND_IN = """
import json, sys, torch
optimizer = torch.optim.Adagrad([torch.zeros(1, requires_grad=True)], lr=0.07)
print("a line before the figures")
print(json.dumps({"lr": optimizer.defaults["lr"], "argv": sys.argv[1:], "file": __file__}))
"""


def _against_official():
    spec = importlib.util.spec_from_file_location("against_official", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_authors_learning_rate_is_pinned_unless_run_as_provided(tmp_path):
    against_official = _against_official()
    stand_in = tmp_path / "bench_official.py"
    stand_in.write_text(STAND_IN)
    config = against_official.CONFIGS["reference"]
    pinned = against_official.authors(stand_in, config, steps=3)
    provided = against_official.authors(stand_in, config, steps=3, as_provided=True)
    assert pinned["lr"] == 1e-9 and provided["lr"] == 0.07
    assert pinned["argv"] == provided["argv"]  # the same arguments reach the script
    assert pinned["argv"][pinned["argv"].index("--spans") + 1] == "32,64,128,1024"
    assert pinned["file"] == provided["file"] == str(stand_in)
