"""The transformers that ``adaspan.hf`` supports: imported first by the part, it refuses a
missing one, or one older than the oldest the tests run with, in one line."""

from __future__ import annotations

from ..errors import UserError

OLDEST = (5, 17)  # CI runs tests/hf with 5.17.0 and with 5.24.0 (constraints.txt)

try:
    import transformers
except ImportError:
    raise UserError("adaspan.hf needs transformers: pip install 'adaspan[hf]'") from None


def version_of(text: str) -> tuple[int, ...]:
    """``"5.17.0"`` as ``(5, 17)``: the major and minor numbers."""
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


if version_of(transformers.__version__) < OLDEST:
    raise UserError("adaspan.hf needs transformers 5.17 or newer (tested: 5.17 and 5.24), "
                    f"found {transformers.__version__}: pip install 'transformers>=5.17'")
