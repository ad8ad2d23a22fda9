"""Batch video captioning: a resumable job that captions folders of videos with tree speculative decoding.

Usage (``vlmspec caption`` takes the same arguments)::

    python pipelines/video_captioning.py videos/ --out captions.jsonl --target testbed-base
    python pipelines/video_captioning.py "clips/**/*.mp4" --out captions.jsonl --target T --draft D --policy sage
    python pipelines/video_captioning.py manifest.jsonl --out captions.jsonl --fps 1 --max-pixels 50176
    accelerate launch --num_processes 4 pipelines/video_captioning.py videos/ --out captions.jsonl   # 4 GPUs
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 pipelines/video_captioning.py ...  # CPU

Inputs: a folder (its video files, by extension, recursively; id = path relative to the folder), a glob (every
file matched; id = the path as matched), or a manifest: ``.jsonl`` (one object per line) or ``.csv`` (a header
row) with ``path`` (or ``video``), optional ``prompt`` and optional ``id`` (default: the path as written; relative
paths are relative to the manifest's folder). Ids must be unique: resuming keys on them.

Settings come from ``configs/jobs/video_captioning.yaml`` (or ``--config``; read with ``yaml.safe_load``; unknown
keys are an error that lists the valid ones); command-line flags override the file.

Frames: by default ``num_frames`` frames sampled evenly with decord, inside the library
(``VLMSpecPipeline.__call__(None, prompt, video=path, num_frames=...)``). For the Qwen families, qwen-vl-utils'
sampling is offered instead (``--frame-sampler qwen``, chosen automatically by ``--fps``, ``--max-frames``,
``--min-pixels`` or ``--max-pixels``): its ``fetch_video`` reads local files offline with decord, picks the frame
count (``fps`` bounded by ``max_frames``, or ``num_frames``) and resizes frames to the model's patch grid within
``[min_pixels, max_pixels]``; the frames list then goes to the pipeline. The file is opened with decord first, so an
unreadable file gets a clear error (qwen-vl-utils would otherwise fall back to a torchvision reader that no longer
exists and report an AttributeError).

Output: one JSON object per line, one line per video, written whole (one ``write`` of the encoded line, then
``fsync``)::

    {"id": "a/clip1.mp4", "path": "videos/a/clip1.mp4", "prompt": "...", "caption": "...", "policy": "sage",
     "settings": {"max_new_tokens": 256, "num_frames": 8, "prune_ratio": null, "frame_sampler": "decord", ...},
     "model": {"target": "...", "draft": "..."}, "stats": {"new_tokens": ..., "mean_accepted": ..., ...}}
    {"id": "bad.mp4", "path": "videos/bad.mp4", "prompt": "...", "error": "video file ... could not be decoded
     (...)", "error_type": "ValueError", "policy": "sage", "settings": {...}, "model": {...}}

Success lines carry ``caption``, error lines ``error`` and ``error_type``; both carry ``id`` and ``path``. ``stats``
is ``SpecStats.to_dict()`` without the per-step ``trace`` (kept with ``--trace``). After the last video a summary
line goes to stdout: videos succeeded/failed, videos/s, tokens/s (this run's videos and tokens over its wall time
after model loading) and mean tau (accepted draft tokens per verification step over this run). Exit status: 0
when every input has a caption, 2 when some failed, 1 when the job itself could not run (bad config or flag,
missing or unreadable input or manifest, unloadable model), with a message naming what is wrong.

Resume: rerun the same command. Videos whose id already has a caption line are skipped. Error lines are retried
by default (the old error line is dropped first; ``--no-retry-errors`` keeps them and skips those videos). On
start, a torn last line (no trailing newline, or not parsable) is truncated away; a damaged line elsewhere stops
the job with a message (it was not written by this job). Resuming keys on ids only: use a new ``--out`` when you
change the model or the generation settings (a warning counts lines written with other settings).

Scale-out: under ``accelerate launch --num_processes N`` (or ``torchrun --nproc_per_node N``) the input list is split with ``PartialState().split_between_processes`` (contiguous, deterministic shards of the full input
list, so a rank owns the same videos on every restart); rank ``r`` appends to ``<out>.part<r>``. After
``wait_for_everyone()`` the main process merges ``<out>`` and every ``<out>.part*`` into ``<out>`` (one line per id,
a caption preferred to an error and otherwise the later line, in input order, ids not in the inputs kept at the
end), written to a temporary file, fsynced and renamed over ``<out>``; the part files are then removed. A killed
multi-process job resumes per part; every process counts the lines in ``<out>`` and all part files as done, so a
restart with another number of processes (or a single process) also skips them. A single process appends to
``<out>`` itself and ends with the same merge. ``--device-map auto`` passes ``device_map`` to ``from_pretrained``
so that a large target (72B) spans the GPUs of one process. On a machine without GPUs, accelerate 1.x starts
several CPU processes only through MPI: ``accelerate launch --cpu --num_processes 2`` runs ONE process (correct,
not sharded); use ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`` or ``torchrun``. A
launch whose processes do not see each other stops with an error instead of captioning everything twice. Under a
launcher, a partial result (exit status 2 of the main process) shows as the launcher's failure (status 1).

Batching: ``--batch-size B`` captions ``B`` videos at once (``pipe.batch_iter``, :mod:`vlmspec.batching`): each
video keeps its own tree, the target verifies all of them in one forward, a finished video's line is written at once
and the next video takes its row. The default (``batch_size: null``) is chosen from the pipeline's cost probe
(``pipe.default_batch_size()``). Captions, their order in the file, resume and error lines are the same at any batch
size; the bench's throughput section (``vlmspec bench --throughput``) compares it with transformers' batched
``generate()``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import glob
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG_PATH = REPO_ROOT / "configs" / "jobs" / "video_captioning.yaml"
PROG = "vlmspec caption"

EXIT_OK = 0
EXIT_JOB_ERROR = 1
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C
EXIT_PARTIAL = 2

VIDEO_EXTENSIONS: tuple[str, ...] = (
    ".mp4", ".mkv", ".mov", ".avi", ".webm", ".m4v", ".mpg", ".mpeg", ".flv", ".wmv", ".ts", ".3gp",
)  # fmt: skip
FRAME_SAMPLERS = ("auto", "decord", "qwen")
DTYPES = ("auto", "float32", "bfloat16", "float16")
BARRIER_TIMEOUT = timedelta(days=7)
"""How long a process may wait at the final barrier for the others (shards can take hours)."""

ITEM_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    TypeError,
    RuntimeError,  # decord, torch (including out-of-memory errors)
    LookupError,
    ArithmeticError,
    AssertionError,  # qwen-vl-utils checks its arguments with assert
    MemoryError,
)
"""What one video's decoding or generation may raise; recorded as an error line, then the job goes on."""

