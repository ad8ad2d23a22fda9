"""The library's own errors: what a user's input can cause, each message naming the input, what is wrong and what
to do.

Every check of user input (options, names, files, media, requests) raises one of these. They subclass the
built-in error a caller would expect (``ValueError``, ``TypeError``, ``FileNotFoundError``), so ``except
ValueError`` keeps working, while ``except VLMSpecError`` catches exactly the user's mistakes and not the bugs: the
command lines print those as one line (``vlmspec <command>: error: ...``) and keep the traceback for the rest.
"""

from __future__ import annotations

import inspect
from pathlib import Path


class VLMSpecError(Exception):
    """Base of every error a user's input causes."""


class InvalidInputError(VLMSpecError, ValueError):
    """A value is wrong: out of range, an unknown name, content that cannot be read."""


class InputTypeError(VLMSpecError, TypeError):
    """A value is of the wrong type."""


class InputNotFoundError(VLMSpecError, FileNotFoundError):
    """A named file or folder does not exist."""


class SlowSpeculationWarning(UserWarning):
    """The pipeline's policy is expected to decode slower than plain decoding on this machine (its draft costs too
    much of the target); see :meth:`vlmspec.policies.TreePolicy.warn_if_slow`."""


def user_stacklevel() -> int:
    """The ``warnings.warn`` stacklevel, called from its caller, that names the first line outside vlmspec (the
    user's ``pipe.policy = ...``, ``from_pretrained(...)`` or ``pipe(...)``), so a warning points at the user's
    code."""
    package = Path(__file__).resolve().parent
    frame, level = inspect.currentframe().f_back, 1  # the frame calling warnings.warn
    while frame.f_back is not None and _is_library_frame(Path(frame.f_code.co_filename), package):
        frame, level = frame.f_back, level + 1
    return level


def _is_library_frame(path: Path, package: Path) -> bool:
    """A frame of vlmspec, or of the decorator wrappers around its methods (``torch.no_grad``, ``contextlib``)."""
    return path.name.endswith("contextlib.py") or path.resolve().is_relative_to(package)
