"""``python -m fastio.cli``: the ``fastio`` command, for a checkout without the console script."""

import sys

from fastio.cli import entry

sys.exit(entry())
