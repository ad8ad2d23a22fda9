"""OpenAI's chat-completions API over a pipeline: a request's JSON in, ``pipe(...)`` keyword arguments out (its media
fetched or read as it allows), and errors in OpenAI's shape (:mod:`vlmspec.openai_replies` makes the responses,
:mod:`vlmspec.serving` decodes the requests, :mod:`vlmspec.serving_http` is the HTTP server around them).

What a request may hold, and what it becomes:

* ``messages``: system (``developer`` too), user and assistant turns; content a string or a list of
  ``{"type": "text"}``, ``{"type": "image_url", "image_url": {"url": ...}}`` and ``{"type": "video_url",
  "video_url": {"url": ...}}`` parts (the last is vLLM's), in any turn: ``pipe(messages=...)``, so the reply is
  the target's own ``generate()`` on the chat template's inputs. A media URL is a ``data:image/...;base64,`` URI,
  an ``http(s)://`` URL (fetched, redirects followed, unless the server was told not to: a server others can
  reach fetches any address they name, this machine's network included, so turn it off there) or a local file (``file://...`` or a path),
  read only inside the folder the server allows (``--allowed-media-dir``; none by default).
* ``max_completion_tokens`` (or the older ``max_tokens``): ``max_new_tokens``; the server's default otherwise.
* ``temperature``: absent or 0 is greedy decoding, so the reply is the target's own greedy ``generate()`` token for
  token (vlmspec's contract; OpenAI's default is 1, which here has to be asked for); above 0 samples with
  ``top_p`` and vLLM's ``top_k`` from the target's distribution (``seed`` makes it repeatable).
* ``stop``: ``stop_strings``; as OpenAI returns it, the reply ends before the stop string (``generate()`` keeps it).
* vLLM's ``repetition_penalty`` and ``min_tokens``: ``repetition_penalty`` and ``min_new_tokens``.
* ``presence_penalty`` and ``frequency_penalty`` (-2 to 2) and ``logit_bias`` (token id -> -100 to 100): the same
  arguments of ``pipe(...)`` (:class:`~vlmspec.processors.OccurrencePenalties`).
* ``stream`` (with ``stream_options.include_usage``): server-sent chunks as each verification step accepts tokens.
* ``logprobs`` / ``top_logprobs`` (up to 20; whole replies only): each token's log-probability under the
  distribution it was chosen from (the target's own, read off the verification forwards: ``output_scores``).

* ``response_format`` (``{"type": "json_object"}``, or ``"json_schema"`` with ``{"schema": {...}}``), or vLLM's
  ``structured_outputs`` (``{"json": ...}``, ``{"regex": ...}``, ``{"choice": [...]}``, ``{"grammar": ...}``; or
  its older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``): the
  reply follows it, as the target's own under that constraint (:mod:`vlmspec.structured`).
* ``tools``, ``tool_choice`` and ``parallel_tool_calls``, and ``tool`` turns and assistant ``tool_calls`` in
  ``messages``: the chat template renders them, and the reply's tool calls are decoded and read as vLLM does
  (:mod:`vlmspec.openai_tools`).
* vLLM's ``chat_template_kwargs`` (Qwen3's ``{"enable_thinking": false}``): the chat template's variables. With a
  reasoning parser (``--reasoning-parser``), a reply's reasoning comes apart from its content (``reasoning_content``,
  and vLLM's newer ``reasoning``; vLLM's ``include_reasoning: false`` leaves it out), and an assistant turn's ``reasoning_content`` (or ``reasoning``) goes to the
  template (:mod:`vlmspec.reasoning`).
* vLLM's ``mm_processor_kwargs`` (``{"max_pixels": 401408}``): the processor's settings for this request's
  pictures and videos, over the server's (``--mm-processor-kwargs``) (:mod:`vlmspec.processor_settings`).
* ``n``: that many replies (whole replies only), decoding together; sampled ones each their own draw (``seed + i``
  with a ``seed``), a greedy one decoded once and given ``n`` times (greedy replies are all the same).

A request the pipeline refuses once its media are loaded (a picture that is not one, a token id out of the
vocabulary, a prompt longer than the context) is a 400 whose ``param`` is the field the error names
(:func:`refused_field`).

Refused by name (HTTP 400, OpenAI's error shape): the legacy ``functions`` / ``function_call``, and any field not
listed here (OpenAI refuses unknown arguments too). ``user``, ``metadata``, ``store`` and
``service_tier`` are accepted and ignored. A response carries, beside OpenAI's fields, ``vlmspec``: the
request's speculative-decoding statistics (``mean_accepted``, ``tokens_per_step``, ``steps``, ...).
"""

