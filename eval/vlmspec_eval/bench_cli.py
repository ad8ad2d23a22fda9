"""``vlmspec bench``'s command line: its options and their defaults, importing neither torch nor the models, so
``vlmspec --help`` and a bad option answer at once (:mod:`vlmspec_eval.bench` runs the bench)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlmspec.cli import ArgumentParser, json_object
from vlmspec.costs import DEFAULT_BUDGET_FACTOR

from .flag_types import batch_sizes, beam_width, budget, comma_list

TASKS: tuple[str, ...] = ("image_caption", "image_qa", "video_caption")
"""The task mix of the bench (SAGE Table 1's image captioning, image QA and video captioning)."""
INPUT_SOURCES: tuple[str, ...] = ("auto", "testbed", "synthetic")
"""Where the inputs come from: the testbed world (``auto``, the default, is the testbed) or synthetic pictures."""
PROBE_SIZES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
"""Tokens per probed forward (the root included: a tree of ``N`` draft nodes verifies ``N + 1`` tokens)."""
DEFAULT_PRUNE_RATIOS: tuple[float, ...] = (0.0, 0.5, 0.8, 0.9)
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16", "auto")
"""``--dtype`` choices: names ``from_pretrained`` takes as they are (``auto``: the checkpoint's dtype)."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the bench's options to ``parser`` (for ``vlmspec bench``'s subparser)."""
    a = parser.add_argument
    a("--target", help="target model folder or hub id, pair name, or a folder written by pipe.save_pretrained (its "
      "pair; the bench's own settings) (default: the testbed base pair)")  # fmt: skip
    a("--draft", help="draft model folder or hub id (with --target)")
    a("--family", default="qwen2_vl", help="family of the default pair or of a pair name (default qwen2_vl)")
    a("--size", default=None, help="testbed pair size of the default pair (default base; not with --target)")
    a(
        "--calibration",
        default=None,
        help="calibration of the default pair or of a --target pair name that names none: cpu (the default pair's "
        "default: the target inflated exactly to 15-25x the draft's cost), 7b-2b, 7b-3b, 7b-0.5b, 8b-1b, 8b-2b (real "
        "checkpoints' shapes, for GPUs), or none (the pair as trained)",
    )
    a("--tasks", type=comma_list(str), default=TASKS,
      help=f"comma-separated tasks (default {','.join(TASKS)})")  # fmt: skip
    a(
        "--methods",
        default=None,
        help="comma-separated methods: ar, hf_generate, hf_assisted and policy names (default: all; ar and "
        "hf_generate always run)",
    )
    a("--n", type=int, default=3, help="inputs per task (default 3)")
    a("--repeats", type=int, default=3, help="timed repeats per input, interleaved; medians (default 3)")
    a("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    a("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    a("--budget", type=budget, default="auto",
      help="tree node budget: 'auto' (default: fitted to the cost probe, as a pipeline does), N, or 'default' "
           "(each policy's config defaults)")  # fmt: skip
    a("--auto-factor", type=float, default=DEFAULT_BUDGET_FACTOR,
      help="--budget auto: largest tree whose verification costs <= this x one token (default 2)")  # fmt: skip
    a("--prune-ratios", type=comma_list(float), default=DEFAULT_PRUNE_RATIOS,
      help="sage draft prune ratios for the ablation, '' or 'none' to skip (default 0,0.5,0.8,0.9)")  # fmt: skip
    a("--probe-sizes", type=comma_list(int), default=PROBE_SIZES,
      help="cost probe token counts (default 1..128)")  # fmt: skip
    a("--probe-runs", type=int, default=7, help="cost probe timed rounds, median taken (default 7)")
    a(
        "--inputs",
        choices=INPUT_SOURCES,
        default="auto",
        help="input source (default auto: testbed if importable)",
    )
    a("--dtype", choices=DTYPES, default="float32", help="model dtype (default float32)")
    a("--quantization", default=None,
      help="quantize the target as it loads, for every row (quanto-int8, torchao-int8, bnb-8bit, bnb-4bit or JSON)")  # fmt: skip
    a("--draft-quantization", default=None, help="quantize the draft as it loads (as --quantization)")
    a("--out", type=Path, default=Path("bench_out"), help="output folder (default bench_out/)")
    a("--json", type=Path, default=None, help="also write the JSON result here")
    a("--threads", type=int, default=None, help="torch CPU threads during the run (default: torch's)")
    a("--no-plots", action="store_true", help="skip the PNG plots")
    a("--quiet", action="store_true", help="no progress lines")
    a("--sampling", action="store_true",
      help="also bench sampling at temperature 1: tau and tokens/s of ar and the lossless --methods policies")  # fmt: skip
    a("--dsbd", action="store_true",
      help="also bench dsbd vs the target's beam and multinomial sampling on image_qa: tok/s, perplexity, exact match")  # fmt: skip
    a("--beam-width", type=beam_width, default=None,
      help="--dsbd: beam sampling's width, N or 'auto' (default: dsbd's mean output width)")  # fmt: skip
    a("--dsbd-options", type=json_object("--dsbd-options", '{"threshold": 0.7}'), default={},
      help="--dsbd: JSON of dsbd config options, e.g. '{\"threshold\": 0.7}' (default: the paper's)")  # fmt: skip
    a("--structured-outputs", type=json_object("--structured-outputs", '{"regex": "[a-z ]+"}'), default=None,
      help="every row's reply follows this structure (pipe(structured_outputs=...): json, regex, choice, grammar or "
      "json_object), hf_generate's through xgrammar's logits processor; hf_assisted has none")  # fmt: skip
    a("--edd", default="auto",
      help="EDD draft for the edd+<policy> rows: a folder, or 'auto' (the one shipped for a testbed pair)")  # fmt: skip
    a("--throughput", type=batch_sizes("--throughput"), default=None, metavar="SIZES",
      help="instead of the bench: the throughput section at these batch sizes (e.g. 1,4,8,16), --n videos, "
      "vlmspec (--throughput-policies) against transformers' batched generate(); see vlmspec_eval.throughput")  # fmt: skip
    a("--throughput-policies", type=comma_list(str), default=("sage",),
      help="policies of the throughput and conversation sections' vlmspec rows (default sage)")  # fmt: skip
    a("--conversation", action="store_true",
      help="instead of the bench: the multi-turn section, --n three-turn conversations per method (ar chat and "
      "--throughput-policies chats against generate() on the whole history); see vlmspec_eval.conversation")  # fmt: skip
    return parser


def build_parser() -> argparse.ArgumentParser:
    from . import bench

    parser = ArgumentParser(prog="vlmspec bench", description=bench.__doc__.split("\n\n")[0])
    return add_arguments(parser)


def register(commands: argparse._SubParsersAction) -> None:
    """Adds ``vlmspec bench`` to the ``vlmspec`` command line (the ``vlmspec.commands`` entry point); the bench itself
    (:mod:`vlmspec_eval.bench`, torch and the models) is imported when the command runs."""
    summary = "benchmark methods side by side (tau, tokens/s, speed-up, identical to AR)"
    add_arguments(parser := commands.add_parser("bench", help=summary))
    parser.set_defaults(func=_run_args)


def _run_args(args: argparse.Namespace) -> int:
    from .bench import run_args

    return run_args(args)
