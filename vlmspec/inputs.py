"""Loading user images and videos, with errors that name the bad input."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError
from transformers.video_utils import VideoMetadata

ImageInput = Image.Image | str | Path
VideoInput = str | Path | Sequence[Image.Image | np.ndarray]


def load_image(image: ImageInput) -> Image.Image:
    """A PIL RGB image from a PIL image or a file path.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file is not a readable image.
        TypeError: neither a PIL image nor a path.
    """
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, Path)):
        path = Path(image)
        if not path.is_file():
            raise FileNotFoundError(
                f"image file {str(path)!r} does not exist; pass an existing image path or a PIL image"
            )
        try:
            with Image.open(path) as im:
                return im.convert("RGB")
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(
                f"image file {str(path)!r} could not be read as an image ({err}); check that it is a valid "
                "PNG/JPEG/... file"
            ) from err
    raise TypeError(f"image must be a PIL image or a file path, got {type(image).__name__}")


def load_images(images: ImageInput | Sequence[ImageInput] | None) -> list[Image.Image]:
    """Zero, one or several images as a list of PIL images."""
    if images is None:
        return []
    if isinstance(images, (Image.Image, str, Path)):
        return [load_image(images)]
    return [load_image(im) for im in images]


DEFAULT_FRAME_FPS = 2.0


def load_video(
    video: VideoInput, num_frames: int = 8, fps: float = DEFAULT_FRAME_FPS
) -> tuple[list[Image.Image], VideoMetadata]:
    """Frames of a video and their timing: a file (``num_frames`` sampled evenly with decord) or a list of frames.

    The metadata (source fps and the indices of the sampled frames) is what time-aware processors (Qwen3-VL's
    frame timestamps) need. A list of frames is taken as consecutive frames at ``fps`` frames per second
    (default 2, the sampling rate Qwen2-VL's reference pipeline uses), since a list carries no timing.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: the file cannot be decoded, holds no frames, or ``num_frames`` < 1.
    """
    if num_frames < 1:
        raise ValueError(f"num_frames={num_frames} is invalid: sample at least 1 frame")
    if isinstance(video, (str, Path)):
        path = Path(video)
        if not path.is_file():
            raise FileNotFoundError(
                f"video file {str(path)!r} does not exist; pass an existing video path or frames"
            )
        if path.stat().st_size == 0:
            raise ValueError(f"video file {str(path)!r} is empty (0 bytes)")
        from decord import DECORDError, VideoReader  # imported lazily: heavy native library

        try:
            reader = VideoReader(str(path))
            total = len(reader)
            if total == 0:
                raise ValueError(f"video file {str(path)!r} holds no frames")
            index = np.linspace(0, total - 1, num=min(num_frames, total)).round().astype(int)
            array = reader.get_batch(list(index)).asnumpy()  # [F, H, W, 3] uint8
            source_fps = float(reader.get_avg_fps())
        except (DECORDError, RuntimeError) as err:  # decord raises RuntimeError for unreadable containers
            raise ValueError(
                f"video file {str(path)!r} could not be decoded ({err}); check that it is a valid video"
            ) from err
        metadata = VideoMetadata(
            total_num_frames=total, fps=source_fps, frames_indices=[int(i) for i in index]
        )
        return [Image.fromarray(frame) for frame in array], metadata
    frames = list(video)
    if not frames:
        raise ValueError("video is an empty list of frames; pass at least one frame")
    out = []
    for i, frame in enumerate(frames):
        if isinstance(frame, Image.Image):
            out.append(frame.convert("RGB"))
        elif isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[-1] == 3:
            out.append(Image.fromarray(frame.astype(np.uint8)))
        else:
            raise TypeError(
                f"video frame {i} must be a PIL image or an HxWx3 uint8 array, got {type(frame).__name__}"
            )
    return out, VideoMetadata(total_num_frames=len(out), fps=fps, frames_indices=list(range(len(out))))