from __future__ import annotations

import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from .errors import VLMSpecError
from .openai_tools import ToolCalling, ToolError, tool_calling, tool_turn_keys
from .structured_outputs import StructuredOutputs

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})


class APIError(Exception):
    """A request the server refuses: its HTTP ``status`` and OpenAI's error body (:meth:`body`).

    Args:
        message: what is wrong and what to do.
        param: the request field at fault, if one is.
        status: 400 (a bad request), 401 (no or a wrong API key), 404 (an unknown model or path), 413 (too large),
            500 (the server's fault).
    """

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        kinds = {
            401: "authentication_error",
            404: "not_found_error",
            500: "server_error",
            503: "server_error",
        }
        kind = kinds.get(self.status, "invalid_request_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class MediaAccess:
    """Where the server may read media from.

    Attributes:
        allowed_dir: local files are read only inside this folder (``None``: no local file is read).
        fetch_urls: whether ``http(s)://`` URLs are fetched.
        max_bytes: the largest media file fetched.
        timeout: seconds a fetch may take in all (a server sending slowly is cut off then; a single read waits at
            most this long too).
    """

    allowed_dir: Path | None = None
    fetch_urls: bool = True
    max_bytes: int = 64 * 2**20
    timeout: float = 20.0


@dataclass
class ChatRequest:
    """A checked chat-completions request.

    Attributes:
        kwargs: the ``pipe(...)`` keyword arguments.
        stream: whether the reply is streamed.
        include_usage: a streamed reply ends with a usage chunk.
        stop: the stop strings (the reply is cut before the first).
        max_tokens: the reply's length limit.
        top_logprobs: with ``logprobs``, how many alternatives each token lists (``None``: no logprobs).
        n: how many replies (choices) to give.
        tools: the request's tools and ``tool_choice`` (``None``: no tools).
        include_reasoning: whether a thinking model's reasoning is returned (vLLM's field; default true).
        temp_files: fetched videos, to delete once the reply is done.
    """

    kwargs: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    stop: list[str] = field(default_factory=list)
    max_tokens: int = 0
    top_logprobs: int | None = None
    n: int = 1
    tools: ToolCalling | None = None
    include_reasoning: bool = True
    temp_files: list[Path] = field(default_factory=list)

    def cleanup(self) -> None:
        for path in self.temp_files:
            path.unlink(missing_ok=True)


def chat_request(
    body: Any, model: str, media: MediaAccess, default_max_tokens: int, template_kwargs: Any = None
) -> ChatRequest:
    """``body`` (a chat-completions request's JSON), checked and turned into ``pipe(...)`` arguments; the chat
    template's variables are ``template_kwargs`` (the server's defaults) under the request's own.

    Raises:
        APIError: naming the field that is wrong and what it should be (404 for another model's name).
    """
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    _check_fields(body)
    if body.get("model") not in (None, model):
        raise APIError(
            f"the model {body['model']!r} does not exist: this server serves {model!r}", "model", 404
        )
    request = ChatRequest(kwargs={})
    try:
        request.kwargs["messages"] = _messages(body.get("messages"), media, request.temp_files)
        request.max_tokens = _max_tokens(body, default_max_tokens)
        request.kwargs.update(_sampling(body), max_new_tokens=request.max_tokens)
        if request.kwargs.get("min_new_tokens", 0) > request.max_tokens:
            raise APIError(
                f"min_tokens={body['min_tokens']} is more than max_tokens={request.max_tokens}", "min_tokens"
            )
        request.stop = _stop(body.get("stop"))
        if request.stop:
            request.kwargs["stop_strings"] = request.stop
        request.stream = _flag(body, "stream")
        request.include_usage = _include_usage(body.get("stream_options"), request.stream)
        request.top_logprobs = _logprobs(body, request.stream)
        request.n = _number(body, "n", 1, MAX_CHOICES, integer=True) or 1
        if request.n > 1 and request.stream:
            raise APIError("n > 1 is served with whole replies only: leave out stream or n", "n")
        if request.top_logprobs is not None:
            request.kwargs["output_scores"] = True
        structure = _structure(body.get("response_format"), *_structured_outputs(body))
        request.tools, forced = _tools(body, structure)
        if request.tools is not None:
            request.kwargs["tools"] = list(request.tools.tools)
            structure = structure or forced
        if structure is not None:
            request.kwargs["structured_outputs"] = structure
        defaults, given = template_kwargs or {}, body.get("chat_template_kwargs")
        variables = (
            {**defaults, **given} if isinstance(given, dict) else (defaults if given is None else given)
        )
        if variables or given is not None:  # checked by the pipeline (a 400 naming chat_template_kwargs)
            request.kwargs["chat_template_kwargs"] = variables
        request.include_reasoning = body.get("include_reasoning") is None or _flag(body, "include_reasoning")
        if body.get("mm_processor_kwargs") is not None:  # checked by the pipeline (a 400 naming the field)
            request.kwargs["mm_processor_kwargs"] = body["mm_processor_kwargs"]
    except BaseException:
        request.cleanup()
        raise
    return request


_OFF_VALUES: dict[str, tuple[Any, ...]] = {"functions": (None, []), "function_call": (None, "none")}
"""Fields vlmspec does not implement, and the values that ask for nothing (OpenAI's defaults)."""
_KNOWN = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
}
_KNOWN |= {"stop", "stream", "stream_options", "repetition_penalty", "min_tokens", "logprobs", "top_logprobs"}
_KNOWN |= {"presence_penalty", "frequency_penalty", "logit_bias", "response_format", "structured_outputs"}
_KNOWN |= {"tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "include_reasoning"}
_KNOWN |= {"mm_processor_kwargs"}
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
"""vLLM's older request fields for structured outputs, and the ``structured_outputs`` field each is."""
_KNOWN |= set(GUIDED_FIELDS)
_KNOWN |= IGNORED_FIELDS | set(_OFF_VALUES)
FETCH_CHUNK = 2**16
"""The most bytes one read of a media fetch takes (it returns what has come; the time is checked between reads)."""
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16


REQUEST_FIELDS = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop_strings": "stop",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "structured_outputs": "response_format",
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "chat_template_kwargs": "chat_template_kwargs",
    "mm_processor_kwargs": "mm_processor_kwargs",
    "image": "messages",
    "video": "messages",
    "prompt": "messages",
}
"""The ``pipe(...)`` arguments a request's fields become, and those fields (an error names the argument)."""


