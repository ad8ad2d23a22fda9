"""The testbed world: a trained target/draft VLM pair for each family, built locally on the CPU.

No checkpoint can be downloaded in tests and random models accept drafts by accident, so the project trains its
own small world: procedurally drawn shapes and short clips with long captions, short questions and temporal
captions. The target VLM is genuinely good at it, the draft (smaller, with a weaker vision tower, distilled from
the target) genuinely weaker, and the target's uncertainty varies along a caption like a real captioner's:
confident on runs fixed by the picture or the grammar, uncertain on runs of random words.

    from vlmspec import VLMSpecPipeline
    from vlmspec import testbed

    target, draft = testbed.pair_paths("base", "qwen2_vl")   # trains once (~15-20 min), then cached
    example = testbed.sample("image_caption", seed=3)        # .image, .prompt, .reference
    pipe = VLMSpecPipeline.from_pretrained(target, draft, policy="sage")
    print(pipe(example.image, example.prompt).text)

Command line: ``python -m vlmspec.testbed build --size base --family all``.
"""

from __future__ import annotations

from .pairs import (
    SHIPPED_ROOT,
    TESTBED_VERSION,
    TestbedPair,
    build,
    compare_with_shipped,
    default_root,
    edd_path,
    pair_folder,
    pair_paths,
    prune,
    shipped_pair,
)
from .tokenizer import FAMILIES
from .train import SIZES
from .world import TASKS, Example, caption_facts, fact_accuracy, sample, write_video

__all__ = [
    "FAMILIES",
    "SHIPPED_ROOT",
    "SIZES",
    "TASKS",
    "TESTBED_VERSION",
    "Example",
    "TestbedPair",
    "build",
    "compare_with_shipped",
    "caption_facts",
    "default_root",
    "edd_path",
    "fact_accuracy",
    "pair_folder",
    "pair_paths",
    "prune",
    "sample",
    "shipped_pair",
    "write_video",
]
