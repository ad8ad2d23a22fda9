"""The job's settings: :class:`JobConfig`, read from YAML (``yaml.safe_load``) and the command line, checked by
type from its declarations (:mod:`vlmspec.validation`) and by range."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from vlmspec.errors import VLMSpecError
from vlmspec.processor_settings import check_settings_form
from vlmspec.quantization import means_none, resolve_quantization_config
from vlmspec.reasoning import NO_PARSER, PARSER_NAMES
from vlmspec.structured_outputs import StructuredOutputs
from vlmspec.validation import check_field_types

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG_PATH = REPO_ROOT / "configs" / "jobs" / "video_captioning.yaml"
"""The documented defaults in a source checkout; an installed wheel has none and uses :class:`JobConfig`'s own
(the same values: a test keeps them equal)."""
PROG = "vlmspec caption"

MIN_FRAME_PIXELS = 32 * 32
"""The fewest pixels a frame may be resized to (``max_pixels``): one merged patch of the largest family (Qwen3-VL:
32 x 32); below it the qwen sampler resizes frames to nothing."""
DEFAULT_POLICY = "sage"
"""The policy when the config names none and the target is not a saved pipeline (which brings its own)."""
EXIT_OK = 0
EXIT_JOB_ERROR = 1
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C
EXIT_PARTIAL = 2

VIDEO_EXTENSIONS: tuple[str, ...] = (
    ".mp4", ".mkv", ".mov", ".avi", ".webm", ".m4v", ".mpg", ".mpeg", ".flv", ".wmv", ".ts", ".3gp",
)  # fmt: skip
IMAGE_EXTENSIONS: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
"""Files captioned as pictures (with ``image_prompt``); every other file is read as a video."""
EXTENSION_GROUPS: dict[str, tuple[str, ...]] = {"videos": VIDEO_EXTENSIONS, "images": IMAGE_EXTENSIONS}
"""Names ``extensions`` may give for a group of extensions (``--extensions images``, ``videos,images``)."""
FrameSampler = Literal["auto", "decord", "qwen"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
FRAME_SAMPLERS: tuple[str, ...] = get_args(FrameSampler)
DTYPES: tuple[str, ...] = get_args(Dtype)


class JobError(VLMSpecError):
    """The job itself cannot run (bad config, missing input, unloadable model): exit status 1."""


def json_object(text: str, where: str) -> dict[str, Any]:
    """``text`` as a JSON object; a :class:`JobError` naming ``where`` otherwise."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise JobError(f"{where} is not valid JSON ({err}): {text[:80]!r}") from err
    if not isinstance(value, dict):
        raise JobError(f"{where} must be a JSON object, got {type(value).__name__}: {text[:80]!r}")
    return value


