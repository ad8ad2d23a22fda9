"""Reading the files vlmspec writes (a C2T classifier and its spec, C2T training data, an EDD draft) with errors
that name the file, what is wrong with it and what to do, instead of the raw ``JSONDecodeError`` or
``SafetensorError`` of a damaged or foreign file; and making a written file's directory entry durable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import InputNotFoundError, InvalidInputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch


def read_json_object(path: str | Path, what: str, remedy: str) -> dict[str, Any]:
    """The JSON object in ``path``.

    Args:
        path: the file.
        what: what the file should be, for messages (``"a C2T classifier spec"``).
        remedy: what to do when it is missing or unreadable (``"retrain it with ..."``).

    Raises:
        InputNotFoundError: no such file.
        InvalidInputError: not readable, not JSON, or JSON but not an object.
    """
    path = Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"{what} {str(path)!r} does not exist; {remedy}")
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidInputError(
            f"{str(path)!r} is not {what}: not readable JSON ({error}); {remedy}"
        ) from None
    if not isinstance(value, dict):
        raise InvalidInputError(
            f"{str(path)!r} is not {what}: it holds a JSON {type(value).__name__}, not an object; {remedy}"
        )
    return value


def read_safetensors(path: str | Path, what: str, remedy: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path`` (on the CPU).

    Raises:
        InputNotFoundError: no such file.
        InvalidInputError: not a readable safetensors file (truncated, garbage, another format).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"{what} {str(path)!r} does not exist; {remedy}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise InvalidInputError(
            f"{str(path)!r} is not {what}: not a readable safetensors file, truncated or damaged ({error}); "
            f"{remedy}"
        ) from None


def fsync_dir(folder: Path) -> None:
    """Make a new or renamed directory entry durable (where the platform allows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` a temporary file beside ``path`` (named ``.tmp-<pid>-<name>``: processes writing one folder
    never share one), fsync it, rename it onto ``path``, fsync the folder: a reader sees the old file or the new
    one, never half of one; a failed write leaves no temporary file."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        write(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
