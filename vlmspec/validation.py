"""Options checked by type from their dataclass declarations: one mechanism wherever an option enters.

A value from Python, YAML, JSON on a command line or lmms-eval's ``--model_args`` reaches a config dataclass; before
the class checks its ranges, :func:`check_field_types` checks each field against its declared type, so that
``d_max="8"`` is refused as "expected an integer, got str" instead of failing later inside a comparison.

Supported declarations: ``int`` (``bool`` is not an int here), ``float`` (an int is accepted), ``str``, ``bool``,
unions with ``None``, ``Literal[...]``, ``tuple[...]`` (a list is accepted: YAML and JSON have no tuples; the
items are checked by the class itself) and other generic containers (``dict[str, Any]``: a dict).

Values that arrive as text (lmms-eval's ``--model_args``) are first converted to their declared types by
:func:`coerce_fields`, the one generic conversion (nothing field-specific).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
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


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the choice closest to a mistyped ``name``, or ``""`` when none is close: the hint
    every refusal of an unknown name ends with."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def coerce_fields(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with each of ``cls``'s dataclass fields converted to its declared type where the value allows
    (see :func:`coerce`); other keys unchanged."""
    declared = _field_types(cls)
    return {k: coerce(v, declared[k]) if k in declared else v for k, v in values.items()}


def coerce(value: Any, declared: Any) -> Any:
    """``value`` converted to the ``declared`` type where its form allows, else unchanged (for
    :func:`check_field_types` to refuse).

    Text becomes an int, a float, a bool (``true``/``false``), ``None`` (``""``/``none``/``null``, where ``None``
    is allowed) or a ``Literal`` choice (case-insensitively) as declared; a number or path becomes text for a
    ``str`` field, an int a float for a ``float`` one, an integral float an int for an ``int`` one.
    """
    kinds = (
        typing.get_args(declared) if typing.get_origin(declared) in (Union, types.UnionType) else (declared,)
    )
    if isinstance(value, str):
        text = value.strip().lower()
        if type(None) in kinds and text in ("", "none", "null"):
            return None
        for kind in kinds:
            if typing.get_origin(kind) is Literal:
                choices = [c for c in typing.get_args(kind) if isinstance(c, str) and c.lower() == text]
                if choices:
                    return choices[0]
            elif kind is bool and text in ("true", "false"):
                return text == "true"
            elif kind in (int, float):
                try:
                    return kind(text)
                except ValueError:
                    pass
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, Path)):
        return value
    if isinstance(value, Path) or (int not in kinds and float not in kinds):
        return str(value) if str in kinds else value
    if float not in kinds:  # an int field: an integral float is that int
        return int(value) if isinstance(value, float) and value.is_integer() else value
    return value if int in kinds else float(value)