_PART_RE = re.compile(r"\.part(\d+)$")


class JobError(Exception):
    """The job itself cannot run (bad config, missing input, unloadable model): exit status 1."""


# ---------------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobConfig:
    """The job's settings (``configs/jobs/video_captioning.yaml``; see that file for what each key means)."""

    target: str | None = None
    draft: str | None = None
    family: str = "qwen2_vl"
    dtype: str = "auto"
    device_map: str | None = None
    policy: str = "sage"
    policy_options: dict[str, Any] = field(default_factory=dict)
    prune_ratio: float | None = None
    prompt: str = "Describe this video in detail."
    max_new_tokens: int = 256
    num_frames: int = 8
    frame_sampler: str = "auto"
    fps: float | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    extensions: tuple[str, ...] = VIDEO_EXTENSIONS
    retry_errors: bool = True
    trace: bool = False
    threads: int | None = None
    progress: bool = True
    batch_size: int | None = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The valid config keys."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str) -> JobConfig:
        """A checked config from a mapping of keys to values.

        Args:
            values: config keys and values (YAML or command line).
            source: where they come from, for messages.

        Raises:
            JobError: an unknown key, a value of the wrong type or out of range.
        """
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise JobError(
                f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(cls.field_names())}"
            )
        checked = {name: _check_type(name, value, source) for name, value in values.items()}
        return cls(**checked).validated(source)

    def validated(self, source: str = "config") -> JobConfig:
        """Checks ranges and choices; returns ``self``.

        Raises:
            JobError: naming the key and what is allowed.
        """
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_frames < 1:
            problems.append(f"num_frames must be >= 1, got {self.num_frames}")
        if self.prune_ratio is not None and not 0 <= self.prune_ratio < 1:
            problems.append(f"prune_ratio must be in [0, 1), got {self.prune_ratio}")
        if self.frame_sampler not in FRAME_SAMPLERS:
            problems.append(
                f"frame_sampler must be one of {', '.join(FRAME_SAMPLERS)}, got {self.frame_sampler!r}"
            )
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("fps", "max_frames", "min_pixels", "max_pixels", "threads", "batch_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{name} must be > 0, got {value}")
        if self.max_frames is not None and self.max_frames < 2:
            problems.append(
                f"max_frames must be >= 2 (qwen-vl-utils samples frames in pairs), got {self.max_frames}"
            )
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            problems.append(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
        if not self.extensions:
            problems.append("extensions must name at least one file extension")
        if problems:
            raise JobError(f"{source}: " + "; ".join(problems))
        return self

    @property
    def sampler(self) -> str:
        """The frame sampler in use: ``frame_sampler``, with ``auto`` resolved."""
        if self.frame_sampler != "auto":
            return self.frame_sampler
        qwen_options = (self.fps, self.max_frames, self.min_pixels, self.max_pixels)
        return "qwen" if any(v is not None for v in qwen_options) else "decord"

    def settings(self) -> dict[str, Any]:
        """The generation settings recorded in every output line."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "num_frames": self.num_frames,
            "prune_ratio": self.prune_ratio,
            "frame_sampler": self.sampler,
            "dtype": self.dtype,
            "policy_options": dict(self.policy_options),
        }
        if self.sampler == "qwen":
            out.update(
                fps=self.fps,
                max_frames=self.max_frames,
                min_pixels=self.min_pixels,
                max_pixels=self.max_pixels,
            )
        return out


_KINDS: dict[str, tuple[type, bool]] = {
    "target": (str, True),
    "draft": (str, True),
    "family": (str, False),
    "dtype": (str, False),
    "device_map": (str, True),
    "policy": (str, False),
    "policy_options": (dict, False),
    "prune_ratio": (float, True),
    "prompt": (str, False),
    "max_new_tokens": (int, False),
    "num_frames": (int, False),
    "frame_sampler": (str, False),
    "fps": (float, True),
    "max_frames": (int, True),
    "min_pixels": (int, True),
    "max_pixels": (int, True),
    "extensions": (tuple, False),
    "retry_errors": (bool, False),
    "trace": (bool, False),
    "threads": (int, True),
    "progress": (bool, False),
    "batch_size": (int, True),
}
"""Type and nullability of every config key (kept equal to ``JobConfig``'s fields; a test checks)."""


_KIND_NAMES = {
    str: "a string",
    bool: "true or false",
    int: "an integer",
    float: "a number",
    dict: "a mapping",
    tuple: "a list of file extensions",
}


def _check_type(name: str, value: Any, source: str) -> Any:
    """``value`` converted to key ``name``'s type, or ``JobError``."""
    kind, nullable = _KINDS[name]
    if value is None:
        if nullable:
            return None
        raise JobError(f"{source}: {name} must not be null")
    ok = {
        str: isinstance(value, str),
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        dict: isinstance(value, dict),
        tuple: isinstance(value, (list, tuple, str)),
    }[kind]
    if not ok:
        raise JobError(
            f"{source}: {name} must be {_KIND_NAMES[kind]}, got {value!r} ({type(value).__name__})"
        )
    if kind is float:
        return float(value)
    if kind is tuple:
        return _extensions(value, source)
    if kind is dict:
        return dict(value)
    return value


def _extensions(value: str | Sequence[Any], source: str) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in items:
        if not isinstance(item, str):
            raise JobError(f"{source}: extensions must be strings like '.mp4', got {item!r}")
        item = item.strip().lower()
        if item:
            out.append(item if item.startswith(".") else f".{item}")
    return tuple(out)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file (``yaml.safe_load``).

    Raises:
        JobError: the file is missing, not YAML, or not a mapping.
    """
    file = Path(path)
    if not file.is_file():
        raise JobError(f"config file {str(file)!r} does not exist")
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise JobError(f"config file {str(file)!r} could not be read as YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise JobError(
            f"config file {str(file)!r} must hold a mapping of keys to values, got {type(data).__name__}"
        )
    return data


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
    """The job's config: defaults, then the YAML file, then ``overrides`` (the command line).

    Args:
        path: a YAML config file; ``None``: ``configs/jobs/video_captioning.yaml`` when present.
        overrides: values that win over the file's.

    Raises:
        JobError: the file or a value is invalid (unknown keys are listed with the valid ones).
    """
    if path is None and DEFAULT_CONFIG_PATH.is_file():
        path = DEFAULT_CONFIG_PATH
    values: dict[str, Any] = {}
    source = "config"
    if path is not None:
        values.update(read_config_file(path))
        source = f"config file {str(path)!r}"
        JobConfig.from_mapping(values, source)  # report the file's own mistakes as the file's
    values.update(overrides or {})
    return JobConfig.from_mapping(values, source if not overrides else f"{source} with command-line flags")


# ---------------------------------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VideoItem:
    """One video to caption.

    Attributes:
        id: unique, stable id (what resuming keys on).
        path: the video file.
        prompt: the item's own prompt (``None``: the job's).
    """

    id: str
    path: str
    prompt: str | None = None


def discover_inputs(source: str | Path, extensions: Sequence[str] = VIDEO_EXTENSIONS) -> list[VideoItem]:
    """The videos named by ``source``: a folder, a glob, or a ``.jsonl`` / ``.csv`` manifest.

    Args:
        source: the job's input.
        extensions: video file extensions (folders only; lower case with the dot).

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
        raise JobError(
            f"input {text!r} holds no videos"
            + (f" (extensions {' '.join(extensions)})" if path.is_dir() else "")
        )
    _check_unique(items, text)
    return items


def _folder_items(folder: Path, extensions: Sequence[str]) -> list[VideoItem]:
    wanted = {e.lower() for e in extensions}
    items = []
    for file in folder.rglob("*"):
        rel = file.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts) or not file.is_file():
            continue  # hidden files and folders (.DS_Store, partial downloads)
        if file.suffix.lower() in wanted:
            items.append(VideoItem(id=rel.as_posix(), path=str(file)))
    return sorted(items, key=lambda item: item.id)


