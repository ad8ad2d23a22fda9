"""What to caption: folders, globs and manifests as :class:`VideoItem` lists, and the frames of each video."""

from __future__ import annotations

import csv
import glob
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from vlmspec import VideoClip, VLMSpecError
from vlmspec.inputs import undecodable_video

from .config import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, JobConfig, JobError, json_object


@dataclass(frozen=True)
class VideoItem:
    """One video (or picture: :attr:`is_image`) to caption.

    Attributes:
        id: unique, stable id (what resuming keys on).
        path: the video file.
        prompt: the item's own prompt (``None``: the job's).
        start, end: the time window to caption, in seconds (``None``: from the start / to the end of the file);
            a manifest's ``start``/``end`` columns, so one file can be captioned segment by segment.
        problem: why the item cannot be captioned, found before its turn (its caption attempt fails with it, so
            it gets an error line and the job goes on).
    """

    id: str
    path: str
    prompt: str | None = None
    start: float | None = None
    end: float | None = None
    problem: str | None = None

    @property
    def window(self) -> dict[str, float]:
        """``{"start": ..., "end": ...}`` for the bounds that are set (empty for a whole video)."""
        return {k: v for k, v in (("start", self.start), ("end", self.end)) if v is not None}

    @property
    def is_image(self) -> bool:
        """The file is a picture (its extension is one of :data:`IMAGE_EXTENSIONS`): captioned as an image."""
        return Path(self.path).suffix.lower() in IMAGE_EXTENSIONS


def discover_inputs(
    source: str | Path, extensions: Sequence[str] = VIDEO_EXTENSIONS, segment: float | None = None
) -> list[VideoItem]:
    """The videos (and pictures) named by ``source``: a folder, a glob, or a ``.jsonl`` / ``.csv`` manifest.

    Args:
        source: the job's input.
        extensions: file extensions (folders only; lower case with the dot): videos, or pictures
            (:data:`IMAGE_EXTENSIONS`), which are captioned as images.
        segment: seconds: split every whole video into windows this long (:func:`segment_items`).

    Returns:
        The items in a deterministic order (sorted paths; a manifest's own order).

    Raises:
        JobError: the input does not exist, matches no video, is an unreadable or malformed manifest, or two
            items share an id.
    """
    text = str(source)
    path = Path(text)
    if path.is_dir():
        items = _folder_items(path, extensions)
    elif path.is_file() and path.suffix.lower() == ".jsonl":
        items = _jsonl_items(path)
    elif path.is_file() and path.suffix.lower() == ".csv":
        items = _csv_items(path)
    elif path.is_file():
        raise JobError(
            f"input {text!r} is a file but not a manifest: pass a folder, a glob (quoted), or a .jsonl/.csv manifest"
        )
    elif any(char in text for char in "*?["):
        items = _glob_items(text)
    else:
        raise JobError(f"input {text!r} does not exist (expected a folder, a glob or a .jsonl/.csv manifest)")
    if not items:
        literal = text.replace("[", "[[]")  # a folder named "clips [2023]": its "[" read as a character
        hint = (
            f"; '[' starts a glob character class: write it as '[[]' ({literal!r})"
            if glob.glob(literal)
            else ""
        )
        pictures = (
            "" if set(extensions) & set(IMAGE_EXTENSIONS) else "; for pictures give --extensions images"
        )
        raise JobError(
            f"input {text!r} holds no videos"
            + (f" (extensions {' '.join(extensions)}{pictures})" if path.is_dir() else "")
            + (hint if "[" in text else "")
        )
    if segment is not None:
        items = segment_items(items, segment)
    _check_unique(items, text)
    return items