def refused_field(error: Exception) -> str | None:
    """The request field a ``pipe(...)`` error ``error`` is about: the one whose argument its message names first
    (``None`` when it names none); what OpenAI's error body gives as ``param``."""
    message = str(error)
    found = [(message.find(name), field) for name, field in REQUEST_FIELDS.items() if name in message]
    return min(found)[1] if found else None


def _structured_outputs(body: dict[str, Any]) -> tuple[Any, str]:
    """vLLM's ``structured_outputs``, or its older ``guided_*`` fields as one, and the field it came from."""
    guided = [name for name in GUIDED_FIELDS if body.get(name) is not None]
    if not guided:
        return body.get("structured_outputs"), "structured_outputs"
    if body.get("structured_outputs") is not None or len(guided) > 1:
        raise APIError(f"give one of structured_outputs, {', '.join(GUIDED_FIELDS)}; got several", guided[-1])
    return {GUIDED_FIELDS[guided[0]]: body[guided[0]]}, guided[0]


def _structure(response_format: Any, structured_outputs: Any, field: str) -> StructuredOutputs | None:
    """OpenAI's ``response_format`` or vLLM's ``structured_outputs`` (from ``field``) as
    ``pipe(structured_outputs=...)``."""
    if response_format is not None and structured_outputs is not None:
        raise APIError(f"give response_format or {field}, not both", field)
    if structured_outputs is not None:
        try:
            return StructuredOutputs.of(structured_outputs)
        except VLMSpecError as error:
            raise APIError(str(error), field) from None
    if response_format is not None and not isinstance(response_format, dict):
        raise APIError(
            f'response_format={response_format!r:.60} is invalid: use an object such as {{"type": "json_object"}}',
            "response_format",
        )
    kind = response_format.get("type") if response_format is not None else None
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise APIError(
            f"response_format={response_format!r:.60} is invalid: its type is text, json_object or json_schema",
            "response_format",
        )
    schema = response_format.get("json_schema")
    schema = schema.get("schema") if isinstance(schema, dict) else None
    if not isinstance(schema, dict):
        raise APIError(
            'response_format of type json_schema needs "json_schema": {"name": ..., "schema": {...}}',
            "response_format",
        )
    return StructuredOutputs(json=schema)


