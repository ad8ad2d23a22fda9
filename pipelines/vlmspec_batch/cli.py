"""The batch job's command line: ``vlmspec batch INPUT --out OUTPUT`` (the pair and server options of ``vlmspec
serve``, without a listener)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vlmspec_caption.store import ResultWriter

from vlmspec.errors import VLMSpecError
from vlmspec.serve_cli import add_server_flags, build_server

from .run import PROG, answered, read_requests, run_batch

EXIT_OK, EXIT_JOB_ERROR, EXIT_PARTIAL, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("input", help="a JSONL file of OpenAI batch requests (custom_id, method, url, body)")
    parser.add_argument("--out", required=True, help="the output JSONL file (one line per request; resumed)")
    add_server_flags(parser)
    return parser


def run_args(args: argparse.Namespace) -> int:
    """Run the job; the exit status (module docstring of :mod:`vlmspec_batch`)."""
    totals = {"answered": 0, "refused": 0}
    try:
        batch = read_requests(args.input)
        with ResultWriter(args.out) as writer:  # locked before anything else: one job per output file
            done, refused_before = answered(batch, writer)
            if len(done) < len(batch):  # the pair loads only when there is something to answer
                with build_server(args, PROG) as server:
                    totals = run_batch(server, batch.requests(skip=done), writer)
    except VLMSpecError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_JOB_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; rerun the same command to answer the rest", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(
        f"{len(batch)} requests: {totals['answered']} answered, {totals['refused']} refused, {len(done)} already "
        f"done -> {args.out}"
    )
    return EXIT_PARTIAL if totals["refused"] + refused_before else EXIT_OK  # the whole file's answers


def register(commands: argparse._SubParsersAction) -> None:
    """Adds ``vlmspec batch`` to the ``vlmspec`` command line (the ``vlmspec.commands`` entry point)."""
    summary = "answer a file of OpenAI batch requests (chat completions) with the pair; resumable"
    add_arguments(parser := commands.add_parser("batch", help=summary))
    parser.set_defaults(func=run_args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vlmspec_batch [options]``: ``vlmspec batch`` through the command line's one boundary."""
    from vlmspec.cli import main as vlmspec_main

    return vlmspec_main(["batch", *(sys.argv[1:] if argv is None else argv)])