def _folder_items(folder: Path, extensions: Sequence[str]) -> list[VideoItem]:
    """The videos under ``folder``, its subfolders included; symlinked subfolders are followed (once each, so a
    link loop ends), and hidden files and folders (``.DS_Store``, partial downloads) are skipped. A folder reached
    both directly and through a symlink is read at its own path: the real folders are walked first and links after
    them, so ids do not depend on the order of the listing, and a link added later does not rename what was
    captioned."""
    wanted = {e.lower() for e in extensions}
    items, seen, links = [], set(), [folder]
    while links:  # the input folder, then each linked folder met on the way (in the order met)
        for root, dirs, files in os.walk(links.pop(0)):  # not into links: they wait their turn
            real = os.path.realpath(root)
            if real in seen:
                dirs[:] = []
                continue
            seen.add(real)
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            links += [Path(root, d) for d in dirs if os.path.islink(Path(root, d))]
            for name in files:
                file = Path(root, name)
                if not name.startswith(".") and file.suffix.lower() in wanted and file.is_file():
                    items.append(VideoItem(id=file.relative_to(folder).as_posix(), path=str(file)))
    return sorted(items, key=lambda item: item.id)


def _glob_items(pattern: str) -> list[VideoItem]:
    matches = sorted(m for m in glob.glob(pattern, recursive=True) if Path(m).is_file())
    return [VideoItem(id=m, path=m) for m in matches]


def _manifest_item(row: dict[str, Any], base: Path, where: str) -> VideoItem:
    named = [row[key] for key in ("path", "video", "image") if row.get(key) not in (None, "")]
    if len(set(named)) > 1:
        raise JobError(f"{where}: names more than one file ({', '.join(map(repr, named))}); give one per row")
    video = named[0] if named else None
    if not isinstance(video, str) or not video.strip():
        raise JobError(f"{where}: needs a 'path' (or 'video', 'image') with the file to caption, got {row!r}")
    prompt = row.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise JobError(f"{where}: 'prompt' must be a string, got {prompt!r}")
    item_id = row.get("id")
    if item_id not in (None, "") and (not isinstance(item_id, (str, int)) or isinstance(item_id, bool)):
        raise JobError(f"{where}: 'id' must be a string or an integer, got {item_id!r}")
    start, end = (_seconds(row.get(key), key, where) for key in ("start", "end"))
    if (start, end) != (None, None) and Path(video).suffix.lower() in IMAGE_EXTENSIONS:
        raise JobError(
            f"{where}: {video!r} is a picture: 'start'/'end' bound a video's frames; leave them out"
        )
    try:
        VideoClip(video, start, end)  # the window's own checks, named for this row
    except VLMSpecError as err:
        raise JobError(f"{where}: {err}") from err
    if item_id is None or item_id == "":
        item_id = video if start is None and end is None else _window_id(video, start, end)
    file = Path(video)
    resolved = file if file.is_absolute() else base / file
    return VideoItem(id=str(item_id), path=str(resolved), prompt=prompt or None, start=start, end=end)


