"""What a reply must follow (:class:`StructuredOutputs`, vLLM's ``StructuredOutputsParams``): the request's side of
structured outputs, checked when it is made. Compiling it and masking the tree's logits is :mod:`vlmspec.structured`'s
work; this module imports neither torch nor xgrammar, so a job's config and the command line check it at once."""

from __future__ import annotations

import json as json_module
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .errors import InputTypeError, InvalidInputError
from .validation import did_you_mean

KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The ways to give a structure; a request gives exactly one."""


@dataclass(frozen=True)
class StructuredOutputs:
    """What a reply must follow (vLLM's ``StructuredOutputsParams``); exactly one of the first five is set.

    Attributes:
        json: a JSON schema, as a dict or as JSON text.
        regex: a regular expression the whole reply matches.
        choice: the reply is one of these strings.
        grammar: an EBNF grammar (xgrammar's / llama.cpp's GBNF dialect; the rule ``root`` is the reply).
        json_object: any JSON object (OpenAI's ``{"type": "json_object"}``).
        disable_any_whitespace: JSON without free whitespace (module docstring).
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidInputError(
                f"structured_outputs sets {' and '.join(given) or 'nothing'}: set exactly one of "
                f"{', '.join(KINDS)}"
            )
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise InputTypeError(
                    f"structured_outputs.{name}={getattr(self, name)!r:.40} is invalid: use True/False"
                )
        kind, value = given[0], getattr(self, given[0])
        if self.disable_any_whitespace and kind not in ("json", "json_object"):
            raise InvalidInputError(
                f"structured_outputs.disable_any_whitespace is for json and json_object, not {kind}: leave it out"
            )
        if kind == "json":
            object.__setattr__(self, "json", _schema_text(value))
        elif kind == "choice":
            object.__setattr__(self, "choice", _choices(value))
        elif kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise InputTypeError(
                f"structured_outputs.{kind}={value!r:.60} is invalid: use a non-empty string"
            )

    @classmethod
    def of(cls, value: Any) -> StructuredOutputs | None:
        """``value`` as a :class:`StructuredOutputs`: one already, a dict of its fields, or ``None``.

        Raises:
            InputTypeError: another type, or a dict key that is not a field (named with the nearest one).
        """
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise InputTypeError(
                f"structured_outputs={value!r:.60} is invalid: use a StructuredOutputs or a dict such as "
                '{"json": schema}, {"regex": "..."} or {"choice": ["yes", "no"]}'
            )
        names = [f.name for f in fields(cls)]
        unknown = [key for key in value if key not in names]
        if unknown:
            raise InputTypeError(
                f"structured_outputs has no field {unknown[0]!r:.40}: it takes {', '.join(names)}"
                f"{did_you_mean(str(unknown[0]), names)}"
            )
        return cls(**value)

    @property
    def kind(self) -> str:
        """The one of :data:`KINDS` that is set."""
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))


def _schema_text(schema: Any) -> str:
    """A JSON schema (a dict or JSON text) as JSON text, checked to be a JSON object."""
    if isinstance(schema, str):
        try:
            parsed = json_module.loads(schema)
        except ValueError as error:
            raise InvalidInputError(
                f"structured_outputs.json is not JSON text ({error}): give a JSON schema"
            ) from None
    else:
        parsed = schema
    if not isinstance(parsed, Mapping):
        raise InputTypeError(
            f"structured_outputs.json={schema!r:.60} is invalid: use a JSON schema (a dict, or its JSON text)"
        )
    try:  # the properties keep their order: a reply lists them in it
        return json_module.dumps(parsed)
    except (TypeError, ValueError) as error:
        raise InputTypeError(f"structured_outputs.json cannot be written as JSON: {error}") from None


def _choices(choice: Any) -> tuple[str, ...]:
    if isinstance(choice, (str, bytes)) or not isinstance(choice, Sequence) or not choice:
        raise InputTypeError(
            f"structured_outputs.choice={choice!r:.60} is invalid: use a non-empty list of strings"
        )
    bad = [c for c in choice if not isinstance(c, str) or not c]
    if bad:
        raise InputTypeError(
            f"structured_outputs.choice holds {bad[0]!r:.40}: every choice is a non-empty string"
        )
    return tuple(choice)
