"""How the plugin meets lmms-eval's command line: its output folder, and user mistakes as failed runs.

lmms-eval's command line catches every exception a model raises, prints its traceback and exits 0, so a CI job
would record a green run with no results. A user mistake (a bad ``--model_args`` value, a task's bad generation
kwargs, a document's missing media) therefore leaves the command line as a ``SystemExit``: one line, exit 1. Called
from Python (``lmms_eval.evaluator.simple_evaluate``), the same mistake raises the
:class:`~vlmspec.errors.VLMSpecError` itself, which the caller can catch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

__all__ = ["lmms_eval_output_path", "running_lmms_eval_cli", "user_error"]


def running_lmms_eval_cli() -> bool:
    """Whether lmms-eval's command line (``cli_evaluate``) is on the call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name.startswith("cli_evaluate") and "lmms_eval" in code.co_filename:
            return True
        frame = frame.f_back
    return False


def user_error(error: Exception) -> BaseException:
    """What to raise for a user mistake: ``SystemExit("vlmspec model: ...")`` under lmms-eval's command line (a
    failed run, exit 1), ``error`` itself elsewhere."""
    return SystemExit(f"vlmspec model: {error}") if running_lmms_eval_cli() else error


def lmms_eval_output_path(argv: Sequence[str] | None = None) -> str | None:
    """The ``--output_path`` of the lmms-eval command line (or of its ``--config`` YAML), if any.

    lmms-eval does not hand its output folder to models; the speed files go next to its results, so the model
    reads the option from the command line (``speed_dir=`` overrides it, e.g. for programmatic use).
    """
    parser = argparse.ArgumentParser(
        add_help=False
    )  # abbreviations as lmms-eval's: --output is --output_path
    parser.add_argument("--output_path", default=None)
    parser.add_argument("--config", default=None)
    known, _ = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if known.output_path:
        return known.output_path
    if known.config and Path(known.config).is_file():
        loaded = yaml.safe_load(Path(known.config).read_text())
        first = loaded[0] if isinstance(loaded, list) and loaded else loaded
        if isinstance(first, dict) and first.get("output_path"):
            return str(first["output_path"])
    return None
