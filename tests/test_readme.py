"""The Python examples of the README and of docs/architecture.md run as written."""

import re
from pathlib import Path

import pytest
import torch

from adaspan.attention.registry import ATTENTIONS

ROOT = Path(__file__).resolve().parents[1]


def _run_python_blocks(path: Path) -> list[dict]:
    """Run every ``python`` block of ``path``; the namespace each block leaves."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    assert blocks
    namespaces = []
    for code in blocks:
        namespaces.append({})
        exec(compile(code, str(path), "exec"), namespaces[-1])
    return namespaces


def test_readme_examples_run_and_do_what_their_comments_say(capsys):
    ns, own = _run_python_blocks(ROOT / "README.md")
    assert own["model"](own["x"]).shape == own["x"].shape  # span attention in a user's model
    for layer in own["model"]:  # the loss reached every z; z' clamped back into [0, 1]
        assert layer.span.z_frac.grad is not None and (layer.span.z_frac.grad != 0).all()
        assert ((layer.span.z_frac >= 0) & (layer.span.z_frac <= 1)).all()
    config, model = ns["config"], ns["model"]
    assert ns["y"].shape == ns["x"].shape  # the attention keeps (batch, block, d_model)
    assert len(ns["cache"]) == len(ns["kv"]) == config.n_layers  # one cache per layer
    spans = model.spans()  # per layer, per head, in tokens: printed as such
    assert capsys.readouterr().out.strip() == str(spans)
    assert [len(layer) for layer in spans] == [config.n_heads] * config.n_layers
    assert all(config.ramp <= span <= config.max_span for layer in spans for span in layer)
    log_probs = ns["log_probs"]  # normalised over the vocabulary
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(log_probs.shape[:2]))


@pytest.fixture
def registry_restored():
    saved = dict(ATTENTIONS)
    yield
    ATTENTIONS.clear()
    ATTENTIONS.update(saved)


def test_architecture_example_adds_a_variant(capsys, registry_restored):
    _run_python_blocks(ROOT / "docs" / "architecture.md")
    assert "window" in ATTENTIONS
    assert "torch.Size([2, 16, 256])" in capsys.readouterr().out
