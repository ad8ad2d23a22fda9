"""A conversation as the processor inputs of one prompt: messages in transformers' chat format checked and their
media loaded (:func:`normalize_messages`), tools and template variables checked (:func:`check_tools`,
:func:`check_template_kwargs`), the chat template applied and the processor run (:func:`encode_chat`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.meta
from PIL import Image
from transformers.video_utils import VideoMetadata

from .errors import InputTypeError, InvalidInputError
from .inputs import (
    VideoClip,
    VideoInput,
    check_placeholders,
    load_image,
    load_video,
    pad_frames,
    run_processor,
)

ROLES = ("system", "user", "assistant", "tool")
KEPT_KEYS = ("tool_calls", "tool_call_id", "name", "reasoning_content")
"""Keys of a message kept for the chat template beside its role and content: an assistant turn's tool calls and
reasoning, a tool turn's call id and function name (OpenAI's chat format and Qwen3's ``reasoning_content``, which
templates that render tools and thinking read)."""
TEMPLATE_ARGUMENTS = frozenset(
    {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "tokenize"}
    | {"continue_final_message", "return_dict", "return_tensors", "padding", "truncation", "max_length"}
    | {"processor_kwargs", "tokenizer_kwargs", "return_assistant_tokens_mask"}
)
"""``apply_chat_template``'s own arguments, which ``chat_template_kwargs`` may not set (they are the call's)."""
_MEDIA_KEYS = {"image": ("image", "url", "path"), "video": ("video", "url", "path")}


def normalize_messages(
    messages: Sequence[dict], num_frames: int = 8
) -> tuple[list[dict], list[Image.Image], list[tuple[list[Image.Image], VideoMetadata]]]:
    """A conversation in transformers' chat format, checked, with its media loaded.

    Each message is ``{"role": "system" | "user" | "assistant" | "tool", "content": str | [item, ...]}`` (and
    the :data:`KEPT_KEYS` it has; an assistant turn with ``tool_calls`` may have ``None`` content); an item is
    ``{"type": "text", "text": ...}``, ``{"type": "image", "image": PIL image or path}`` or ``{"type": "video",
    "video": path or frames}`` (``"url"``/``"path"`` keys work too, for local files), in any turn and any number.
    A video item may hold ``"video_start"``/``"video_end"`` (seconds, as ``qwen_vl_utils`` reads them): only that
    window is sampled (:class:`VideoClip`).

    Returns:
        The messages with media items reduced to their placeholders (what the chat template needs), the images and
        the videos (frames, metadata) in the order they appear.

    Raises:
        ValueError, TypeError: naming the message and item that is wrong, and what is expected.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InputTypeError(
            f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    chat, images, videos = [], [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise InvalidInputError(f"{where} must be a dict with 'role' and 'content', got {message!r:.80}")
        if message["role"] not in ROLES:
            raise InvalidInputError(f"{where}: role {message['role']!r} is not one of {', '.join(ROLES)}")
        content, kept = message["content"], {key: message[key] for key in KEPT_KEYS if key in message}
        if content is None and "tool_calls" in message:
            content = ""  # a turn that only calls tools
        if isinstance(content, str):  # as given: chat templates render a plain string their own way
            chat.append({"role": message["role"], "content": content, **kept})
            continue
        if not isinstance(content, Sequence) or isinstance(content, bytes):
            raise InputTypeError(
                f"{where}: content must be a string or a list of items, got {type(content).__name__}"
            )
        items = []
        for j, item in enumerate(content):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind == "text":
                if not isinstance(item.get("text"), str):
                    raise InputTypeError(f"{where}.content[{j}]: a text item needs a string 'text'")
                items.append({"type": "text", "text": item["text"]})
                continue
            if kind not in _MEDIA_KEYS:
                raise InvalidInputError(
                    f"{where}.content[{j}]: expected an item of type 'text', 'image' or 'video', got {item!r:.80}"
                )
            source = next((item[k] for k in _MEDIA_KEYS[kind] if item.get(k) is not None), None)
            if source is None:
                raise InvalidInputError(
                    f"{where}.content[{j}]: this {kind} item has no {kind}: put it under {kind!r}"
                )
            if kind == "image":
                images.append(load_image(source))
            else:
                videos.append(
                    load_video(_video_item(item, source, f"{where}.content[{j}]"), num_frames=num_frames)
                )
            items.append({"type": kind})
        chat.append({"role": message["role"], "content": items, **kept})
    return chat, images, videos


def check_tools(tools: Any) -> list[dict] | None:
    """``tools`` (function specs for the chat template, OpenAI's shape ``{"type": "function", "function": {"name":
    ..., "parameters": {...}}}``) as a list, checked; ``None`` for none.

    Raises:
        InputTypeError: not a list of such dicts, naming the first that is not.
    """
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InputTypeError(f"tools={tools!r:.60} is invalid: use a list of function specs")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise InputTypeError(
                f'tools[{i}]={tool!r:.60} is invalid: use {{"type": "function", "function": {{...}}}}'
            )
        function = tool.get("function")
        if (
            not isinstance(function, Mapping)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise InputTypeError(f"tools[{i}].function needs a non-empty string 'name', got {function!r:.60}")
        if not isinstance(function.get("parameters", {}), Mapping):
            raise InputTypeError(
                f"tools[{i}].function.parameters={function['parameters']!r:.60} is invalid: use a JSON schema (an "
                "object)"
            )
    return [dict(tool) for tool in tools]


def _video_item(item: dict, source: VideoInput, where: str) -> VideoInput:
    """A messages video item's source, clipped to its ``video_start``/``video_end`` window when it has one."""
    start, end = item.get("video_start"), item.get("video_end")
    if start is None and end is None:
        return source
    try:
        return VideoClip(source, start, end)
    except (InvalidInputError, InputTypeError) as err:
        raise type(err)(f"{where}: {err}") from err


def check_template_kwargs(kwargs: Any) -> dict[str, Any]:
    """``chat_template_kwargs`` (variables for the chat template, e.g. Qwen3's ``{"enable_thinking": False}``) as a
    dict, checked; ``{}`` for ``None``.

    Raises:
        InputTypeError: not a dict of string keys.
        InvalidInputError: a key that is one of ``apply_chat_template``'s own arguments (:data:`TEMPLATE_ARGUMENTS`).
    """
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(key, str) for key in kwargs):
        raise InputTypeError(
            f'chat_template_kwargs={kwargs!r:.60} is invalid: use a dict of template variables ({{"enable_thinking": '
            "false}})"
        )
    if taken := sorted(TEMPLATE_ARGUMENTS.intersection(kwargs)):
        raise InvalidInputError(
            f"chat_template_kwargs sets {', '.join(taken)}, which the call sets itself (apply_chat_template's own "
            "arguments); give only the template's variables"
        )
    return dict(kwargs)


def template_variables(processor: Any) -> set[str] | None:
    """The variables ``processor``'s chat template reads (``None`` when it cannot be parsed): the only
    ``chat_template_kwargs`` passed on, as transformers and vLLM keep them (another goes nowhere)."""
    template = (
        getattr(processor, "chat_template", None) or getattr(processor, "tokenizer", processor).chat_template
    )
    template = template.get("default") if isinstance(template, Mapping) else template
    return set(variables) if (variables := _undeclared_variables(template)) is not None else None


@functools.lru_cache(maxsize=16)
def _undeclared_variables(template: Any) -> frozenset[str] | None:
    """Parsed once per template (2 ms each, for every request otherwise)."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))
    except (jinja2.TemplateError, TypeError):
        return None


def frames_as_pictures(
    chat: list[dict], images: list[Image.Image], videos: list[tuple[list[Image.Image], VideoMetadata]]
) -> tuple[list[dict], list[Image.Image]]:
    """``chat`` for a model that reads pictures only (its processor has no video processor: Gemma 3): each video
    item becomes the video's sampled frames, each a picture after a label with its time in the video::

        {"type": "video"}  ->  {"type": "text", "text": "Frame at 0.0 s:"}, {"type": "image"},
                               {"type": "text", "text": "Frame at 1.5 s:"}, {"type": "image"}, ...

    Why: such a model has no video input, and giving it a video's frames as pictures is how these models are
    shown videos (Gemma 3's own video examples do it); the label keeps what a video processor would have told the
    model, the frames' order and times (the frame's index in the file over its frame rate, as Qwen3-VL's
    timestamps are), where bare pictures would read as unrelated images.

    Args:
        chat: :func:`normalize_messages`' messages; ``images`` and ``videos`` its media in order of appearance.

    Returns:
        The messages and their pictures (the images and the videos' frames) in the order they now appear.
    """
    pictures: list[Image.Image] = []
    image_list, video_list = iter(images), iter(videos)
    converted = []
    for message in chat:
        if isinstance(message["content"], str):
            converted.append(message)
            continue
        items: list[dict] = []
        for item in message["content"]:
            if item["type"] == "video":
                frames, metadata = next(video_list)
                for frame, seconds in zip(frames, metadata.timestamps, strict=True):
                    items += [{"type": "text", "text": f"Frame at {seconds:.1f} s:"}, {"type": "image"}]
                    pictures.append(frame)
                continue
            if item["type"] == "image":
                pictures.append(next(image_list))
            items.append(item)
        converted.append({**message, "content": items})
    return converted, pictures


def encode_chat(
    processor: Any,
    chat: list[dict],
    images: list[Any],
    videos: list[tuple[Any, Any]],
    min_video_frames: int = 1,
    tools: list[dict] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Processor inputs (batch 1) of ``chat`` (:func:`normalize_messages`' messages, media, and ``tools`` and
    ``template_kwargs`` for the template, checked here: :func:`check_tools`, :func:`check_template_kwargs`): what
    ``processor.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
    add_generation_prompt=True, **template_kwargs)`` gives for the same media; videos padded to
    ``min_video_frames`` (a processor that takes no video gets them as pictures first:
    :func:`frames_as_pictures`); the processor run with ``settings`` (checked: :mod:`vlmspec.processor_settings`)."""
    tools, variables = check_tools(tools), check_template_kwargs(template_kwargs)
    used = template_variables(processor)
    variables = {name: value for name, value in variables.items() if used is None or name in used}
    try:
        text = processor.apply_chat_template(
            chat, tools=tools, add_generation_prompt=True, tokenize=False, **variables
        )
    except (jinja2.TemplateError, TypeError, ValueError) as error:
        if not variables:
            raise
        raise InvalidInputError(
            f"chat_template_kwargs={variables!r:.80} made the chat template fail: {error}"
        ) from None
    check_placeholders(processor, text, len(images), len(videos))
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    bos = getattr(processor.tokenizer, "bos_token", None)
    if bos is not None and text.startswith(bos):  # the template wrote it (Gemma's): the tokenizer adds none
        kwargs["add_special_tokens"] = False
    if images:
        kwargs["images"] = [images]  # nested per prompt: several images belong to one prompt
    if videos:
        videos = [pad_frames(frames, metadata, min_video_frames) for frames, metadata in videos]
        kwargs["videos"] = [frames for frames, _ in videos]
        kwargs["video_metadata"] = [metadata for _, metadata in videos]
        kwargs["do_sample_frames"] = False  # frames are already sampled
    return run_processor(processor, kwargs, settings)
