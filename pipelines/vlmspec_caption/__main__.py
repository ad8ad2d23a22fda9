"""``python -m vlmspec_caption INPUT --out captions.jsonl [options]`` (also under ``accelerate launch -m``)."""

import sys

from .cli import main

sys.exit(main())