def _tools(
    body: dict[str, Any], structure: StructuredOutputs | None
) -> tuple[ToolCalling | None, StructuredOutputs | None]:
    """The request's tools, and the structure a forced call decodes under."""
    try:
        tools = tool_calling(body)
        forced = tools.structure() if tools is not None else None
    except ToolError as error:
        raise APIError(str(error), error.field) from None
    except VLMSpecError as error:  # a tool's parameters that are no schema
        raise APIError(str(error), "tools") from None
    if forced is not None and structure is not None:
        raise APIError(
            "a tool_choice that forces a call decodes under the tool's schema: leave out response_format",
            "response_format",
        )
    return tools, forced


def _check_fields(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise APIError(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0])
    for name, off in _OFF_VALUES.items():
        if name in body and body[name] not in off:
            raise APIError(
                f"{name}={body[name]!r:.60} is not supported: vlmspec's server does not implement it", name
            )


def _messages(messages: Any, media: MediaAccess, temp_files: list[Path]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise APIError(
            'messages must be a non-empty list of {"role": ..., "content": ...} objects', "messages"
        )
    chat = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or message["role"] not in ROLES
        ):
            role = message.get("role") if isinstance(message, dict) else message
            raise APIError(f"{where}: role {role!r:.40} is not one of {', '.join(ROLES)}", "messages")
        try:
            content, kept = message.get("content"), tool_turn_keys(message, where)
        except ToolError as error:
            raise APIError(str(error), error.field) from None
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if message["role"] == "assistant" and isinstance(reasoning, str):  # for templates that render it
            kept["reasoning_content"] = reasoning
        if isinstance(content, list):
            content = [
                _part(part, f"{where}.content[{j}]", media, temp_files) for j, part in enumerate(content)
            ]
        elif content is None and "tool_calls" in kept:
            content = ""  # an assistant turn that only called tools
        elif not isinstance(content, str):
            raise APIError(f"{where}: content must be a string or a list of parts", "messages")
        chat.append({"role": ROLES[message["role"]], "content": content, **kept})
    return chat


def _part(part: Any, where: str, media: MediaAccess, temp_files: list[Path]) -> dict[str, Any]:
    """One content part as a ``pipe(messages=...)`` item."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind in ("image_url", "video_url"):
        url = part.get(kind)
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise APIError(f'{where}: a {kind} part needs {{{kind!r}: {{"url": ...}}}}', "messages")
        source = _media(url, kind[:5], f"{where}.{kind}", media, temp_files)
        return {"type": kind[:5], kind[:5]: source}
    raise APIError(
        f"{where}: expected a part of type 'text' (with a string 'text'), 'image_url' or 'video_url', got "
        f"{part!r:.80}",
        "messages",
    )


def _media(url: str, kind: str, where: str, media: MediaAccess, temp_files: list[Path]) -> Any:
    """What ``pipe(messages=...)`` reads for a media URL: a data URI as is, a fetched URL's bytes (a video's
    written to a temporary file), a checked local path."""
    if url.startswith("data:"):
        if kind == "video":
            raise APIError(f"{where}: a video cannot be a data URI here; give its URL or file", "messages")
        return url
    if url.startswith(("http://", "https://")):
        data = _fetch(url, where, media)
        if kind == "image":
            return data
        with tempfile.NamedTemporaryFile(suffix=Path(urlsplit(url).path).suffix, delete=False) as file:
            file.write(data)
        temp_files.append(Path(file.name))
        return file.name
    return str(_local_file(url, where, media))


def _fetch(url: str, where: str, media: MediaAccess) -> bytes:
    if not media.fetch_urls:
        raise APIError(f"{where}: this server does not fetch URLs; send the media as a data: URI", "messages")
    deadline = time.monotonic() + media.timeout
    data = bytearray()
    try:
        with urllib.request.urlopen(url, timeout=media.timeout) as response:
            while chunk := response.read1(min(FETCH_CHUNK, media.max_bytes + 1 - len(data))):
                data += chunk
                if len(data) > media.max_bytes:
                    raise APIError(
                        f"{where}: {url[:100]!r} is larger than {media.max_bytes} bytes", "messages", 413
                    )
                if time.monotonic() > deadline:
                    raise APIError(
                        f"{where}: {url[:100]!r} took longer than {media.timeout:g} s to fetch; send the media as a "
                        "data: URI or from a faster server",
                        "messages",
                    )
    except (urllib.error.URLError, OSError, ValueError) as err:
        raise APIError(f"{where}: {url[:100]!r} could not be fetched ({err})", "messages") from err
    return bytes(data)


def _local_file(url: str, where: str, media: MediaAccess) -> Path:
    """A ``file://`` URL or a path, inside the allowed folder."""
    path = Path(_file_path(url, where)).expanduser()
    if media.allowed_dir is None:
        raise APIError(
            f"{where}: {url[:100]!r} is a local file, and this server reads none; send it as a data: URI, or start "
            "the server with --allowed-media-dir naming the folder it may read",
            "messages",
        )
    allowed = media.allowed_dir.resolve()
    try:
        resolved = (allowed / path).resolve()
    except (ValueError, OSError) as err:  # a NUL byte, a link loop
        raise APIError(f"{where}: {url[:100]!r} is not a usable path ({err})", "messages") from err
    if not resolved.is_relative_to(allowed):
        raise APIError(
            f"{where}: {url[:100]!r} is outside the folder this server may read ({allowed})", "messages"
        )
    return resolved


