"""``python -m vlmspec_batch``: the batch job's command line."""

import sys

from .cli import main

sys.exit(main())
