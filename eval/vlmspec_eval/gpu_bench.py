"""The GPU bench: ``vlmspec bench`` on the real-shape calibrated pairs in bf16, runnable on a bare GPU machine.

    bash eval/gpu_bench.sh                       # both pairs below, the bench's table and cost curve for each
    bash eval/gpu_bench.sh --pairs testbed-base:qwen2_vl@7b-2b --n 2 --repeats 2
    bash eval/gpu_bench.sh --conversation --n 4     # the multi-turn section instead (conversation.md per pair)
    bash eval/gpu_bench.sh --throughput 1,4,8,16    # the throughput section instead (throughput.md per pair)
    bash eval/gpu_bench.sh --serve-load --n 16      # the server under 3-turn conversations, prefix cache off/on

It needs no install: ``eval/gpu_bench.sh`` runs the machine's own ``python3`` with this tree on ``PYTHONPATH``,
and everything it imports (torch, transformers >= 5.17, numpy, pillow, safetensors, accelerate, tqdm, pyyaml,
filelock, jinja2) is in a GPU image; the trained testbed pairs ship in the package and are inflated on the GPU,
in memory, in seconds (:mod:`vlmspec.testbed.calibrate`). Every option of ``vlmspec bench`` applies; the defaults
differ: ``--dtype bfloat16``, ``--tasks image_caption,video_caption``, ``--max-new-tokens 128``, no pruning
ablation and no plots; node budgets and depths are the automatic ones, fitted to the GPU's own cost probe (a flat
curve gives every tree policy 64 nodes). For each pair it prints the bench's
markdown (summary, all metrics, cost curve with the roofline) and writes it under ``--out/<pair>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from vlmspec.cli import ArgumentParser

from . import serve_load
from .bench import add_arguments, run_args
from .flag_types import comma_list

DEFAULT_PAIRS: tuple[str, ...] = ("testbed-base:qwen2_vl@7b-2b", "testbed-base:llava_onevision@7b-0.5b")
"""Qwen2-VL-7B/2B-shaped and LLaVA-OneVision-7B/0.5B-shaped calibrated testbed pairs."""


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="eval/gpu_bench.sh",
        description=__doc__.split("\n\n")[0],
        epilog="Its defaults differ from vlmspec bench's (shown above): --dtype bfloat16, --tasks "
        "image_caption,video_caption, --max-new-tokens 128, --out gpu_bench_out, no --prune-ratios ablation, "
        "--no-plots; --pairs replaces --target/--draft.",
    )
    add_arguments(parser)
    parser.add_argument(
        "--pairs",
        type=comma_list(str),
        default=DEFAULT_PAIRS,
        help=f"comma-separated pair names (default {','.join(DEFAULT_PAIRS)})",
    )
    parser.add_argument(
        "--serve-load",
        action="store_true",
        help="instead: vlmspec serve at batch 8 under --n 3-turn conversations from 8 clients, prefix cache off and "
        "on (vlmspec_eval.serve_load; serve_load.md per pair)",
    )
    parser.set_defaults(
        dtype="bfloat16",
        tasks=("image_caption", "video_caption"),
        max_new_tokens=128,
        prune_ratios=(),
        no_plots=True,
        out=Path("gpu_bench_out"),
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, defaults = parser.parse_args(argv), parser.parse_args([])
    root = args.out
    for pair in args.pairs:
        args.target, args.draft = pair, None
        args.out = root / re.sub(r"[^A-Za-z0-9._-]+", "_", pair)
        status = serve_load_section(args) if args.serve_load else run_args(args, defaults)
        if status:
            return status
    return 0


def serve_load_section(args: argparse.Namespace) -> int:
    """:mod:`.serve_load` on ``args.target``: 3-turn conversations, prefix cache off then on; its table printed
    and written to ``args.out/serve_load.md``."""
    argv = ["--target", args.target, "--dtype", args.dtype, "--n", str(args.n), "--turns", "3"]
    argv += ["--batch-sizes", "8", "--prefix-cache-gb", "0,1", "--max-tokens", str(args.max_new_tokens)]
    for flag in ("quantization", "draft_quantization"):
        value = getattr(args, flag)
        argv += [f"--{flag.replace('_', '-')}", value] if value is not None else []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = serve_load.main(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_load.md").write_text(f"{args.target}, {args.dtype}\n\n{printed.getvalue()}")
    print(f"## {args.target}\n\n{printed.getvalue()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
