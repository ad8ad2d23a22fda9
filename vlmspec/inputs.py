"""Loading user images and videos, with errors that name the bad input."""

from __future__ import annotations

import base64
import binascii
import io
import math
import numbers
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from huggingface_hub.errors import StrictDataclassError
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import InputNotFoundError, InputTypeError, InvalidInputError
from .validation import did_you_mean

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers.video_utils import VideoMetadata

ImageInput = Image.Image | str | Path | bytes | bytearray | memoryview


@dataclass(frozen=True)
class VideoClip:
    """A time window of a video: frames are sampled from ``start`` to ``end`` seconds only.

    The window is what ``qwen_vl_utils``' ``video_start``/``video_end`` and lmms-eval's ``start_time``/``end_time``
    mean: seconds from the start of the file (or of a list of frames taken at ``fps``), both ends included.
    ``None`` leaves that end open. The window holds frames ``ceil(start * fps)`` to ``floor(end * fps)``, as
    qwen-vl-utils computes them (with a tolerance of a millionth of a frame for float rounding, so at fractional
    frame rates a bound can land one frame off qwen-vl-utils' own). The sampled frames keep their indices in the
    whole video, so time-aware processors (Qwen3-VL's timestamps) see where in the video the clip lies.

    Attributes:
        source: a video file path or a list of frames (PIL images or ``HxWx3`` arrays).
        start: first second of the window (``>= 0``; ``None``: the start of the video).
        end: last second of the window (``> start``; ``None``: the end of the video).

    Raises:
        TypeError: a bound that is not a number.
        ValueError: a negative or non-finite bound, or ``end <= start``.
    """

    source: str | Path | Sequence[Image.Image | np.ndarray]
    start: float | None = None
    end: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.source, VideoClip):
            raise InvalidInputError(
                f"VideoClip source is already a VideoClip ({self.source.start}s to {self.source.end}s); give the "
                "window once, on the video itself"
            )
        for name in ("start", "end"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputTypeError(f"VideoClip {name}={value!r} must be a number of seconds or None")
            if not math.isfinite(value) or value < 0:
                raise InvalidInputError(f"VideoClip {name}={value!r} is invalid: use seconds >= 0")
        if self.start is not None and self.end is not None and self.end <= self.start:
            raise InvalidInputError(
                f"VideoClip end={self.end!r} must come after start={self.start!r} (seconds from the video's start)"
            )

    def frame_window(self, total: int, fps: float, what: str) -> tuple[int, int]:
        """The first and last frame index (inclusive) of the window in a video of ``total`` frames at ``fps``.

        Raises:
            ValueError: the window holds no frame of the video (``what`` names it in the message).
        """
        first = 0 if self.start is None else math.ceil(self.start * fps - 1e-6)
        last = total - 1 if self.end is None else min(math.floor(self.end * fps + 1e-6), total - 1)
        if first > last:
            start = "the start" if self.start is None else f"{self.start:g}s"
            end = "the end" if self.end is None else f"{self.end:g}s"
            where = (
                "inside the video" if first >= total else f"at least one frame interval ({1 / fps:.3g}s) long"
            )
            raise InvalidInputError(
                f"{what}: the clip from {start} to {end} holds no frame of a video of {total} frames at {fps:g} fps "
                f"({total / fps:.2f}s); choose a window {where}"
            )
        return first, last


VideoInput = str | Path | Sequence[Image.Image | np.ndarray] | VideoClip


def load_image(image: ImageInput) -> Image.Image:
    """A PIL RGB image from a PIL image, a file path, a ``data:image/...;base64,`` URI or an image file's bytes,
    converted as transformers converts them: a PIL image as its image processors do (transparency composited
    onto white), a file as its ``load_image`` reads paths for chat templates and pipelines (EXIF orientation
    applied, then RGB).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the path is empty or a directory; the file (or the bytes) is not a readable image.
        TypeError: none of those.
    """
    if isinstance(image, Image.Image):
        return rgb_image(image)
    if isinstance(image, (bytes, bytearray, memoryview)):  # a file's content, as read from disk or a request
        data = bytes(image)
        return _open_image(
            io.BytesIO(data),
            f"image bytes ({len(data)} bytes, starting {data[:8]!r}) are not a readable image file; "
            "pass the whole content of a PNG/JPEG/... file, a file path or a PIL image",
        )
    if isinstance(image, str) and image.startswith("data:"):
        return _open_image(io.BytesIO(_data_uri(image)), f"image data URI {image[:40]!r}... is not an image")
    if isinstance(image, (str, Path)):
        path = _media_file(image, "image", "a PIL image")
        return _open_image(
            path,
            f"image file {str(path)!r} could not be read as an image; check that it is a valid PNG/JPEG/... file",
        )
    raise InputTypeError(
        f"image must be a PIL image, a file path or an image file's bytes, got {type(image).__name__}"
    )


def rgb_image(image: Image.Image) -> Image.Image:
    """``image`` in RGB as transformers' image processors convert it (``convert_to_rgb``): transparency (an alpha
    band, or a palette's transparent colour) composited onto white, not dropped."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def _data_uri(uri: str) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URI (what transformers' ``load_image`` takes besides paths)."""
    head, _, body = uri.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise InvalidInputError(
            f"image {uri[:40]!r}... is a data URI vlmspec cannot read: use data:image/<type>;base64,<data>, a file "
            "path or a PIL image"
        )
    try:
        return base64.decodebytes(body.encode())  # as transformers' load_image: line breaks allowed
    except (binascii.Error, UnicodeEncodeError) as err:
        raise InvalidInputError(f"image data URI {uri[:40]!r}... holds no valid base64 ({err})") from err


_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://")


def _media_file(source: str | Path, kind: str, instead: str) -> Path:
    """``source`` as the path of an existing ``kind`` (image/video) file.

    Raises:
        InvalidInputError: it is a directory. InputNotFoundError: it does not exist.
    """
    path, a = Path(source), "an" if kind[0] in "aeiou" else "a"
    if not str(source).strip():
        raise InvalidInputError(f"{kind} path is an empty string; pass {a} {kind} file's path (or {instead})")
    if isinstance(source, str) and _URL.match(source):
        raise InvalidInputError(
            f"{kind} {source!r} is a URL: vlmspec reads local files only (no downloads); fetch it first and pass "
            f"the file's path (or {instead})"
        )
    if path.is_dir():
        raise InvalidInputError(
            f"{kind} path {str(path)!r} is a directory, not {a} {kind} file; pass {a} {kind} file's path (or {instead})"
        )
    if not path.is_file():
        raise InputNotFoundError(
            f"{kind} file {str(path)!r} does not exist; pass an existing {kind} path or {instead}"
        )
    return path


def _open_image(source: Any, refusal: str) -> Image.Image:
    """``source`` (a path or a file object) opened as transformers' ``load_image`` opens a file: EXIF orientation
    applied, then RGB; ``refusal`` (and why) when it is not an image."""
    try:
        with Image.open(source) as im:
            return ImageOps.exif_transpose(im).convert("RGB")
    except Image.DecompressionBombError as err:
        raise InvalidInputError(
            f"{refusal}: {err}; downscale it, or raise PIL.Image.MAX_IMAGE_PIXELS if you trust the file"
        ) from err
    except (UnidentifiedImageError, OSError) as err:
        raise InvalidInputError(f"{refusal} ({err})") from err


def load_images(images: ImageInput | Sequence[ImageInput] | None) -> list[Image.Image]:
    """Zero, one or several images as a list of PIL images."""
    if images is None:
        return []
    if isinstance(images, (Image.Image, str, Path, bytes, bytearray, memoryview)):
        return [load_image(images)]
    if not isinstance(images, Sequence):
        raise InputTypeError(
            f"image must be a PIL image, a file path, an image file's bytes or a list of them, got "
            f"{type(images).__name__}"
        )
    return [load_image(im) for im in images]


DEFAULT_FRAME_FPS = 2.0


def check_num_frames(num_frames: Any) -> int:
    """``num_frames`` if it is an integer >= 1.

    Raises:
        InvalidInputError: anything else, named.
    """
    if not isinstance(num_frames, numbers.Integral) or isinstance(num_frames, bool) or num_frames < 1:
        raise InvalidInputError(
            f"num_frames={num_frames!r} is invalid: use an integer >= 1 (the frames sampled evenly from a video file)"
        )
    return int(num_frames)


def pad_frames(frames: list[Any], metadata: VideoMetadata, least: int) -> tuple[list[Any], VideoMetadata]:
    """A video of fewer than ``least`` frames (the family's minimum) with its last frame repeated up to it, as
    Qwen2-VL's video processor pads a short video itself (Qwen3-VL's refuses one); the repeats keep the last
    frame's index, so time-aware processors give them its timestamp."""
    missing = least - len(frames)
    if missing <= 0:
        return frames, metadata
    indices = list(metadata.frames_indices or range(len(frames)))
    padded = replace(metadata, frames_indices=indices + [indices[-1]] * missing)
    return list(frames) + [frames[-1]] * missing, padded


def load_video(
    video: VideoInput, num_frames: int = 8, fps: float = DEFAULT_FRAME_FPS
) -> tuple[list[Image.Image], VideoMetadata]:
    """Frames of a video and their timing: a file (``num_frames`` sampled evenly with decord) or a list of frames.

    The metadata (source fps and the indices of the sampled frames) is what time-aware processors (Qwen3-VL's
    frame timestamps) need. A list of frames is taken as consecutive frames at ``fps`` frames per second
    (default 2, the sampling rate Qwen2-VL's reference pipeline uses), since a list carries no timing. A
    :class:`VideoClip` samples ``num_frames`` evenly within its window of the file's frames (a list of frames:
    every frame of the window).

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the path is a directory, the file cannot be decoded, holds no frames, ``num_frames`` < 1, or a
            clip's window holds no frame.
    """
    from transformers.video_utils import VideoMetadata

    check_num_frames(num_frames)
    clip = video if isinstance(video, VideoClip) else VideoClip(video)
    video = clip.source
    if isinstance(video, (str, Path)):
        path = _media_file(video, "video", "a list of frames")
        if path.stat().st_size == 0:
            raise InvalidInputError(f"video file {str(path)!r} is empty (0 bytes)")
        from decord import DECORDError, VideoReader  # imported lazily: heavy native library

        try:
            reader = VideoReader(str(path))
            total = len(reader)
            if total == 0:
                raise InvalidInputError(f"video file {str(path)!r} holds no frames")
            source_fps = float(reader.get_avg_fps())
            first, last = clip.frame_window(total, source_fps, f"video file {str(path)!r}")
            index = np.linspace(first, last, num=min(num_frames, last - first + 1)).round().astype(int)
            array = reader.get_batch(list(index)).asnumpy()  # [F, H, W, 3] uint8
        except (DECORDError, RuntimeError) as err:  # decord raises RuntimeError for unreadable containers
            raise undecodable_video(path, err) from err
        # total_num_frames: the window's, as qwen_vl_utils counts a clip (Qwen2.5-VL's time spacing derives from it)
        metadata = VideoMetadata(
            total_num_frames=last - first + 1, fps=source_fps, frames_indices=[int(i) for i in index]
        )
        return [Image.fromarray(frame) for frame in array], metadata
    _check_one_video(video)
    frames = [frame_image(i, frame) for i, frame in enumerate(video)]
    if not frames:
        raise InvalidInputError("video is an empty list of frames; pass at least one frame")
    sizes = {frame.size for frame in frames}
    if len(sizes) > 1:
        odd = next(i for i, frame in enumerate(frames) if frame.size != frames[0].size)
        raise InvalidInputError(
            f"video frame {odd} is {frames[odd].size[0]}x{frames[odd].size[1]} but frame 0 is "
            f"{frames[0].size[0]}x{frames[0].size[1]}; the frames of one video must share a size (resize them first)"
        )
    first, last = clip.frame_window(len(frames), fps, f"video of {len(frames)} frames")
    frames = frames[first : last + 1]
    return frames, VideoMetadata(
        total_num_frames=len(frames), fps=fps, frames_indices=list(range(first, last + 1))
    )


def _check_one_video(video: Any) -> None:
    """Refuse what is not one video's frames: file bytes, several videos, something else."""
    if isinstance(video, (bytes, bytearray, memoryview)):
        raise InputTypeError(
            "video must be a file path, a VideoClip or a list of frames; a video file's bytes are not read: write "
            "them to a file and pass its path"
        )
    if not isinstance(video, Sequence):
        raise InputTypeError(f"video must be a file path or a list of frames, got {type(video).__name__}")
    if len(video) and isinstance(video[0], (str, Path, VideoClip)):
        raise InvalidInputError(
            f"video takes one video (a file path or a list of frames), got a list of {len(video)} "
            f"{type(video[0]).__name__} items; for several videos use messages=[...] with one "
            '{"type": "video", "video": ...} item each'
        )


def frame_image(index: int, frame: Image.Image | np.ndarray) -> Image.Image:
    """One video frame as an RGB PIL image.

    An ``HxWx3`` array is read by its dtype: ``uint8`` as is; floats as intensities in ``[0, 1]`` (scaled by 255
    and rounded, the convention of torchvision's ``ToTensor`` and matplotlib); other integers when every value is
    in ``[0, 255]``. Anything else is refused with its dtype and range: a cast would wrap or blacken the frame.

    Raises:
        TypeError: neither a PIL image nor an ``HxWx3`` array.
        ValueError: values outside the range its dtype allows (NaN included).
    """
    if isinstance(frame, Image.Image):
        return rgb_image(frame)
    if not (isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[-1] == 3):
        shape = f" of shape {frame.shape}" if isinstance(frame, np.ndarray) else ""
        raise InputTypeError(
            f"video frame {index} must be a PIL image or an HxWx3 array, got {type(frame).__name__}{shape}"
        )
    if frame.dtype == np.uint8:
        return Image.fromarray(frame)
    if frame.size == 0:
        raise InvalidInputError(f"video frame {index} is empty (shape {frame.shape})")
    low, high = (float(frame.min()), float(frame.max())) if frame.dtype != np.bool_ else (0.0, 1.0)
    if np.issubdtype(frame.dtype, np.floating):
        if not (np.isfinite(frame).all() and low >= 0.0 and high <= 1.0):
            raise InvalidInputError(
                f"video frame {index} is a {frame.dtype} array with values in [{low:g}, {high:g}]; float frames "
                "must hold intensities in [0, 1] (or pass uint8 arrays in [0, 255])"
            )
        return Image.fromarray(np.rint(frame * 255.0).astype(np.uint8))
    if np.issubdtype(frame.dtype, np.integer) and low >= 0 and high <= 255:
        return Image.fromarray(frame.astype(np.uint8))
    raise InvalidInputError(
        f"video frame {index} is a {frame.dtype} array with values in [{low:g}, {high:g}]; pass uint8 arrays in "
        "[0, 255] or float arrays in [0, 1]"
    )


IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tiff", ".tif", ".webp"})
"""File extensions of pictures (a video file named so is one given in the wrong place)."""
_DECORD_LOG_PREFIX = re.compile(r"\[\d\d:\d\d:\d\d\] \S+:\d+: (\[[^\]]*\] )?")


def undecodable_video(path: str | Path, error: Exception) -> InvalidInputError:
    """The error for a video file decord cannot read: its reason, without decord's log prefix (a time of day and
    a source path of decord's build, which would make two runs' error lines differ)."""
    if Path(path).suffix.lower() in IMAGE_SUFFIXES:
        return InvalidInputError(f"video file {str(path)!r} is a picture: pass it as an image (image=...)")
    reason = _DECORD_LOG_PREFIX.sub("", str(error)).strip()
    return InvalidInputError(
        f"video file {str(path)!r} could not be decoded ({reason}); check that it is a valid video"
    )


def run_processor(processor: Any, kwargs: dict[str, Any], settings: Mapping[str, Any] | None = None) -> Any:
    """``processor(**kwargs)`` for one prompt (text, images, videos, ...), a refusal of its media named as one.

    Raises:
        InvalidInputError: the processor refused the images or videos (an aspect ratio beyond what the image
            processor takes; videos of different lengths where it stacks a prompt's videos into one tensor, as
            LLaVA-OneVision's does), or failed under the request's processor ``settings`` (named with them).
    """
    try:
        return processor(**kwargs, **(settings or {}))
    except (ValueError, TypeError, ArithmeticError, KeyError, RuntimeError, StrictDataclassError) as err:
        if settings and _runs(processor, kwargs):  # the settings' fault, not the media's
            raise InvalidInputError(
                f"the target's processor failed under mm_processor_kwargs={dict(settings)!r:.120}: "
                f"{type(err).__name__}: {err}; check the settings' values"
            ) from err
        if not isinstance(err, ValueError):
            raise
        lengths = sorted({len(frames) for frames in kwargs.get("videos", [])})
        if len(lengths) > 1:
            raise InvalidInputError(
                f"the target's processor refused this prompt's videos, of {' and '.join(map(str, lengths))} frames: "
                "it takes a prompt's videos only with the same number of frames each (the same num_frames, each "
                f"video long enough) ({err})"
            ) from err
        raise InvalidInputError(
            f"the target's processor refused this request's images or videos: {err}; check their sizes, aspect "
            "ratios and frame counts"
        ) from err


def _runs(processor: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``processor(**kwargs)`` runs (a failure of the same call under settings is then theirs)."""
    try:
        processor(**kwargs)
    except (ValueError, TypeError, ArithmeticError, KeyError, RuntimeError, StrictDataclassError):
        return False
    return True


def on_device(inputs: Mapping[str, Any], device: torch.device | str) -> dict[str, Any]:
    """Processor outputs with their tensors moved to ``device`` (the rest as they are)."""
    import torch

    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}


def check_prompt_inputs(
    inputs: Mapping[str, Any], vocab_size: int | None = None, taken: Collection[str] | None = None
) -> dict[str, Any]:
    """One prompt's processor outputs (``pipe(inputs=...)``), checked: an ``input_ids`` tensor ``[1, L]`` of token
    ids (below ``vocab_size`` when given) with no padding, and no key the model does not take (``taken``, as
    ``generate()`` refuses unused ``model_kwargs``; not checked when ``None``); ``None`` values dropped.

    Raises:
        TypeError: not a mapping with an ``input_ids`` tensor.
        ValueError: several prompts, an empty one, ids that are not token ids, padding, or a key not taken.
    """
    import torch

    if not isinstance(inputs, Mapping) or not torch.is_tensor(inputs.get("input_ids")):
        raise InputTypeError(
            "inputs must be a processor's outputs for one prompt, with an input_ids tensor, e.g. "
            "processor(text=[text], images=[image], return_tensors='pt')"
        )
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise InvalidInputError(
            f"inputs['input_ids'] has shape {tuple(ids.shape)}; give one prompt, [1, L] with L >= 1 (for several "
            'prompts, pipe.generate(**inputs) or pipe.batch([{"inputs": ...}, ...]) with one request per prompt)'
        )
    check_token_ids(ids, vocab_size, "inputs['input_ids']")
    if mask is not None and not bool(mask.bool().all()):
        raise InvalidInputError(
            "inputs['attention_mask'] masks some prompt tokens (padding); give one unpadded prompt per request, "
            "or the padded batch to pipe.generate(**inputs)"
        )
    given = {k: v for k, v in inputs.items() if v is not None}
    unknown = sorted(set(given) - set(taken)) if taken is not None else []
    if unknown:
        hint = did_you_mean(unknown[0], sorted(taken)) if len(unknown) == 1 else ""
        raise InvalidInputError(
            f"inputs has {', '.join(map(repr, unknown))}, which the target model does not take{hint}; give the "
            "processor's outputs as it returns them (input_ids, attention_mask, pixel_values, image_grid_thw, ...)"
        )
    return given


def check_token_ids(ids: torch.Tensor, vocab_size: int | None, name: str = "input_ids") -> None:
    """Refuse a tensor of prompt ids that are not token ids: not integers, or outside ``[0, vocab_size)`` (the
    models' embedding rows; not checked when ``None``).

    Raises:
        ValueError: naming the tensor (``name``), its dtype or the ids out of range, and what to do.
    """
    import torch

    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise InvalidInputError(
            f"{name} is a {str(ids.dtype).removeprefix('torch.')} tensor; token ids are integers (torch.long), as "
            "the processor returns them: build the inputs with the processor (or tokenizer), or convert with .long()"
        )
    if vocab_size is None or ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise InvalidInputError(
            f"{name} holds ids in [{low}, {high}], outside the models' vocabulary [0, {vocab_size}); build the "
            "inputs with this pipeline's processor (pipe.processor), whose tokenizer is the models'"
        )


def check_placeholders(processor: Any, text: str, images: int, videos: int) -> None:
    """The chat template writes one placeholder per image and video; more in the prompt came from its text (a
    habit from LLaVA's ``"<image>\\n..."`` prompts), which the processor would pair with media that do not exist."""
    for kind, count in (("image", images), ("video", videos)):
        token = getattr(processor, f"{kind}_token", None)
        found = text.count(token) if isinstance(token, str) and token else count
        if found > count:
            raise InvalidInputError(
                f"the prompt's text holds the model's {kind} placeholder {token!r} ({found - count} more than the "
                f"{count} {kind}(s) given): the pipeline places one per {kind} itself; remove it from the text"
            )
