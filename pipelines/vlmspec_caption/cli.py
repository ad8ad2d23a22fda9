"""``vlmspec caption`` (and ``python -m vlmspec_caption``, ``python pipelines/video_captioning.py``): the command line.

All three take the same arguments (:func:`add_arguments`) and treat errors alike: a job error or a bad input prints
one line and exits 1, ``--debug`` (or ``VLMSPEC_DEBUG=1``) shows an unexpected error's traceback instead."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from vlmspec.cli import (  # the boundary for user errors that `vlmspec caption` has
    DEBUG_ENV,
    USER_ERRORS,
    ArgumentParser,
)
from vlmspec.quantization import QUANTIZATION_NAMES
from vlmspec.reasoning import PARSER_NAMES

from .config import (
    DTYPES,
    EXIT_INTERRUPTED,
    EXIT_JOB_ERROR,
    EXIT_OK,
    FRAME_SAMPLERS,
    PROG,
    JobConfig,
    JobError,
    json_object,
    load_config,
)
from .run import run_job


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the job's arguments to ``parser`` (for ``vlmspec caption``'s subparser and the script)."""
    keep = argparse.SUPPRESS  # flags not given leave the config's value
    a = parser.add_argument
    a(
        "input",
        help="a folder of videos (subfolders and symlinked ones included, hidden ones skipped), a glob (quote it) "
        "or a .jsonl/.csv manifest (path, prompt, id, start, end)",
    )
    a("--out", help="output JSONL file (one line per video; resumed when it exists)")
    a("--config", help="job config YAML (default: configs/jobs/video_captioning.yaml in a source checkout)")
    a(
        "--target",
        default=keep,
        help="target folder or hub id, or a pair name: testbed-base@cpu (default), testbed-mini, tiny, ...",
    )
    a("--draft", default=keep, help="draft folder or hub id (not with testbed-*/tiny)")
    a("--family", default=keep, help="family of a named pair (default qwen2_vl)")
    a(
        "--policy",
        default=keep,
        help="tree policy (default sage, or a saved pipeline's own; ar: plain decoding)",
    )
    a("--policy-options", default=keep, help="JSON object of policy options, e.g. '{\"n_max\": 32}'")
    a("--prompt", default=keep, help="prompt for videos without their own (manifest) prompt")
    a("--image-prompt", default=keep, help="prompt for pictures without their own (manifest) prompt")
    a("--max-new-tokens", type=int, default=keep, help="most tokens per caption (default 256)")
    a("--structured-outputs", default=keep,
      help='JSON: every caption follows this structure, e.g. \'{"json": {...schema...}}\' or \'{"regex": "..."}\' '
      "(pipe(structured_outputs=...))")  # fmt: skip
    a("--reasoning-parser", choices=PARSER_NAMES, default=keep,
      help="a thinking model's tags: each caption is the answer after the reasoning, which goes in 'reasoning'")  # fmt: skip
    a("--num-frames", type=int, default=keep, help="frames sampled per video (default 8)")
    a("--mm-processor-kwargs", default=keep,
      help='JSON: the processor\'s settings for every video, e.g. \'{"max_pixels": 200704}\' (vLLM\'s)')  # fmt: skip
    a("--segment", type=float, default=keep,
      help="caption each video in windows of this many seconds, one line each (default: whole videos)")  # fmt: skip
    a(
        "--prune-ratio",
        type=float,
        default=keep,
        help="fraction of visual tokens the draft drops, applied as given (default: the library's, 0.9 for videos "
        "but never below 64 tokens)",
    )
    a("--frame-sampler", choices=FRAME_SAMPLERS, default=keep,
      help="decord (evenly, num_frames) or qwen (qwen-vl-utils; Qwen families); auto: qwen if a qwen option is set")  # fmt: skip
    a("--fps", type=float, default=keep, help="qwen sampler: frames per second to sample")
    a("--max-frames", type=int, default=keep, help="qwen sampler: most frames with --fps")
    a("--min-pixels", type=int, default=keep, help="qwen sampler: least pixels per frame")
    a("--max-pixels", type=int, default=keep, help="qwen sampler: most pixels per frame")
    a("--dtype", choices=DTYPES, default=keep, help="model dtype (default auto: the checkpoint's)")
    a(
        "--device-map",
        default=keep,
        help="device_map for from_pretrained, e.g. auto (a large target over GPUs)",
    )
    a("--quantization", default=keep,
      help=f"quantize the target as it loads: {', '.join(QUANTIZATION_NAMES)} or a quantization config's JSON")  # fmt: skip
    a("--draft-quantization", default=keep, help="quantize the draft as it loads (as --quantization)")
    a("--cpu", action="store_true", help="keep the models on the CPU (also ACCELERATE_USE_CPU=1)")
    a("--extensions", default=keep,
      help="comma-separated extensions for folder inputs; 'videos' and 'images' name groups (default videos); "
           "pictures are captioned as images, with --image-prompt")  # fmt: skip
    a("--retry-errors", action=argparse.BooleanOptionalAction, default=keep,
      help="on restart, retry videos that have an error line (default yes)")  # fmt: skip
    a(
        "--trace",
        action=argparse.BooleanOptionalAction,
        default=keep,
        help="keep the per-step trace in the stats",
    )
    a("--threads", type=int, default=keep, help="torch CPU threads per process")
    a("--progress", action=argparse.BooleanOptionalAction, default=keep, help="progress bar (default yes)")
    a("--batch-size", type=int, default=keep,
      help="videos decoded together (default: chosen from the cost probe, see pipe.default_batch_size)")  # fmt: skip
    # `vlmspec` takes --debug anywhere on its command line (and removes it before this parser sees it); the job's
    # own entry points (`python -m vlmspec_caption`, the script) take it here, to the same effect (see `main`).
    a("--debug", action="store_true", help=f"show the traceback of an unexpected error (also {DEBUG_ENV}=1)")
    return parser


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config values given on the command line.

    Raises:
        JobError: ``--policy-options`` is not a JSON object.
    """
    values = {key: getattr(args, key) for key in JobConfig.field_names() if hasattr(args, key)}
    for name in ("policy_options", "structured_outputs", "mm_processor_kwargs"):
        if name in values:
            values[name] = json_object(values[name], "--" + name.replace("_", "-"))
    return values


def run_args(args: argparse.Namespace) -> int:
    """Runs the job from parsed arguments (see :func:`add_arguments`); returns the exit status.

    0: every video captioned; 2: some failed (error lines written); 1: the job could not run (message on stderr);
    130: interrupted (Ctrl-C; rerun the same command to resume).
    """
    try:
        config = load_config(args.config, overrides_from_args(args))
        if not args.out:
            raise JobError("--out is required: the output JSONL file")
        if args.out.endswith(("/", os.sep)):
            raise JobError(
                f"--out {args.out!r} names a folder: give the output file, e.g. {args.out}captions.jsonl"
            )
        summary = run_job(config, args.input, args.out, cpu=args.cpu)
    except JobError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_JOB_ERROR
    except KeyboardInterrupt:  # finished lines are on disk already: say how to go on, no traceback
        print(f"\n{PROG}: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary is None:  # not the main process: the main process reports
        return EXIT_OK
    print(summary.line(), flush=True)
    return summary.exit_code


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The job's argument parser (bad flags exit with status 1)."""
    description = (__doc__ or "").split("\n\n")[0]
    return add_arguments(ArgumentParser(prog=prog, description=description))


def register(commands: argparse._SubParsersAction) -> None:
    """Adds ``vlmspec caption`` to the ``vlmspec`` command line (the ``vlmspec.commands`` entry point)."""
    parser = commands.add_parser(
        "caption", help="caption a folder/glob/manifest of videos into a resumable JSONL"
    )
    add_arguments(parser)
    parser.set_defaults(func=run_args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python pipelines/video_captioning.py INPUT --out captions.jsonl [options]`` (and ``python -m
    vlmspec_caption``); returns the exit status.

    The same boundary as ``vlmspec caption`` (:func:`vlmspec.cli.main`): an error from a bad input that is not the
    job's own (:data:`vlmspec.cli.USER_ERRORS`) prints one line and exits 1, unless ``--debug`` or
    ``VLMSPEC_DEBUG=1`` asks for its traceback.
    """
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # before the job started: nothing written, nothing to resume
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    debug = args.debug or bool(os.environ.get(DEBUG_ENV))
    try:
        return run_args(args)
    except USER_ERRORS as err:
        if debug:
            raise
        print(f"{PROG}: error: {err} (--debug shows the traceback)", file=sys.stderr)
        return EXIT_JOB_ERROR