def _glob_items(pattern: str) -> list[VideoItem]:
    matches = sorted(m for m in glob.glob(pattern, recursive=True) if Path(m).is_file())
    return [VideoItem(id=m, path=m) for m in matches]


def _manifest_item(row: dict[str, Any], base: Path, where: str) -> VideoItem:
    video = row.get("path", row.get("video"))
    if not isinstance(video, str) or not video.strip():
        raise JobError(f"{where}: needs a 'path' (or 'video') with the video file, got {row!r}")
    prompt = row.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise JobError(f"{where}: 'prompt' must be a string, got {prompt!r}")
    item_id = row.get("id")
    if item_id is None or item_id == "":
        item_id = video
    elif not isinstance(item_id, (str, int)) or isinstance(item_id, bool):
        raise JobError(f"{where}: 'id' must be a string or an integer, got {item_id!r}")
    file = Path(video)
    resolved = file if file.is_absolute() else base / file
    return VideoItem(id=str(item_id), path=str(resolved), prompt=prompt or None)


def _jsonl_items(manifest: Path) -> list[VideoItem]:
    items = []
    for number, line in enumerate(_read_text(manifest).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"manifest {str(manifest)!r} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise JobError(f"{where} is not valid JSON ({err})") from err
        if not isinstance(row, dict):
            raise JobError(f"{where} must be a JSON object, got {type(row).__name__}")
        items.append(_manifest_item(row, manifest.parent, where))
    return items


def _csv_items(manifest: Path) -> list[VideoItem]:
    reader = csv.DictReader(_read_text(manifest).splitlines())
    columns = reader.fieldnames or []
    if "path" not in columns and "video" not in columns:
        raise JobError(
            f"manifest {str(manifest)!r} needs a header row with a 'path' (or 'video') column, got {columns}"
        )
    return [
        _manifest_item(dict(row), manifest.parent, f"manifest {str(manifest)!r} row {number}")
        for number, row in enumerate(reader, start=2)
    ]


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise JobError(f"manifest {str(file)!r} could not be read: {err}") from err


def _check_unique(items: Sequence[VideoItem], source: str) -> None:
    seen: set[str] = set()
    duplicates = sorted({item.id for item in items if item.id in seen or seen.add(item.id)})
    if duplicates:
        shown = ", ".join(map(repr, duplicates[:5])) + (" ..." if len(duplicates) > 5 else "")
        raise JobError(f"input {source!r} has duplicate ids ({shown}); ids must be unique for resuming")


# ---------------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------------
def resolve_pair(
    target: str | Path | None, draft: str | Path | None, family: str = "qwen2_vl"
) -> tuple[str, str | None]:
    """Model folders or hub ids for a target/draft pair, with the project's named pairs resolved.

    ``testbed-<size>`` (``testbed-mini``, ``testbed-base``, optionally ``@<calibration>``) is the testbed's
    trained pair of ``family`` (shipped with the package), ``tiny`` the tiny random pair; ``None`` means the default
    pair (``testbed-base@cpu``).
    Anything else (a folder, a hub id) passes through, as does ``draft``. See :mod:`vlmspec.named_pairs`.

    Args:
        target: the target's folder, hub id or pair name.
        draft: the draft's folder or hub id (``None`` with a pair name, or for ``policy="ar"``).
        family: family of a named pair given without ``:<family>``.

    Returns:
        ``(target, draft)`` as strings (``draft`` may be ``None``).

    Raises:
        JobError: a pair name with ``--draft``, an unknown size or family.
    """
    from vlmspec.named_pairs import DEFAULT_PAIR, is_pair_name, split_calibration
    from vlmspec.named_pairs import resolve_pair as resolve_named_pair

    name = DEFAULT_PAIR if target is None else str(target)
    if not is_pair_name(name):
        return name, (str(draft) if draft is not None else None)
    if draft is not None:
        raise JobError(
            f"--target {name} names a target/draft pair; drop --draft {draft} (or name both folders)"
        )
    base, calibration = split_calibration(name)
    if ":" not in base:
        name = f"{base}:{family}" + (f"@{calibration}" if calibration else "")
    try:
        pair = resolve_named_pair(name)
    except ValueError as err:
        raise JobError(f"--target {name}: {err}") from err
    return pair.target, pair.draft


def _torch_dtype(name: str) -> Any:
    import torch

    return {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        name
    ]


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """No "Loading weights" bars from transformers while the job loads its models (restored after)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def load_pipeline(
    config: JobConfig, device_map: str | dict[str, Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """The :class:`~vlmspec.VLMSpecPipeline` of ``config`` (loaded once per process) and the models it holds.

    Args:
        config: the job's config (models, dtype, policy and its options, prune ratio).
        device_map: passed to ``from_pretrained`` (``config.device_map`` when ``None``).

    Returns:
        The pipeline and ``{"target": ..., "draft": ...}``, the resolved folders or hub ids (``draft`` is ``None``
        when the policy does not use one).

    Raises:
        JobError: an unknown policy or bad policy options, a policy that needs a draft without one, or models
            that cannot be loaded (message names them).
    """
    from vlmspec import VLMSpecPipeline, get_policy

    policy = config.policy
    try:
        uses_draft = get_policy(policy, **config.policy_options).uses_draft
    except (ValueError, TypeError) as err:
        raise JobError(f"policy {policy!r} with options {config.policy_options}: {err}") from err
    target, draft = resolve_pair(config.target, config.draft, config.family)
    calibration = _calibration(config.target)
    if draft is None and uses_draft:
        raise JobError(f"policy {policy!r} needs a draft model: pass --draft (or use --policy ar)")
    draft = draft if uses_draft else None
    try:
        with _quiet_loading():
            pipe = VLMSpecPipeline.from_pretrained(
                target,
                draft,
                policy=policy,
                torch_dtype=_torch_dtype(config.dtype),
                device_map=device_map if device_map is not None else config.device_map,
                prune_ratio=config.prune_ratio,
                calibration=calibration,
                **config.policy_options,
            )
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, ImportError) as err:
        raise JobError(
            f"could not load the models (target {target!r}, draft {draft!r}): {type(err).__name__}: {err}"
        ) from err
    return pipe, {"target": target, "draft": draft, "calibration": calibration}


def _calibration(target: str | Path | None) -> str | None:
    """The ``@<calibration>`` of a pair name (the default pair's when ``target`` is ``None``), else ``None``."""
    from vlmspec.named_pairs import DEFAULT_PAIR, is_pair_name, split_calibration

    name = DEFAULT_PAIR if target is None else str(target)
    return split_calibration(name)[1] if is_pair_name(name) else None


# ---------------------------------------------------------------------------------------------------------------------
# Frames
# ---------------------------------------------------------------------------------------------------------------------
def probe_video(path: str | Path) -> int:
    """The number of frames in a video file (decord), with errors that name the file.

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
        total = len(VideoReader(str(file)))
    except (DECORDError, RuntimeError) as err:
        raise ValueError(
            f"video file {str(file)!r} could not be decoded ({err}); check that it is a valid video"
        ) from err
    if total == 0:
        raise ValueError(f"video file {str(file)!r} holds no frames")
    return total


def qwen_frames(
    path: str | Path,
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
        num_frames: frames to sample when ``fps`` is ``None`` (at most the video's, rounded down to even).
        fps: sample at this rate instead (qwen-vl-utils bounds it by 4 and ``max_frames`` frames).
        max_frames: the most frames with ``fps``.
        min_pixels, max_pixels: frame area bounds (qwen-vl-utils' defaults when ``None``).
        patch_size: the vision tower's patch size (14 for Qwen2/2.5-VL, 16 for Qwen3-VL).

    Returns:
        RGB PIL frames whose sides are multiples of ``2 * patch_size``.

    Raises:
        FileNotFoundError, ValueError: the file is missing, unreadable or too short.
    """
    import torch
    from PIL import Image
    from qwen_vl_utils import fetch_video

    total = probe_video(path)
    element: dict[str, Any] = {"video": str(path)}
    if fps is None:
        count = min(num_frames, total)
        count -= count % 2
        if count < 2:
            raise ValueError(
                f"video file {str(path)!r} has {total} frame(s); qwen-vl-utils samples at least 2"
            )
        element["nframes"] = count
    else:
        element["fps"] = fps
        if max_frames is not None:
            element["max_frames"] = max_frames
    if min_pixels is not None:
        element["min_pixels"] = min_pixels
    if max_pixels is not None:
        element["max_pixels"] = max_pixels
    video = fetch_video(element, image_patch_size=patch_size)  # [T, 3, H, W] float
    array = video.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
    return [Image.fromarray(frame) for frame in array]


def frame_source(config: JobConfig, pipe: Any) -> Callable[[str], Any]:
    """Maps a video path to what the pipeline's ``video=`` gets: the path (decord) or qwen-vl-utils' frames.

    Raises:
        JobError: the qwen sampler with a non-Qwen model.
    """
    if config.sampler == "decord":
        return lambda path: path
    model_type = str(getattr(pipe.target.config, "model_type", ""))
    if not model_type.startswith("qwen"):
        raise JobError(
            f"frame_sampler 'qwen' (qwen-vl-utils; chosen by --fps/--max-frames/--min-pixels/--max-pixels) is for "
            f"the Qwen families, but the target is a {model_type!r} model; use --frame-sampler decord"
        )
    patch_size = int(getattr(getattr(pipe.processor, "video_processor", None), "patch_size", 14) or 14)

    def read(path: str) -> list[Any]:
        return qwen_frames(
            path,
            num_frames=config.num_frames,
            fps=config.fps,
            max_frames=config.max_frames,
            min_pixels=config.min_pixels,
            max_pixels=config.max_pixels,
            patch_size=patch_size,
        )

    return read


# ---------------------------------------------------------------------------------------------------------------------
# The output file: append-only lines, torn-tail repair, atomic rewrite, merge
# ---------------------------------------------------------------------------------------------------------------------
def encode_record(record: dict[str, Any]) -> bytes:
    """One output line: compact JSON (non-finite floats as ``null``) and a newline, UTF-8."""
    ordered = {"id": record["id"], **record}  # the id first: how the job recognises its own lines
    return (json.dumps(_finite(ordered), ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


@dataclass
class ScannedFile:
    """An output file's complete records and where its valid part ends.

    Attributes:
        records: the parsed lines (JSON objects with an ``id``), in file order.
        valid_bytes: length of the valid part; beyond it lies a torn last line.
        size: the file's size.
    """

    records: list[dict[str, Any]]
    valid_bytes: int
    size: int

    @property
    def torn(self) -> bool:
        return self.valid_bytes < self.size


def _parse_line(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) and "id" in record else None


RECORD_START = b'{"id": '
"""How every line this job writes begins (:func:`encode_record`: the record's first key is its id)."""


def _not_ours(file: Path, line: int) -> JobError:
    return JobError(
        f"output file {str(file)!r} was not written by this job (line {line} is not a caption record); it is left "
        "unchanged: pass another --out, or move that file away"
    )


def scan_output(path: str | Path) -> ScannedFile:
    """Parses an output file; a torn last line (a record cut short: no newline, or not parsable) is set aside.

    Only the job's own files are taken: a path that is not a regular file, or a file whose lines are not the job's
    records (each starts with :data:`RECORD_START`), is refused without reading further or changing a byte.

    Raises:
        JobError: not a regular file, not written by this job, or a damaged line before the last one.
    """
    file = Path(path)
    if file.exists() and not file.is_file():
        raise JobError(
            f"output {str(file)!r} is not a regular file (a folder, device or pipe); the job writes only to a "
            "regular file, new or one it wrote before: pass a .jsonl file path to --out"
        )
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        return ScannedFile([], 0, 0)
    except OSError as err:
        raise JobError(f"output file {str(file)!r} could not be read: {err}") from err
    lines = data.split(b"\n")
    if lines[-1] and not lines[-1].startswith(RECORD_START):
        raise _not_ours(file, len(lines))
    complete = lines[:-1]  # the last piece follows the last newline: empty, or a line torn before its newline
    records: list[dict[str, Any]] = []
    offset = valid = 0
    for number, line in enumerate(complete, start=1):
        offset += len(line) + 1
        if not line.strip():
            valid = offset
            continue
        record = _parse_line(line)
        if record is None:
            if not records and not line.startswith(RECORD_START):
                raise _not_ours(file, number)
            if number == len(complete) and not lines[-1] and line.startswith(RECORD_START):
                break  # the last line is torn (unparsable): truncated away
            raise JobError(
                f"output file {str(file)!r} line {number} is not a JSON object with an 'id'; it was damaged or "
                "edited (this job only writes whole lines): fix or delete that line, then rerun"
            )
        records.append(record)
        valid = offset
    return ScannedFile(records, valid, len(data))


def read_output(path: str | Path, repair: bool) -> list[dict[str, Any]]:
    """The records of an output file.

    Args:
        path: the file (missing: no records).
        repair: truncate a torn last line away (only for a file this process owns); else just ignore it.

    Raises:
        JobError: a damaged line before the last one.
    """
    scanned = scan_output(path)
    if repair and scanned.torn:
        with open(path, "r+b") as handle:
            handle.truncate(scanned.valid_bytes)
            handle.flush()
            os.fsync(handle.fileno())
        print(
            f"{PROG}: {path}: removed a torn last line ({scanned.size - scanned.valid_bytes} bytes) left by an "
            "interrupted run; that video is captioned again",
            file=sys.stderr,
        )
    return scanned.records


def _fsync_dir(folder: Path) -> None:
    """Makes a new or renamed directory entry durable (where the platform allows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not supported for directories here (e.g. some network file systems)
    finally:
        os.close(fd)


class ResultWriter:
    """Appends whole lines to an output file: one ``os.write`` of the encoded line, then ``os.fsync``.

    The file is opened with ``O_APPEND`` and locked (``flock``) so that a second job cannot write the same file.
    A process killed at any point leaves every earlier line whole; a line cut short by a crash has no newline and
    is truncated away on the next start (:func:`read_output` with ``repair=True``).

    Raises:
        JobError: the file is locked by another running job or cannot be opened.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        existed = self.path.exists()
        try:
            self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            raise JobError(f"output file {str(self.path)!r} cannot be opened for writing: {err}") from err
        try:
            _lock(self._fd, self.path)
        except JobError:
            self.close()
            raise
        if not existed:
            _fsync_dir(self.path.parent)

    def write(self, record: dict[str, Any]) -> None:
        """Appends ``record`` as one line and makes it durable.

        Raises:
            OSError: the write failed or was short (disk full); the partial line is repaired on restart.
        """
        if self._fd is None:
            raise ValueError(f"ResultWriter for {self.path} is closed")
        data = encode_record(record)
        written = os.write(self._fd, data)
        if written != len(data):
            raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes (disk full?)")
        os.fsync(self._fd)

    def rewrite(self, records: Sequence[dict[str, Any]]) -> None:
        """Replaces the file's content with ``records`` atomically (:func:`write_atomically`), keeping the lock."""
        write_atomically(self.path, records)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            _lock(fd, self.path)
        except JobError:
            os.close(fd)
            raise
        self.close()
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ResultWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _lock(fd: int, path: Path) -> None:
    try:
        import fcntl
    except ImportError:  # not on POSIX: no lock
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as err:
        raise JobError(f"output file {str(path)!r} is being written by another running job") from err


def write_atomically(path: str | Path, records: Sequence[dict[str, Any]]) -> None:
    """Replaces ``path`` with ``records`` (temporary file, fsync, rename): the old or the new file, never half."""
    file = Path(path)
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(b"".join(encode_record(r) for r in records))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, file)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(file.parent)


def part_path(out: str | Path, rank: int) -> Path:
    """Rank ``rank``'s part file: ``<out>.part<rank>``."""
    out = Path(out)
    return out.with_name(f"{out.name}.part{rank}")


def part_files(out: str | Path) -> list[Path]:
    """The existing part files of ``out``, by rank."""
    out = Path(out)
    found = []
    for file in out.parent.glob(glob.escape(out.name) + ".part*"):
        match = _PART_RE.search(file.name)
        if match and file.name == f"{out.name}.part{match.group(1)}":
            found.append((int(match.group(1)), file))
    return [file for _, file in sorted(found)]


def is_success(record: dict[str, Any]) -> bool:
    return "caption" in record


def statuses(records: Sequence[dict[str, Any]]) -> dict[str, str]:
    """``id -> "ok" | "error"``; an id with any caption line is ``"ok"``."""
    status: dict[str, str] = {}
    for record in records:
        key = str(record["id"])
        if is_success(record) or key not in status:
            status[key] = "ok" if is_success(record) else "error"
    return status


def merge_records(sources: Sequence[Sequence[dict[str, Any]]], order: Sequence[str]) -> list[dict[str, Any]]:
    """One record per id from several files' records.

    A caption beats an error; otherwise the later record wins (later source, later line). Ids in ``order`` come
    first, in that order; other ids follow in the order first seen.
    """
    best: dict[str, dict[str, Any]] = {}
    for records in sources:
        for record in records:
            key = str(record["id"])
            previous = best.get(key)
            if previous is None or is_success(record) or not is_success(previous):
                best[key] = record
    ordered = [best.pop(key) for key in order if key in best]
    return ordered + list(best.values())


def merge_outputs(out: str | Path, items: Sequence[VideoItem]) -> list[dict[str, Any]]:
    """Merges ``<out>`` and its part files into ``<out>`` (atomically), then removes the part files.

    Returns:
        The merged records (what ``<out>`` now holds).
    """
    out = Path(out)
    parts = part_files(out)
    current = read_output(out, repair=False)
    merged = merge_records([current] + [read_output(p, repair=False) for p in parts], [i.id for i in items])
    if parts or merged != current or scan_output(out).torn:
        write_atomically(out, merged)
    for part in parts:
        part.unlink()
    if parts:
        _fsync_dir(out.parent)
    return merged


# ---------------------------------------------------------------------------------------------------------------------
# Captioning
# ---------------------------------------------------------------------------------------------------------------------
def _error_message(err: BaseException) -> str:
    text = str(err).strip() or repr(err)
    return text if len(text) <= 4000 else text[:4000] + " ..."


def caption_request(item: VideoItem, config: JobConfig, frames: Callable[[str], Any]) -> dict[str, Any]:
    """The pipeline call for one video (its frames are read here, when the video's turn in the batch comes).

    Args:
        item: the video.
        config: the job's config.
        frames: what the pipeline's ``video=`` gets for a path (see :func:`frame_source`).
    """
    return {
        "prompt": item.prompt or config.prompt,
        "video": frames(item.path),
        "max_new_tokens": config.max_new_tokens,
        "num_frames": config.num_frames,
    }


def caption_record(item: VideoItem, config: JobConfig, meta: dict[str, Any], result: Any) -> dict[str, Any]:
    """The output record of one video from its pipeline result: ``caption`` and ``stats``, or, for a failure
    (``ITEM_ERRORS``), ``error`` and ``error_type``; any other exception propagates.

    Args:
        item: the video.
        config: the job's config.
        meta: ``policy``/``settings``/``model`` fields shared by every record.
        result: a :class:`~vlmspec.pipeline.SpecOutput`, or the exception its request raised.
    """
    base = {"id": item.id, "path": item.path, "prompt": item.prompt or config.prompt}
    if isinstance(result, ITEM_ERRORS):
        return {**base, "error": _error_message(result), "error_type": type(result).__name__, **meta}
    if isinstance(result, BaseException):
        raise result
    stats = result.stats.to_dict()
    if not config.trace:
        stats.pop("trace", None)
    return {**base, "caption": result.text, **meta, "stats": stats}


@dataclass
class RunTotals:
    """What one process did in this run."""

    processed: int = 0
    captioned: int = 0
    failed: int = 0
    skipped: int = 0
    new_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    seconds: float = 0.0

    def add(self, record: dict[str, Any]) -> None:
        self.processed += 1
        if not is_success(record):
            self.failed += 1
            return
        self.captioned += 1
        stats = record.get("stats", {})
        self.new_tokens += int(stats.get("new_tokens", 0))
        self.steps += int(stats.get("steps", 0))
        self.accepted += int(stats.get("accepted_tokens", 0))

    @classmethod
    def combine(cls, parts: Sequence[RunTotals]) -> RunTotals:
        """Sums over processes; ``seconds`` is the slowest process's."""
        total = cls()
        for part in parts:
            for name in ("processed", "captioned", "failed", "skipped", "new_tokens", "steps", "accepted"):
                setattr(total, name, getattr(total, name) + getattr(part, name))
            total.seconds = max(total.seconds, part.seconds)
        return total

    @property
    def tau(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0


@dataclass
class JobSummary:
    """The job's outcome over its inputs, and this run's speed.

    Attributes:
        videos: inputs.
        succeeded: inputs with a caption in the output.
        failed: inputs with only an error line.
        missing: inputs with no line (only if a process died without raising).
        run: this run's totals over all processes.
        policy: the decoding policy.
        out: the output file.
    """

    videos: int
    succeeded: int
    failed: int
    missing: int
    run: RunTotals
    policy: str
    out: str

    @property
    def exit_code(self) -> int:
        return EXIT_OK if self.succeeded == self.videos else EXIT_PARTIAL

    def to_dict(self) -> dict[str, Any]:
        seconds = self.run.seconds
        return {
            "videos": self.videos,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "missing": self.missing,
            "processed": self.run.processed,
            "skipped": self.run.skipped,
            "videos_per_second": self.run.processed / seconds if seconds > 0 else 0.0,
            "tokens_per_second": self.run.new_tokens / seconds if seconds > 0 else 0.0,
            "mean_tau": self.run.tau,
            "new_tokens": self.run.new_tokens,
            "seconds": seconds,
            "policy": self.policy,
            "out": self.out,
        }

    def line(self) -> str:
        """The summary line."""
        d = self.to_dict()
        missing = f", {self.missing} missing" if self.missing else ""
        return (
            f"summary: {self.videos} videos: {self.succeeded} succeeded, {self.failed} failed{missing} "
            f"(this run: {self.run.captioned} captioned, {self.run.failed} failed, {self.run.skipped} already done) | "
            f"{d['videos_per_second']:.2f} videos/s, {d['tokens_per_second']:.1f} tokens/s, mean tau "
            f"{d['mean_tau']:.2f} | policy {self.policy} | {self.out}"
        )


def _state(cpu: bool) -> Any:
    """accelerate's ``PartialState`` (one process unless launched by ``accelerate launch``)."""
    import torch
    from accelerate import PartialState

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched <= 1:
        return PartialState(cpu=cpu)
    # Without a GPU, accelerate sets up several processes only in CPU mode (else each would think it is alone).
    state = PartialState(cpu=cpu or not torch.cuda.is_available(), timeout=BARRIER_TIMEOUT)
    if state.num_processes != launched:
        raise JobError(
            f"launched as {launched} processes (WORLD_SIZE) but accelerate set up {state.num_processes}; every "
            "process would caption every video. On CPU: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu "
            "--num_processes N ..., or torchrun --nproc_per_node N ..."
        )
    return state


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _todo(
    shard: Sequence[VideoItem], status: dict[str, str], retry_errors: bool
) -> tuple[list[VideoItem], set[str]]:
    """The shard's videos still to caption and, among them, the ids whose error lines are retried."""
    todo, retried = [], set()
    for item in shard:
        state = status.get(item.id)
        if state == "ok" or (state == "error" and not retry_errors):
            continue
        todo.append(item)
        if state == "error":
            retried.add(item.id)
    return todo, retried


def _warn_other_settings(records: Sequence[dict[str, Any]], meta: dict[str, Any]) -> None:
    keys = ("policy", "settings", "model")
    other = sum(1 for r in records if is_success(r) and any(r.get(k) != meta[k] for k in keys))
    if other:
        print(
            f"{PROG}: warning: {other} video(s) already captioned in the output used other models or settings; they "
            "are kept and skipped (use a new --out to caption everything with the current settings)",
            file=sys.stderr,
        )


def _progress(total: int, rank: int, world: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        unit="video",
        desc="captioning" if world == 1 else f"captioning [rank {rank}]",
        position=rank if world > 1 else None,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
    )


def _caption_shard(
    pipe: Any,
    todo: Sequence[VideoItem],
    config: JobConfig,
    writer: ResultWriter,
    meta: dict[str, Any],
    bar: Any,
) -> RunTotals:
    """Captions ``todo``, ``config.batch_size`` videos decoding together (default: the pipeline's choice), one
    line per video written as soon as it is captioned; updates the progress bar."""
    from tqdm.auto import tqdm

    frames = frame_source(config, pipe)
    batch_size = config.batch_size or pipe.default_batch_size()
    totals = RunTotals()
    start = time.perf_counter()
    requests = (partial(caption_request, item, config, frames) for item in todo)
    for index, result in pipe.batch_iter(requests, batch_size):
        item = todo[index]
        record = caption_record(item, config, meta, result)
        try:
            writer.write(record)
        except OSError as err:
            raise JobError(
                f"could not append to {str(writer.path)!r} ({err}); fix that (disk space?) and rerun the same "
                "command to resume"
            ) from err
        totals.add(record)
        totals.seconds = time.perf_counter() - start
        if not is_success(record):
            tqdm.write(f"{PROG}: {item.id}: {record['error_type']}: {record['error']}", file=sys.stderr)
        bar.set_postfix(
            {"tok/s": f"{totals.new_tokens / max(totals.seconds, 1e-9):.1f}", "tau": f"{totals.tau:.2f}",
             "failed": totals.failed},
            refresh=False,
        )  # fmt: skip
        bar.update(1)
    return totals


def run_job(config: JobConfig, source: str | Path, out: str | Path, cpu: bool = False) -> JobSummary | None:
    """Captions every video of ``source`` into ``out``, resuming what an earlier run left.

    Args:
        config: the job's config.
        source: a folder, a glob or a manifest (see :func:`discover_inputs`).
        out: the output JSONL file.
        cpu: keep models on the CPU even if there is a GPU (also ``ACCELERATE_USE_CPU=1``).

    Returns:
        The summary on the main process; ``None`` on the other processes of a multi-process launch.

    Raises:
        JobError: the job cannot run (the message says why).
    """
    out = Path(out)
    if out.is_dir():
        raise JobError(f"--out {str(out)!r} is a folder; name the output .jsonl file")
    items = discover_inputs(source, config.extensions)
    cpu = cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    state = _state(cpu)
    rank, world = state.process_index, state.num_processes
    own = out if world == 1 else part_path(out, rank)
    with state.split_between_processes(items) as shard:
        shard = list(shard)
    totals = RunTotals()
    policy = config.policy
    with ResultWriter(own) as writer:  # locked before reading what is done: a second job on `own` stops here
        todo, records = _plan(writer, out, shard, config.retry_errors)
        totals.skipped = len(shard) - len(todo)
        where = f" (process {rank} of {world}: {len(shard)} of the {len(items)} videos)" if world > 1 else ""
        print(
            f"{PROG}: {totals.skipped} already done, {len(todo)} to caption{where} -> {own}", file=sys.stderr
        )
        if todo:
            with _torch_threads(config.threads):
                pipe, models = load_pipeline(
                    config, device_map=config.device_map or ({"": "cpu"} if cpu else None)
                )
                policy = pipe.policy.name
                meta = {"policy": policy, "settings": config.settings(), "model": models}
                _warn_other_settings(records, meta)
                with _progress(len(todo), rank, world, config.progress) as bar:
                    totals = RunTotals.combine(
                        [totals, _caption_shard(pipe, todo, config, writer, meta, bar)]
                    )
    if world > 1:
        from accelerate.utils import gather_object

        totals = RunTotals.combine([RunTotals(**d) for d in gather_object([asdict(totals)])])
        state.wait_for_everyone()
    if not state.is_main_process:
        return None
    return _summarize(merge_outputs(out, items), items, totals, policy, out)


def _plan(
    writer: ResultWriter, out: Path, shard: Sequence[VideoItem], retry_errors: bool
) -> tuple[list[VideoItem], list[dict[str, Any]]]:
    """What this process still has to caption, from ``<out>`` and every part file.

    The writer's own file is repaired (torn last line) and, when error lines are retried, rewritten without
    them; the other files are only read (a torn last line there is ignored).

    Returns:
        The videos to caption and every record read (for the settings check).
    """
    own_records = read_output(writer.path, repair=True)
    others = [path for path in [out] + part_files(out) if path != writer.path]
    records = [r for path in others for r in read_output(path, repair=False)] + own_records
    todo, retried = _todo(shard, statuses(records), retry_errors)
    if retried:
        print(f"{PROG}: retrying {len(retried)} video(s) that failed before", file=sys.stderr)
        if any(str(r["id"]) in retried for r in own_records):
            writer.rewrite([r for r in own_records if str(r["id"]) not in retried])
    return todo, records


def _summarize(
    merged: Sequence[dict[str, Any]], items: Sequence[VideoItem], totals: RunTotals, policy: str, out: Path
) -> JobSummary:
    final = statuses(merged)
    succeeded = sum(1 for i in items if final.get(i.id) == "ok")
    failed = sum(1 for i in items if final.get(i.id) == "error")
    return JobSummary(
        videos=len(items),
        succeeded=succeeded,
        failed=failed,
        missing=len(items) - succeeded - failed,
        run=totals,
        policy=policy,
        out=str(out),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """Exits with status 1 (the job could not run) on a bad flag, not argparse's 2 (which means "partial")."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_JOB_ERROR, f"{self.prog}: error: {message}\n")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds the job's arguments to ``parser`` (for ``vlmspec caption``'s subparser and the script)."""
    keep = argparse.SUPPRESS  # flags not given leave the config's value
    a = parser.add_argument
    a("input", help="a folder of videos, a glob (quote it) or a .jsonl/.csv manifest (path, prompt, id)")
    a("--out", help="output JSONL file (one line per video; resumed when it exists)")
    a("--config", help=f"job config YAML (default: {DEFAULT_CONFIG_PATH.relative_to(REPO_ROOT)})")
    a(
        "--target",
        default=keep,
        help="target folder or hub id, or a pair name: testbed-base@cpu (default), testbed-mini, tiny, ...",
    )
    a("--draft", default=keep, help="draft folder or hub id (not with testbed-*/tiny)")
    a("--family", default=keep, help="family of a named pair (default qwen2_vl)")
    a("--policy", default=keep, help="tree policy (default sage; ar: plain decoding)")
    a("--policy-options", default=keep, help="JSON object of policy options, e.g. '{\"n_max\": 32}'")
    a("--prompt", default=keep, help="prompt for videos without their own (manifest) prompt")
    a("--max-new-tokens", type=int, default=keep, help="most tokens per caption (default 256)")
    a("--num-frames", type=int, default=keep, help="frames sampled per video (default 8)")
    a(
        "--prune-ratio",
        type=float,
        default=keep,
        help="fraction of visual tokens the draft drops, applied as given (default: the library's, 0.9 for videos "
        "but never below 64 tokens)",
    )
    a("--frame-sampler", choices=FRAME_SAMPLERS, default=keep,
      help="decord (evenly, num_frames) or qwen (qwen-vl-utils; Qwen families); auto: qwen if a qwen option is set")  # fmt: skip
    a("--fps", type=float, default=keep, help="qwen sampler: frames per second to sample")
    a("--max-frames", type=int, default=keep, help="qwen sampler: most frames with --fps")
    a("--min-pixels", type=int, default=keep, help="qwen sampler: least pixels per frame")
    a("--max-pixels", type=int, default=keep, help="qwen sampler: most pixels per frame")
    a("--dtype", choices=DTYPES, default=keep, help="model dtype (default auto: the checkpoint's)")
    a(
        "--device-map",
        default=keep,
        help="device_map for from_pretrained, e.g. auto (a large target over GPUs)",
    )
    a("--cpu", action="store_true", help="keep the models on the CPU (also ACCELERATE_USE_CPU=1)")
    a("--extensions", default=keep, help="comma-separated video extensions for folder inputs")
    a("--retry-errors", action=argparse.BooleanOptionalAction, default=keep,
      help="on restart, retry videos that have an error line (default yes)")  # fmt: skip
    a(
        "--trace",
        action=argparse.BooleanOptionalAction,
        default=keep,
        help="keep the per-step trace in the stats",
    )
    a("--threads", type=int, default=keep, help="torch CPU threads per process")
    a("--progress", action=argparse.BooleanOptionalAction, default=keep, help="progress bar (default yes)")
    a("--batch-size", type=int, default=keep,
      help="videos decoded together (default: chosen from the cost probe, see pipe.default_batch_size)")  # fmt: skip
    return parser


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The config values given on the command line.

    Raises:
        JobError: ``--policy-options`` is not a JSON object.
    """
    values = {key: getattr(args, key) for key in JobConfig.field_names() if hasattr(args, key)}
    if "policy_options" in values:
        try:
            options = json.loads(values["policy_options"])
        except json.JSONDecodeError as err:
            raise JobError(
                f"--policy-options is not valid JSON ({err}): {values['policy_options']!r}"
            ) from err
        if not isinstance(options, dict):
            raise JobError(f"--policy-options must be a JSON object, got {values['policy_options']!r}")
        values["policy_options"] = options
    return values


def run_args(args: argparse.Namespace) -> int:
    """Runs the job from parsed arguments (see :func:`add_arguments`); returns the exit status.

    0: every video captioned; 2: some failed (error lines written); 1: the job could not run (message on stderr);
    130: interrupted (Ctrl-C; rerun the same command to resume).
    """
    try:
        config = load_config(args.config, overrides_from_args(args))
        if not args.out:
            raise JobError("--out is required: the output JSONL file")
        summary = run_job(config, args.input, args.out, cpu=args.cpu)
    except JobError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_JOB_ERROR
    except KeyboardInterrupt:  # finished lines are on disk already: say how to go on, no traceback
        print(f"\n{PROG}: interrupted; rerun the same command to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    if summary is None:  # not the main process: the main process reports
        return EXIT_OK
    print(summary.line(), flush=True)
    return summary.exit_code


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The job's argument parser (bad flags exit with status 1)."""
    description = (__doc__ or "").split("\n\n")[0]
    return add_arguments(_Parser(prog=prog, description=description))


def main(argv: Sequence[str] | None = None) -> int:
    """``python pipelines/video_captioning.py INPUT --out captions.jsonl [options]``; returns the exit status."""
    return run_args(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
