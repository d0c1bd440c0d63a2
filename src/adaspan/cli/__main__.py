"""``python -m adaspan.cli``: the ``adaspan`` command."""

import sys

from . import main

sys.exit(main())
