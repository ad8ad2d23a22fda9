"""Policy YAML files (``configs/policies/*.yaml``): ``option: value`` lines, read with ``yaml.safe_load``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from ..errors import InputNotFoundError, InvalidInputError


def read_policy_file(path: str | Path) -> dict[Any, Any]:
    """The mapping a policy YAML file holds.

    Raises:
        InputNotFoundError: no such file.
        InvalidInputError: the file is not UTF-8 text, not valid YAML or not a mapping; the message names it.
    """
    path = Path(path)
    where = f"policy config {str(path)!r}"
    if not path.is_file():
        raise InputNotFoundError(f"{where} does not exist")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise InvalidInputError(f"{where} is not UTF-8 text ({err}): save it as UTF-8") from None
    except yaml.YAMLError as err:
        raise InvalidInputError(f"{where} is not valid YAML: {_yaml_problem(err)}") from None
    except OSError as err:
        raise InvalidInputError(f"{where} could not be read: {err}") from None
    values = {} if values is None else values
    if not isinstance(values, dict):
        raise InvalidInputError(
            f"{where} must hold a mapping of option: value lines (as configs/policies/*.yaml), got {values!r:.80}"
        )
    return values


def _yaml_problem(err: yaml.YAMLError) -> str:
    """yaml's reason, with the line and column it points to, on one line."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem is None or mark is None:
        return " ".join(str(err).split())
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"