def _seconds(value: Any, key: str, where: str) -> float | None:
    """A manifest's ``start``/``end``: a number of seconds (a CSV cell: its text), or ``None`` when absent."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise JobError(f"{where}: {key!r} must be a number of seconds, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JobError(f"{where}: {key!r} must be a number of seconds, got {value!r}")
    return float(value)


def _jsonl_items(manifest: Path) -> list[VideoItem]:
    items = []
    for number, line in enumerate(_read_text(manifest).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"manifest {str(manifest)!r} line {number}"
        items.append(_manifest_item(json_object(line, where), manifest.parent, where))
    return items


def _csv_items(manifest: Path) -> list[VideoItem]:
    reader = csv.DictReader(_read_text(manifest).splitlines())
    columns = reader.fieldnames or []
    if not {"path", "video", "image"} & set(columns):
        raise JobError(
            f"manifest {str(manifest)!r} needs a header row with a 'path' (or 'video', 'image') column, got {columns}"
        )
    return [
        _manifest_item(dict(row), manifest.parent, f"manifest {str(manifest)!r} row {number}")
        for number, row in enumerate(reader, start=2)
    ]


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8-sig")  # drops a leading BOM (Excel's "CSV UTF-8")
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(f"manifest {str(file)!r} could not be read: {err}") from err


def _check_unique(items: Sequence[VideoItem], source: str) -> None:
    seen: set[str] = set()
    duplicates = sorted({item.id for item in items if item.id in seen or seen.add(item.id)})
    if duplicates:
        shown = ", ".join(map(repr, duplicates[:5])) + (" ..." if len(duplicates) > 5 else "")
        raise JobError(f"input {source!r} has duplicate ids ({shown}); ids must be unique for resuming")


def segment_items(items: Sequence[VideoItem], seconds: float) -> list[VideoItem]:
    """Each whole-video item as windows of ``seconds``: ``[0, s]``, ``[s, 2s]``, ..., the last one from its start to
    the end of the video (so no window is a lone frame at the end; ids ``id@start-end``, ``id@start-`` for the
    last). Items with a window of their own stay as they are, and so does a video whose length
    cannot be read (its caption attempt records why). A video whose frames are further apart than ``seconds``
    (its windows would hold no frame) stays whole, with that :attr:`~VideoItem.problem` (an error line).

    Raises:
        JobError: ``seconds`` is not a finite number > 0.
    """
    if not (math.isfinite(seconds) and seconds > 0):
        raise JobError(f"segment must be a finite number > 0, got {seconds}")
    out: list[VideoItem] = []
    for item in items:
        try:
            last, fps = (None, None) if item.window or item.is_image else video_span(item.path)
        except (OSError, ValueError):
            last = None
        if last is None:
            out.append(item)
            continue
        if seconds * fps < 1:
            problem = (
                f"segment={seconds:g} s is shorter than one frame of {item.path!r} ({1 / fps:.3g} s at {fps:g} fps): "
                f"its windows would hold no frame; use a segment of at least {1 / fps:.3g} s"
            )
            out.append(replace(item, problem=problem))
            continue
        count = max(1, math.ceil(last / seconds - 1e-9))  # windows; the last one runs to the end
        for k in range(count):
            start, end = _multiple(k, seconds), (_multiple(k + 1, seconds) if k + 1 < count else None)
            out.append(
                VideoItem(
                    id=_window_id(item.id, start, end),
                    path=item.path,
                    prompt=item.prompt,
                    start=start,
                    end=end,
                )
            )
    return out


def _multiple(k: int, seconds: float) -> float:
    """``k * seconds`` in decimal arithmetic on ``seconds`` as written (``3 * 0.3`` is ``0.9``, not binary floating
    point's ``0.8999999999999999``), so window bounds read as the user would write them. It differs from the binary
    product by a few units in the last place at most, far inside :meth:`vlmspec.VideoClip.frame_window`'s tolerance,
    so the same frames are sampled."""
    return float(Decimal(repr(float(seconds))) * k)


def _window_id(name: str, start: float | None, end: float | None) -> str:
    """``name@start-end`` (``name@start-`` when the window runs to the end of the video)."""
    return f"{name}@{_bound(start or 0)}-{'' if end is None else _bound(end)}"


def _bound(seconds: float) -> str:
    """A window bound as written: every digit, no trailing ``.0`` (``10001.25``, ``3``)."""
    return repr(float(seconds)).removesuffix(".0")


def video_span(path: str | Path) -> tuple[float, float]:
    """``(last, fps)``: the time of a video file's last frame, in seconds, and its frame rate (decord).

    Raises:
        FileNotFoundError, ValueError: as :func:`_open_video`.
    """
    reader = _open_video(path)
    fps = float(reader.get_avg_fps())
    return (len(reader) - 1) / fps, fps


def _open_video(path: str | Path) -> Any:
    """A decord ``VideoReader`` of a video file, with errors that name the file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is empty, cannot be decoded, or holds no frames.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"video file {str(file)!r} does not exist")
    if file.stat().st_size == 0:
        raise ValueError(f"video file {str(file)!r} is empty (0 bytes)")
    from decord import DECORDError, VideoReader

    try:
        reader = VideoReader(str(file))
    except (DECORDError, RuntimeError) as err:
        raise undecodable_video(file, err) from err
    if len(reader) == 0:
        raise ValueError(f"video file {str(file)!r} holds no frames")
    return reader


