"""Policy YAML files (``configs/policies/*.yaml``): ``option: value`` lines, read with ``yaml.safe_load``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ..errors import InputNotFoundError, InvalidInputError


def read_policy_file(path: str | Path) -> dict[Any, Any]:
    """The mapping a policy YAML file holds.

    Raises:
        InputNotFoundError: no such file.
        InvalidInputError: the file is not UTF-8 text, not valid YAML, empty or not a mapping; the message names
            it.
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
    if values is None:  # nothing but comments or blanks: most likely the wrong file, or one not yet written
        raise InvalidInputError(
            f"{where} is empty: write its options as option: value lines (as configs/policies/*.yaml), or leave the "
            "file out for the policy's defaults"
        )
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


def file_options(path: str | Path, policies: Sequence[str]) -> dict[Any, Any]:
    """The options a policy file sets, its ``policy:`` key left out.

    Args:
        policies: the names the file's ``policy:`` key may hold, if it has one: the policy being loaded (empty:
            any name).

    Raises:
        InvalidInputError: as :func:`read_policy_file`, or the ``policy:`` key is not a name, or names a policy
            other than ``policies`` (a file of another policy's options, loaded as this one).
    """
    values = read_policy_file(path)
    if "policy" not in values:
        return values
    name = values.pop("policy")
    where = f"policy config {str(path)!r}"
    if not isinstance(name, str):
        raise InvalidInputError(
            f"{where}: policy: {name!r} is not a policy name: give the name of the policy the file configures"
            + (f" ({' or '.join(map(repr, policies))})" if policies else "")
        )
    if policies and name not in policies:
        raise InvalidInputError(
            f"{where} configures policy {name!r} (its policy: key), not {' or '.join(map(repr, policies))}: "
            f"load it as {name!r} (get_policy({name!r}, {str(path)!r})), or correct its policy: key"
        )
    return values
