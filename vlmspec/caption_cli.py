"""``vlmspec caption``: the batch video-captioning job (``pipelines/video_captioning.py``) as a subcommand.

The job lives in the repository's ``pipelines/`` folder, which is not part of the installed ``vlmspec`` package;
this module finds it in the source checkout next to the package (the project is installed in editable mode,
``pip install -e .``) and delegates to it::

    vlmspec caption videos/ --out captions.jsonl --target testbed-base --policy sage

Wiring into a parent parser::

    from vlmspec import caption_cli
    sub = parser.add_subparsers(...).add_parser("caption", help="caption a folder of videos (resumable)")
    caption_cli.add_arguments(sub)
    sub.set_defaults(func=caption_cli.run_args)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

JOB_MODULE = "pipelines.video_captioning"
JOB_FILE = Path(__file__).resolve().parents[1] / "pipelines" / "video_captioning.py"


def job_module() -> ModuleType:
    """The job module ``pipelines.video_captioning``, loaded from the source checkout if not yet imported.

    Raises:
        ImportError: the checkout's ``pipelines/video_captioning.py`` is not there (a non-editable install).
    """
    module = sys.modules.get(JOB_MODULE)
    if module is not None:
        return module
    if not JOB_FILE.is_file():
        raise ImportError(
            f"vlmspec caption runs pipelines/video_captioning.py from the source checkout, but {JOB_FILE} does not "
            "exist; install vlmspec from its repository in editable mode (pip install -e .)"
        )
    spec = importlib.util.spec_from_file_location(JOB_MODULE, JOB_FILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {JOB_FILE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[JOB_MODULE] = module  # registered before running it (dataclasses look their module up)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[JOB_MODULE]
        raise
    return module


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds ``vlmspec caption``'s arguments to ``parser`` (the job's own, see ``pipelines/video_captioning.py``)."""
    return job_module().add_arguments(parser)


def run_args(args: argparse.Namespace) -> int:
    """Runs the job from parsed arguments; returns 0 (all captioned), 2 (some failed) or 1 (could not run)."""
    return job_module().run_args(args)


def main(argv: Sequence[str] | None = None) -> int:
    """``vlmspec caption INPUT --out captions.jsonl [options]``; returns the exit status."""
    return run_args(job_module().build_parser("vlmspec caption").parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
