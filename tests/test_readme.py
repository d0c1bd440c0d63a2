"""The Python examples of the README and of docs/architecture.md run as written."""

import re
from pathlib import Path

import pytest

from adaspan.registry import ATTENTIONS

ROOT = Path(__file__).resolve().parents[1]


def _run_python_blocks(path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, str(path), "exec"), {})


def test_readme_examples_run(capsys):
    _run_python_blocks(ROOT / "README.md")
    assert "[[" in capsys.readouterr().out  # model.spans() printed


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
