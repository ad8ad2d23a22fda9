"""``python -m vlmspec.testbed build ...``: see :mod:`vlmspec.testbed.cli`."""

import sys

from .cli import main

sys.exit(main())
