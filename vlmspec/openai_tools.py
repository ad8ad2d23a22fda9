"""OpenAI's tool calling (``tools``, ``tool_choice``, ``parallel_tool_calls``) over structured outputs, the way
vLLM serves it.

The tools go to the chat template (``pipe(messages=..., tools=...)``), which renders them as the model was trained
to read them (Qwen2.5-VL's and Qwen3-VL's templates: Hermes-style ``<tools>`` in the system turn; a template
without tools ignores them). What the reply is depends on ``tool_choice``:

* a named function (``{"type": "function", "function": {"name": ...}}``): the reply is that function's arguments,
  decoded under its ``parameters`` schema (:mod:`vlmspec.structured`), returned as one tool call (finish reason
  ``stop``, as OpenAI gives a forced call);
* ``"required"``: the reply is a JSON array of one or more calls, each ``{"name": ..., "parameters": {...}}`` under
  one of the tools' schemas (vLLM's schema; at most one call without ``parallel_tool_calls``), returned as tool
  calls (finish reason ``tool_calls``);
* ``"auto"`` (the default with tools): free decoding; ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
  blocks in the reply (the Hermes format those templates teach, vLLM's ``hermes`` parser) become tool calls,
  the text before them the content;
* ``"none"``: free decoding, no tool calls (the tools are still rendered, as vLLM does by default).

Every reply is still the target's own: the constrained ones under their schema, the others free.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import VLMSpecError
from .structured_outputs import StructuredOutputs

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
"""A Hermes-format tool call in a reply (an unclosed last one too: the reply may end at max_tokens)."""
TOOL_CALL_START = "<tool_call>"


class ToolError(ValueError):
    """A ``tools`` / ``tool_choice`` request field that is wrong: ``field`` names it."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ToolCalling:
    """A request's tools and how the reply may call them (module docstring).

    Attributes:
        tools: the function specs, as the request gave them.
        choice: ``"none"``, ``"auto"``, ``"required"`` or the name of the function the reply calls.
        parallel: whether a reply may call several tools.
    """

    tools: tuple[dict[str, Any], ...]
    choice: str
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    @property
    def forced(self) -> bool:
        """Whether the whole reply is tool calls (a named function or ``required``)."""
        return self.choice not in ("none", "auto")

    def structure(self) -> StructuredOutputs | None:
        """The structure a forced reply decodes under (``None`` for ``auto`` and ``none``)."""
        if self.choice in ("none", "auto"):
            return None
        if self.choice != "required":
            return StructuredOutputs(json=self._parameters(self.names.index(self.choice)))
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": self._parameters(i)},
                "required": ["name", "parameters"],
            }
            for i, name in enumerate(self.names)
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return StructuredOutputs(json=array if self.parallel else {**array, "maxItems": 1})

    def calls(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The reply ``text`` as ``(content, tool calls)`` in OpenAI's shape (no calls: the text is the content)."""
        if self.choice in ("none", "auto"):
            return self._parsed(text) if self.choice == "auto" else (text, [])
        try:  # a forced reply cut short (max_tokens, a stop string) is no whole call: it stays the content
            decoded = json.loads(text)
            if self.choice != "required":
                return None, [_call(self.choice, _json(decoded))]
            return None, [_call(c["name"], _json(c["parameters"])) for c in decoded]
        except (ValueError, TypeError, KeyError):
            return text, []

    def _parsed(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """``auto``: the Hermes blocks naming one of the tools become calls; a reply with none is content."""
        calls = []
        for block in TOOL_CALL.findall(text):
            try:  # the object first, whatever follows it (a reply cut inside the closing tag)
                call = json.JSONDecoder().raw_decode(block)[0]
            except ValueError:
                continue
            if isinstance(call, dict) and call.get("name") in self.names:
                arguments = call.get("arguments", {})
                calls.append(
                    _call(call["name"], arguments if isinstance(arguments, str) else _json(arguments))
                )
        if not calls:
            return text, []
        content = text[: text.index(TOOL_CALL_START)]  # as vLLM's hermes parser leaves it
        return content or None, calls if self.parallel else calls[:1]

    def _parameters(self, index: int) -> dict[str, Any]:
        return self.tools[index]["function"].get("parameters") or {"type": "object"}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_calling(body: dict[str, Any]) -> ToolCalling | None:
    """The request's :class:`ToolCalling` (``None`` without tools).

    Raises:
        ToolError: tools that are not a list of function specs, a ``tool_choice`` that is not one of the
            choices or names no tool, a ``tool_choice`` without tools.
    """
    from .conversations import check_tools

    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise ToolError(
                f"tool_choice={choice!r:.60} needs tools: give the functions in tools", "tool_choice"
            )
        return None
    try:
        tools = check_tools(tools)
    except VLMSpecError as error:
        raise ToolError(str(error), "tools") from None
    names = [tool["function"]["name"] for tool in tools]
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        choice = function.get("name") if isinstance(function, dict) else None
        if choice not in names:
            raise ToolError(
                f"tool_choice names {choice!r:.40}, which is not one of the tools ({', '.join(names)})",
                "tool_choice",
            )
    elif choice not in (None, "none", "auto", "required"):
        raise ToolError(
            f"tool_choice={choice!r:.60} is invalid: use none, auto, required or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise ToolError(
            f"parallel_tool_calls={parallel!r:.40} is invalid: use true or false", "parallel_tool_calls"
        )
    return ToolCalling(tuple(tools), choice or "auto", parallel)


def tool_turn_keys(message: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant turn's ``tool_calls`` and a tool turn's ``tool_call_id`` (and ``name``) in OpenAI's ``messages``,
    checked, for the chat template.

    Raises:
        ToolError: a malformed one, naming the message (``where``).
    """
    kept = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if (
            message["role"] != "assistant"
            or not isinstance(calls, list)
            or not all(_is_call(c) for c in calls)
        ):
            raise ToolError(
                f'{where}: tool_calls go in assistant turns, as a list of {{"id": ..., "type": "function", '
                '"function": {"name": ..., "arguments": "<JSON text>"}}',
                "messages",
            )
        kept["tool_calls"] = [_arguments_decoded(call) for call in calls]
    if message["role"] == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise ToolError(f"{where}: a tool turn needs the tool_call_id it answers", "messages")
        kept["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            kept["name"] = message["name"]
    return kept


def _arguments_decoded(call: dict[str, Any]) -> dict[str, Any]:
    """A call whose JSON-text ``arguments`` are an object, as chat templates render them (``tojson``), as vLLM
    passes them (text that is no JSON stays as it is)."""
    arguments = call["function"].get("arguments")
    try:
        decoded = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return call
    return {**call, "function": {**call["function"], "arguments": decoded}}


def _is_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str)
