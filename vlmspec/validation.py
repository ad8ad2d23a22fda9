"""Options checked by type from their dataclass declarations: one mechanism wherever an option enters.

A value from Python, YAML, JSON on a command line or lmms-eval's ``--model_args`` reaches a config dataclass; before
the class checks its ranges, :func:`check_field_types` checks each field against its declared type, so that
``d_max="8"`` is refused as "expected an integer, got str" instead of failing later inside a comparison.

Supported declarations: ``int`` (``bool`` is not an int here), ``float`` (an int is accepted), ``str``, ``bool``,
unions with ``None``, ``Literal[...]``, ``tuple[...]`` (a list is accepted: YAML and JSON have no tuples; the
items are checked by the class itself) and other generic containers (``dict[str, Any]``: a dict).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

from .errors import InvalidInputError


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def check_field_types(config: Any) -> None:
    """Raise ``ValueError`` naming the config, the field, its value and the declared type, for the first mismatch.

    ``ValueError`` (not ``TypeError``): an option of the wrong type is one more invalid option value, handled
    wherever options are (the command lines, the bench, the plugin) like an out-of-range one.
    """
    for name, declared in _field_types(type(config)).items():
        value = getattr(config, name)
        if not _matches(value, declared):
            raise InvalidInputError(
                f"{type(config).__name__}.{name}={value!r} is invalid: expected {_describe(declared)}, "
                f"got {type(value).__name__}"
            )


def _matches(value: Any, declared: Any) -> bool:
    origin = typing.get_origin(declared)
    if origin in (Union, types.UnionType):
        return any(_matches(value, option) for option in typing.get_args(declared))
    if origin is Literal:
        return value in typing.get_args(declared)
    if origin is tuple or declared is tuple:
        return isinstance(value, (tuple, list))
    if declared is type(None):
        return value is None
    if declared is bool:
        return isinstance(value, bool)
    if declared is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if declared is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(declared, type):
        return isinstance(value, declared)
    if isinstance(origin, type):  # dict[str, Any], list[int], ...: the container's type (items: the class's)
        return isinstance(value, origin)
    return True  # a declaration this checker does not know: left to the class


def _describe(declared: Any) -> str:
    origin = typing.get_origin(declared)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(option) for option in typing.get_args(declared))
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(declared))
    if origin is tuple or declared is tuple:
        return "a list"
    if isinstance(origin, type):
        return f"a {'mapping' if origin is dict else origin.__name__}"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "None"}
    return names.get(declared, getattr(declared, "__name__", str(declared)))
