"""Synthetic images and videos for tests and offline examples (see :mod:`vlmspec.testing`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    import PIL.Image

DEFAULT_SIZE = (56, 56)


# ---------------------------------------------------------------------------------------------
# Images and videos
# ---------------------------------------------------------------------------------------------
def make_image(seed: int = 0, size: tuple[int, int] = DEFAULT_SIZE) -> PIL.Image.Image:
    """Draws a deterministic picture: colour gradient, a few random shapes and light noise.

    The default ``size`` (56x56) gives a few visual tokens for every family.

    Args:
        seed: Selects the picture; equal seeds give identical images.
        size: ``(width, height)`` in pixels.

    Returns:
        An RGB ``PIL.Image.Image``.
    """
    import numpy as np
    from PIL import Image, ImageDraw

    width, height = int(size[0]), int(size[1])
    if width < 1 or height < 1:
        raise ValueError(f"make_image size must be positive (width, height), got {size!r}.")
    rng = np.random.default_rng(seed)
    c0, c1 = rng.integers(0, 256, size=(2, 3))
    ramp = np.linspace(0.0, 1.0, width)[None, :, None]
    base = (c0 * (1 - ramp) + c1 * ramp) * np.ones((height, 1, 1))
    image = Image.fromarray(base.astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(3):
        x0, x1 = sorted(rng.integers(0, width, size=2).tolist())
        y0, y1 = sorted(rng.integers(0, height, size=2).tolist())
        box = (x0, y0, max(x1, x0 + 2), max(y1, y0 + 2))
        fill = tuple(int(v) for v in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.rectangle(box, fill=fill)
        else:
            draw.ellipse(box, fill=fill)
    pixels = np.asarray(image).astype(np.int16) + rng.integers(-12, 13, size=(height, width, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def make_video_frames(
    seed: int = 0, num_frames: int = 4, size: tuple[int, int] = DEFAULT_SIZE
) -> list[PIL.Image.Image]:
    """Makes a short deterministic clip: a shape moving over a :func:`make_image` background.

    Args:
        seed: Selects the clip.
        num_frames: Number of frames (Qwen video processors need an even count >= 2).
        size: ``(width, height)`` of every frame.

    Returns:
        ``num_frames`` RGB ``PIL.Image.Image`` frames.
    """
    from PIL import ImageDraw

    if num_frames < 1:
        raise ValueError(f"make_video_frames needs num_frames >= 1, got {num_frames}.")
    background = make_image(seed, size)
    width, height = background.size
    frames = []
    for i in range(num_frames):
        frame = background.copy()
        draw = ImageDraw.Draw(frame)
        x = int((width - width // 4) * i / max(num_frames - 1, 1))
        draw.rectangle(
            (x, height // 3, x + width // 4, height // 3 + height // 4), fill=(255, 255 - 40 * i % 256, 0)
        )
        frames.append(frame)
    return frames


def write_video(path: str | Path, frames: list[PIL.Image.Image], fps: int = 4) -> Path:
    """Encodes frames to an mp4 file with PyAV (H.264 if available, else MPEG-4 part 2).

    Args:
        path: Output file (parent folders are created).
        frames: RGB frames of equal, even width and height.
        fps: Frames per second stored in the container.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: If ``frames`` is empty or sizes are odd/mismatched.
        RuntimeError: If no usable encoder is available in the installed PyAV.
    """
    import av
    import numpy as np

    out = Path(path)
    if not frames:
        raise ValueError("write_video needs at least one frame; pass e.g. make_video_frames().")
    width, height = frames[0].size
    if width % 2 or height % 2 or any(f.size != (width, height) for f in frames):
        raise ValueError(
            f"write_video needs frames of one even size, got {[f.size for f in frames]}; resize them first."
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    for codec in ("libx264", "h264", "mpeg4"):
        try:
            with av.open(str(out), mode="w") as container:
                stream = container.add_stream(codec, rate=int(fps))
                stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
                if codec != "mpeg4":
                    stream.options = {"crf": "18", "preset": "ultrafast"}
                for frame in frames:
                    video_frame = av.VideoFrame.from_ndarray(np.asarray(frame.convert("RGB")), format="rgb24")
                    container.mux(stream.encode(video_frame))
                container.mux(stream.encode())
            return out
        except (av.error.FFmpegError, ValueError, KeyError) as exc:  # codec missing in this build
            errors.append(f"{codec}: {exc}")
    raise RuntimeError(f"Could not encode {out} with PyAV; tried {'; '.join(errors)}.")


def read_video(path: str | Path) -> tuple[Any, Any]:
    """Decodes a video file into frames + metadata for the processors.

    transformers 5.x processors decode ``videos=[path]`` only with ``torchcodec`` (the torchvision
    fallback was removed in torchvision 0.26), which is not a dependency of this project. Decode
    with PyAV (or decord) instead and pass the result on::

        frames, metadata = read_video("clip.mp4")
        processor(text=[prompt], videos=[frames], video_metadata=[metadata], return_tensors="pt")

    Args:
        path: Video file readable by PyAV or decord (e.g. from :func:`write_video`).

    Returns:
        ``(frames, metadata)``: a ``(num_frames, height, width, 3)`` uint8 array and its
        ``transformers.video_utils.VideoMetadata`` (fps, frame indices, ...).

    Raises:
        FileNotFoundError: If ``path`` does not exist.
        RuntimeError: If neither PyAV nor decord can decode it.
    """
    from transformers.video_utils import load_video

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"read_video: no video file at {file}; write one with write_video().")
    errors = []
    for backend in ("pyav", "decord"):
        try:
            return load_video(str(file), backend=backend)
        except (ImportError, RuntimeError, ValueError, OSError) as exc:
            errors.append(f"{backend}: {exc}")
    raise RuntimeError(f"Could not decode {file}; tried {'; '.join(errors)}.")
