"""What lmms-eval requests carry, turned into what :class:`vlmspec.VLMSpecPipeline` takes.

Both request forms become the pipeline's ``messages`` (media inside, any number of images and videos). Simple
requests carry ``doc_to_visual(doc)``, a list of visuals, beside the context (:func:`simple_messages`); chat
requests carry ``doc_to_messages(doc)``: lmms-eval ``ChatMessages`` with image/video/text parts
(:func:`chat_messages`).

Visuals understood (simple path, and the ``url`` of chat image/video parts):

* a PIL image, or an ``HxWx3`` array: an image;
* a path (``str``/``Path``): an image or a video by its extension (:data:`IMAGE_EXTS` / :data:`VIDEO_EXTS`);
* a list/tuple of PIL images or ``HxWx3`` arrays, or an ``FxHxWx3`` array: a video given as frames;
* a dict ``{"type": "image"|"video", "url"|"path"|"image"|"video"|"frames": ...}``; a video dict's
  ``video_start``/``video_end`` (or ``start_time``/``end_time``) seconds clip it (:class:`vlmspec.VideoClip`),
  as do a chat video part's ``start_time``/``end_time``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from vlmspec.inputs import IMAGE_SUFFIXES, VideoClip

__all__ = ["IMAGE_EXTS", "VIDEO_EXTS", "chat_messages", "classify", "simple_messages", "strip_placeholders"]

IMAGE_EXTS = IMAGE_SUFFIXES
VIDEO_EXTS = frozenset({".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".flv", ".mpg", ".mpeg", ".wmv"})
_PLACEHOLDER = r"(?:<image>|<video>|<image_\d+>)"
_PLACEHOLDER_AND_SPACE = re.compile(_PLACEHOLDER + r"\s*")
_TRAILING_PLACEHOLDER = re.compile(_PLACEHOLDER + r"\s*$")


def classify(visual: Any) -> tuple[str, Any]:
    """``("image" | "video", value)`` for one visual (see the module docstring).

    Raises:
        ValueError: a path with an unknown extension.
        TypeError: a kind of visual vlmspec does not take (audio, ...).
    """
    if isinstance(visual, Image.Image):
        return "image", visual
    if isinstance(visual, np.ndarray):
        return _classify_array(visual)
    if isinstance(visual, (str, Path)):
        return _classify_path(visual)
    if isinstance(visual, dict):
        return _classify_dict(visual)
    if isinstance(visual, (list, tuple)) and visual and all(_is_frame(f) for f in visual):
        return "video", list(visual)
    raise TypeError(
        f"unsupported visual of type {type(visual).__name__}; vlmspec takes PIL images, image/video paths, "
        "lists of frames, or {'type': 'image'|'video', 'url': ...} dicts (audio is not supported)"
    )


def _is_frame(value: Any) -> bool:
    return isinstance(value, Image.Image) or (isinstance(value, np.ndarray) and value.ndim == 3)


def _classify_array(array: np.ndarray) -> tuple[str, Any]:
    if array.ndim == 3:
        return "image", Image.fromarray(array.astype(np.uint8))
    if array.ndim == 4:
        return "video", [frame for frame in array]
    raise TypeError(
        f"unsupported visual array of shape {array.shape}; expected HxWx3 (image) or FxHxWx3 (video)"
    )


def _classify_path(path: str | Path) -> tuple[str, Any]:
    suffix = Path(str(path)).suffix.lower()
    if suffix in IMAGE_EXTS:
        return "image", str(path)
    if suffix in VIDEO_EXTS:
        return "video", str(path)
    raise ValueError(
        f"visual path {str(path)!r} has an extension vlmspec does not know ({suffix or 'none'}); images: "
        f"{', '.join(sorted(IMAGE_EXTS))}; videos: {', '.join(sorted(VIDEO_EXTS))}"
    )


def _classify_dict(visual: dict[str, Any]) -> tuple[str, Any]:
    kind, value = _dict_source(visual)
    start = next((visual[k] for k in ("video_start", "start_time") if visual.get(k) is not None), None)
    end = next((visual[k] for k in ("video_end", "end_time") if visual.get(k) is not None), None)
    if start is None and end is None:
        return kind, value
    if kind != "video":
        raise ValueError(f"visual dict clips ({start}s to {end}s) an image, not a video: {visual!r:.80}")
    return "video", VideoClip(value, start, end)


def _dict_source(visual: dict[str, Any]) -> tuple[str, Any]:
    for key in ("url", "path", "frames", "video", "image"):
        if visual.get(key) is not None:
            kind, value = classify(visual[key])
            declared = visual.get("type")
            if (
                declared in ("image", "video")
                and declared != kind
                and not (declared == "video" and key == "frames")
            ):
                raise ValueError(
                    f"visual dict says type={declared!r} but holds a {kind}: {visual[key]!r:.80}"
                )
            return kind, value
    if "array" in visual and "sampling_rate" in visual:  # lmms-eval's audio (datasets' Audio feature)
        raise NotImplementedError(
            "audio inputs are not supported by the vlmspec model (a vision-language model)"
        )
    raise TypeError(f"visual dict {sorted(visual)} has none of the keys url, path, frames, video, image")


def simple_messages(context: str, visuals: Sequence[Any] | Any | None) -> list[dict[str, Any]]:
    """The pipeline's ``messages`` for a simple request: ``doc_to_visual(doc)``'s images in order, then its videos,
    then the context without placeholders (media first, as lmms-eval's simple models lay a prompt out).

    Each element of ``visuals`` is one visual: a video given as frames is one element holding the list of frames
    (``[frames]``); a flat list of PIL images is that many images.

    Raises:
        ValueError, TypeError: a visual vlmspec cannot take (the message names it).
    """
    if visuals is None:
        visuals = []
    elif not isinstance(visuals, (list, tuple)):
        visuals = [visuals]
    found = [classify(visual) for visual in visuals if visual is not None]
    content = [{"type": kind, kind: value} for kind, value in found if kind == "image"]
    content += [{"type": kind, kind: value} for kind, value in found if kind == "video"]
    content.append({"type": "text", "text": strip_placeholders(context)})
    return [{"role": "user", "content": content}]


def strip_placeholders(context: str) -> str:
    """The prompt text without lmms-eval's ``<image>``/``<video>`` placeholders (media go first, as the pipeline
    lays them out): each placeholder goes with the whitespace after it, and the text's end is trimmed where a
    placeholder ended it; the rest stays as the task wrote it, as on the chat path."""
    stripped = _PLACEHOLDER_AND_SPACE.sub("", context)
    return stripped.rstrip() if _TRAILING_PLACEHOLDER.search(context) else stripped


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """The pipeline's ``messages`` (transformers' chat format, media inside) from lmms-eval ``ChatMessages``.

    Args:
        messages: a ``lmms_eval.protocol.ChatMessages`` (or anything with ``.messages`` of role/content parts).

    Returns:
        ``[{"role": ..., "content": [...]}]`` with ``{"type": "text", "text": ...}``, ``{"type": "image", "image":
        ...}`` and ``{"type": "video", "video": ...}`` items, in the task's order (any number of images and videos).

    Raises:
        NotImplementedError: audio parts.
    """
    return [
        {"role": message.role, "content": [_chat_part(part) for part in message.content]}
        for message in messages.messages
    ]


def _chat_part(part: Any) -> dict[str, Any]:
    if part.type == "text":
        return {"type": "text", "text": part.text}
    if part.type == "audio":
        raise NotImplementedError("audio inputs are not supported by the vlmspec model")
    kind, value = classify(part.url)
    if part.type == "video" and kind == "image" and isinstance(value, Image.Image):
        kind, value = "video", [value]  # a one-frame clip
    start, end = getattr(part, "start_time", None), getattr(part, "end_time", None)
    if part.type == "video" and (start is not None or end is not None):
        value = VideoClip(value, start, end)
    return {"type": kind, kind: value}