@dataclass(frozen=True)
class JobConfig:
    """The job's settings (``configs/jobs/video_captioning.yaml``; see that file for what each key means)."""

    target: str | None = None
    draft: str | None = None
    family: str = "qwen2_vl"
    dtype: Dtype = "auto"
    device_map: str | None = None
    quantization: str | dict[str, Any] | None = None
    draft_quantization: str | dict[str, Any] | None = None
    policy: str | None = None
    policy_options: dict[str, Any] = field(default_factory=dict)
    prune_ratio: float | None = None
    prompt: str = "Describe this video in detail."
    image_prompt: str = "Describe this image in detail."
    max_new_tokens: int = 256
    num_frames: int = 8
    segment: float | None = None
    frame_sampler: FrameSampler = "auto"
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
    structured_outputs: dict[str, Any] | None = None
    reasoning_parser: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The valid config keys."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, values: dict[str, Any], source: str, flags: bool = False) -> JobConfig:
        """A checked config from a mapping of keys to values.

        Args:
            values: config keys and values (YAML or command line).
            source: where they come from, for messages.
            flags: name the settings as the command line's flags (:meth:`validated`).

        Raises:
            JobError: an unknown key, a value of the wrong type or out of range.
        """
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise JobError(
                f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(cls.field_names())}"
            )
        values = dict(values)
        if isinstance(values.get("extensions"), (str, list, tuple)):
            values["extensions"] = _extensions(values["extensions"], source)
        for name in ("quantization", "draft_quantization"):  # `--quantization none` over a config file's
            if name in values and means_none(values[name]):
                values[name] = None
        for name in ("prune_ratio", "fps", "segment"):  # numbers: an integer is the same number
            if isinstance(values.get(name), int) and not isinstance(values[name], bool):
                values[name] = float(values[name])
        config = cls(**values)
        try:
            check_field_types(config)
        except ValueError as err:
            raise JobError(f"{source}: {err}") from None
        return config.validated(source, flags)

    def validated(self, source: str = "config", flags: bool = False) -> JobConfig:
        """Checks ranges and choices; returns ``self``.

        Args:
            source: where the values come from, for messages.
            flags: name the settings as the command line's flags (``--batch-size``), not as config keys.

        Raises:
            JobError: naming the key (or flag) and what is allowed.
        """
        key = (lambda name: "--" + name.replace("_", "-")) if flags else (lambda name: name)
        problems = []
        for name in ("max_new_tokens", "num_frames"):
            if getattr(self, name) < 1:
                problems.append(f"{key(name)} must be >= 1, got {getattr(self, name)}")
        if self.prune_ratio is not None and not 0 <= self.prune_ratio < 1:
            problems.append(f"{key('prune_ratio')} must be in [0, 1), got {self.prune_ratio}")
        for name in ("fps", "segment"):  # seconds and rates: nan and inf pass a plain `<= 0` check
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                problems.append(f"{key(name)} must be a finite number > 0, got {value}")
        for name in ("max_frames", "min_pixels", "max_pixels", "threads", "batch_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{key(name)} must be > 0, got {value}")
        if self.max_frames is not None and self.max_frames < 2:
            problems.append(
                f"{key('max_frames')} must be >= 2 (qwen-vl-utils samples frames in pairs), got {self.max_frames}"
            )
        if self.sampler == "qwen" and self.num_frames < 2 and self.fps is None:
            problems.append(
                f"{key('num_frames')} must be >= 2 with the qwen frame sampler (it samples pairs)"
            )
        if self.max_pixels is not None and 0 < self.max_pixels < MIN_FRAME_PIXELS:
            problems.append(
                f"{key('max_pixels')} must be at least {MIN_FRAME_PIXELS} (one merged 32 x 32 patch), got {self.max_pixels}"
            )
        if self.fps is not None and self.frame_sampler == "decord":
            problems.append(f"{key('fps')} is the qwen frame sampler's; decord samples num_frames evenly")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            problems.append(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
        if not self.extensions:
            problems.append(f"{key('extensions')} must name at least one file extension")
        try:
            StructuredOutputs.of(self.structured_outputs)
        except VLMSpecError as err:
            problems.append(f"{key('structured_outputs')}: {err}")
        if self.reasoning_parser not in (None, *PARSER_NAMES):
            known = ", ".join(PARSER_NAMES)
            problems.append(
                f"{key('reasoning_parser')} must be one of {known}, got {self.reasoning_parser!r}"
            )
        try:  # what the processor takes is known once the models load
            check_settings_form(self.mm_processor_kwargs, key("mm_processor_kwargs"))
        except VLMSpecError as err:
            problems.append(str(err))
        for name in ("quantization", "draft_quantization"):
            try:  # a name or a config's dict, read as from_pretrained will
                resolve_quantization_config(getattr(self, name), key(name))
            except VLMSpecError as err:
                problems.append(str(err))
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
        if self.structured_outputs is not None:
            out["structured_outputs"] = self.structured_outputs
        if self.reasoning_parser not in (None, NO_PARSER):  # "none" drops a saved one: no parser either way
            out["reasoning_parser"] = self.reasoning_parser
        if self.mm_processor_kwargs:
            out["mm_processor_kwargs"] = dict(self.mm_processor_kwargs)
        for name in ("quantization", "draft_quantization"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.sampler == "qwen":
            out.update(
                fps=self.fps,
                max_frames=self.max_frames,
                min_pixels=self.min_pixels,
                max_pixels=self.max_pixels,
            )
        return out


def _extensions(value: str | Sequence[Any], source: str) -> tuple[str, ...]:
    """File extensions, lower case with the dot; a group's name (:data:`EXTENSION_GROUPS`) stands for its own."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise JobError(
                f"{source}: extensions must be strings like '.mp4' (or 'videos', 'images'), got {item!r}"
            )
        item = item.strip().lower()
        if item in EXTENSION_GROUPS:
            out += EXTENSION_GROUPS[item]
        elif item:
            out.append(item if item.startswith(".") else f".{item}")
    return tuple(dict.fromkeys(out))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML config file (``yaml.safe_load``).

    Raises:
        JobError: the file is missing, not YAML, or not a mapping.
    """
    file = Path(path)
    if file.is_dir():
        raise JobError(f"config file {str(file)!r} is a folder: give the YAML file itself")
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
    if not overrides:
        return JobConfig.from_mapping(values, source)
    JobConfig.from_mapping(overrides, "command line", flags=True)  # the flags' own mistakes, named as flags
    values.update(overrides)
    return JobConfig.from_mapping(values, f"{source} with command-line flags")