def _file_path(url: str, where: str) -> str:
    """The path of a ``file://`` URL (percent-decoded; on this host only), or ``url`` as a path."""
    if not url.startswith("file:"):
        return url
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise APIError(
            f"{where}: {url[:100]!r} names another host; a file URL names a file on this one", "messages"
        )
    return unquote(parts.path)


def _number(body: dict[str, Any], name: str, low: float, high: float, integer: bool = False) -> Any:
    """``body[name]`` checked to lie in ``[low, high]`` (``None`` when absent)."""
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise APIError(f"{name}={value!r:.40} is invalid: use {kind} in [{low}, {high}]", name)
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool) and value is not None:
        raise APIError(f"{name}={value!r:.40} is invalid: use true or false", name)
    return bool(value)


def _max_tokens(body: dict[str, Any], default: int) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        value = _number(body, name, 1, 2**31 - 1, integer=True)
        if value is not None:
            return value
    return default


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling and penalty arguments: greedy unless ``temperature`` > 0 (module docstring)."""
    options: dict[str, Any] = {}
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1)
    if top_p == 0 and temperature:
        raise APIError("top_p=0 keeps no token to sample from: use a number in (0, 1]", "top_p")
    top_k = _number(body, "top_k", -1, 2**31 - 1, integer=True)
    if temperature:
        options.update(do_sample=True, temperature=float(temperature))
        if top_p is not None:
            options["top_p"] = float(top_p)
        if top_k is not None:
            options["top_k"] = top_k if top_k > 0 else None
    seed = _number(body, "seed", -(2**63), 2**63 - 1, integer=True)
    if seed is not None:
        options["seed"] = seed
    penalty = _number(body, "repetition_penalty", 1e-6, 100)
    if penalty is not None:
        options["repetition_penalty"] = float(penalty)
    min_tokens = _number(body, "min_tokens", 0, 2**31 - 1, integer=True)
    if min_tokens:
        options["min_new_tokens"] = min_tokens
    for name in ("presence_penalty", "frequency_penalty"):
        value = _number(body, name, -2, 2)
        if value:
            options[name] = float(value)
    bias = _logit_bias(body.get("logit_bias"))
    if bias:
        options["logit_bias"] = bias
    return options


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (as JSON keys, strings) to values from -100 to 100."""
    if bias is None:
        return {}
    need = "use an object of token ids to numbers from -100 to 100"
    if not isinstance(bias, dict):
        raise APIError(f"logit_bias={bias!r:.60} is invalid: {need}", "logit_bias")
    checked = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if token is None or not number or not -100 <= value <= 100:
            raise APIError(
                f"logit_bias has {key!r:.20}: {value!r:.20}, which is invalid: {need}", "logit_bias"
            )
        checked[token] = float(value)
    return checked


def _stop(stop: Any) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise APIError(f"stop={stop!r:.60} is invalid: use a string or a list of non-empty strings", "stop")
    return stops


def _include_usage(options: Any, stream: bool) -> bool:
    """``stream_options``' ``include_usage`` (OpenAI takes ``stream_options`` with ``stream`` only)."""
    if options is None:
        return False
    if not stream:
        raise APIError('stream_options is only allowed with "stream": true', "stream_options")
    if not isinstance(options, dict):
        raise APIError('stream_options must be an object such as {"include_usage": true}', "stream_options")
    return bool(options.get("include_usage"))


def _logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """``top_logprobs`` when ``logprobs`` is asked for (0 without it), else ``None``."""
    top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if not _flag(body, "logprobs"):
        if top:
            raise APIError('top_logprobs needs "logprobs": true', "top_logprobs")
        return None
    if stream:
        raise APIError(
            "logprobs are returned with whole replies only: leave out stream or logprobs", "logprobs"
        )
    return top or 0
