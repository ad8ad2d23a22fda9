"""The batch video-captioning job as a script: ``python pipelines/video_captioning.py INPUT --out captions.jsonl``
(also under ``accelerate launch``). The job is the :mod:`vlmspec_caption` package (``pipelines/vlmspec_caption/``),
installed with vlmspec; ``vlmspec caption`` and ``python -m vlmspec_caption`` run the same thing."""

import sys

from vlmspec_caption import main

if __name__ == "__main__":
    sys.exit(main())
