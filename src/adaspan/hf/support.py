"""The transformers that ``adaspan.hf`` supports: imported first by the part, it refuses a
missing one, or one older than the oldest the tests run with, in one line."""

from __future__ import annotations

from .._version import version_tuple
from ..errors import UserError

OLDEST = (5, 17)  # CI runs tests/hf with 5.17.0 and with 5.24.0 (constraints.txt)

try:
    import transformers
except ImportError:
    raise UserError("adaspan.hf needs transformers: pip install 'adaspan[hf]'") from None


if version_tuple(transformers.__version__)[:2] < OLDEST:
    raise UserError("adaspan.hf needs transformers 5.17 or newer (tested: 5.17 and 5.24), "
                    f"found {transformers.__version__}: pip install 'transformers>=5.17'")