def qwen_frames(
    path: str | Path,
    window: dict[str, float] | None = None,
    num_frames: int = 8,
    fps: float | None = None,
    max_frames: int | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    patch_size: int = 14,
) -> list[Any]:
    """Frames of a video file sampled and resized by qwen-vl-utils' ``fetch_video`` (offline, decord).

    Args:
        path: the video file.
        window: ``{"start": s, "end": e}`` seconds (either may be left out): sample only that part of the video
            (qwen-vl-utils' ``video_start``/``video_end``).
        num_frames: frames to sample when ``fps`` is ``None`` (at most the video's, rounded down to even).
        fps: sample at this rate instead (qwen-vl-utils bounds it by 4 and ``max_frames`` frames).
        max_frames: the most frames with ``fps``.
        min_pixels, max_pixels: frame area bounds (qwen-vl-utils' defaults when ``None``; a ``max_pixels`` below
            qwen-vl-utils' default minimum, 128 merged patches, lowers that minimum to it).
        patch_size: the vision tower's patch size (14 for Qwen2/2.5-VL, 16 for Qwen3-VL).

    Returns:
        RGB PIL frames whose sides are multiples of ``2 * patch_size``.

    Raises:
        FileNotFoundError, ValueError: the file is missing, unreadable or too short.
    """
    import torch
    from PIL import Image
    from qwen_vl_utils import fetch_video
    from qwen_vl_utils.vision_process import SPATIAL_MERGE_SIZE, VIDEO_MIN_TOKEN_NUM

    reader = _open_video(path)
    total, what = len(reader), f"video file {str(path)!r}"
    if window:
        first, last = VideoClip(path, **window).frame_window(total, float(reader.get_avg_fps()), what)
        total, what = (
            last - first + 1,
            f"{what} from {window.get('start', 0):g}s to {window.get('end', 'its end')}",
        )
    if total < 2:
        raise ValueError(f"{what} has {total} frame(s); qwen-vl-utils samples at least 2")
    element: dict[str, Any] = {"video": str(path)}
    element.update({f"video_{k}": v for k, v in (window or {}).items()})
    if fps is None:
        element["nframes"] = min(num_frames, total) // 2 * 2
        if element["nframes"] < 2:
            raise ValueError(f"{what}: qwen-vl-utils samples frames in pairs, so num_frames must be >= 2")
    else:
        element["fps"] = fps
        if max_frames is not None:
            element["max_frames"] = max_frames
    if max_pixels is not None and min_pixels is None:
        frame_minimum = VIDEO_MIN_TOKEN_NUM * (patch_size * SPATIAL_MERGE_SIZE) ** 2  # qwen-vl-utils' own
        min_pixels = min(max_pixels, frame_minimum)  # a cap below it lowers it
    if min_pixels is not None:
        element["min_pixels"] = min_pixels
    if max_pixels is not None:
        element["max_pixels"] = max_pixels
    video = fetch_video(element, image_patch_size=patch_size)  # [T, 3, H, W] float
    array = video.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(frame) for frame in array]


def frame_source(config: JobConfig, pipe: Any) -> Callable[[VideoItem], Any]:
    """Maps an item to what the pipeline's ``video=`` gets: its path, or a :class:`~vlmspec.VideoClip` of it for a
    window (decord), or qwen-vl-utils' frames of it (of its window).

    Raises:
        JobError: the qwen sampler with a non-Qwen model.
    """
    if config.sampler == "decord":
        return lambda item: VideoClip(item.path, item.start, item.end) if item.window else item.path
    model_type = str(getattr(pipe.target.config, "model_type", ""))
    if not model_type.startswith("qwen"):
        raise JobError(
            f"frame_sampler 'qwen' (qwen-vl-utils; chosen by --fps/--max-frames/--min-pixels/--max-pixels) is for "
            f"the Qwen families, but the target is a {model_type!r} model; use --frame-sampler decord"
        )
    patch_size = int(getattr(getattr(pipe.processor, "video_processor", None), "patch_size", 14) or 14)

    def read(item: VideoItem) -> list[Any]:
        return qwen_frames(
            item.path,
            window=item.window,
            num_frames=config.num_frames,
            fps=config.fps,
            max_frames=config.max_frames,
            min_pixels=config.min_pixels,
            max_pixels=config.max_pixels,
            patch_size=patch_size,
        )

    return read
