"""``--model_args`` of the ``vlmspec`` lmms-eval model: one validated config (:class:`ModelOptions`) and pair configs.

lmms-eval hands the model its ``--model_args key=value,...`` as keyword arguments (values already turned into
``bool``/``int``/``float`` where they look like one). :func:`parse_model_args` checks every key and value before
any model is loaded, so a typo fails in a second with a message naming it::

    --model_args target=Qwen/Qwen2.5-VL-7B-Instruct,draft=Qwen/Qwen2.5-VL-3B-Instruct,policy=sage
    --model_args config=qwen2_5_vl-7b-3b            # configs/models/qwen2_5_vl-7b-3b.yaml, same keys
    --model_args config=qwen2_5_vl-7b-3b,policy=ar  # keys given on the command line win over the config's
                                                    # (a given prune_ratio replaces the config's per-modality ones,
                                                    # a given policy the config's options of its own policy)

Options are checked like the policies' configs: each value is converted to its field's declared type where its
text allows (``"8"`` -> ``8``, ``"true"`` -> ``True``, ``"none"`` -> ``None``), then
:func:`~vlmspec.validation.check_field_types` checks the types and :class:`ModelOptions` the ranges. The chosen
policy's options (e.g. ``gamma`` for ``chain``) are valid keys too, converted from its config's declarations.

Pair configs (``configs/models/*.yaml``) hold the same keys as ``--model_args`` (flat mapping, loaded with
``yaml.safe_load``). Per-modality pruning is written ``image_prune_ratio``/``video_prune_ratio``;
``prune_ratio`` sets both. A mistake in a config is reported with the config's path.

Special target names (no download, built locally on first use):

* ``testbed-mini`` / ``testbed-base`` (optionally ``:<family>``, default ``qwen2_vl``): the trained testbed pair
  of :mod:`vlmspec.testbed` (``pair_paths(size, family)``); the draft comes with it.
* ``tiny`` (optionally ``:<family>``): the tiny random pair of :mod:`vlmspec.testing` (machinery checks only).

A folder written by ``pipe.save_pretrained`` gives its pair (its ``target/`` and ``draft/``); the model runs it with
these options (policy, pruning, ...), not the settings saved with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from vlmspec.cli import json_object
from vlmspec.errors import InputNotFoundError, InvalidInputError
from vlmspec.named_pairs import (
    DEFAULT_FAMILY,
    HUB_ID,
    ResolvedPair,
    check_model_source,
    is_pair_name,
    is_pipeline_folder,
    split_calibration,
)
from vlmspec.named_pairs import resolve_pair as resolve_named_pair
from vlmspec.policies import PolicyConfig, available_policies, policy_class
from vlmspec.pruning import PruningMethod
from vlmspec.quantization import resolve_quantization_config
from vlmspec.reasoning import REASONING_PARSERS
from vlmspec.validation import check_field_types, coerce_fields

__all__ = [
    "MODEL_ARGS",
    "ModelOptions",
    "check_pair_families",
    "config_search_dirs",
    "family_from_name",
    "load_pair_config",
    "parse_model_args",
    "resolve_config_path",
    "resolve_pair",
]

MODEL_ARGS: dict[str, str] = {
    "target": "target model: hub id, local folder, testbed-mini / testbed-base / tiny (optionally ':<family>' and "
    "'@<calibration>', e.g. testbed-base@cpu), or a folder written by pipe.save_pretrained (its pair)",
    "draft": "draft model of the same family (hub id or folder); not needed for policy=ar or the special targets",
    "policy": "tree policy (default sage); see vlmspec.policies.available_policies()",
    "prune_ratio": "fraction of visual tokens the draft drops, images and videos alike, in [0, 1)",
    "image_prune_ratio": "fraction of image tokens the draft drops, in [0, 1) (default 0.8)",
    "video_prune_ratio": "fraction of video tokens the draft drops, in [0, 1) (default 0.9)",
    "pruning": "how the draft picks visual tokens: attention (default) or uniform",
    "config": "a pair config: a YAML path or a name in configs/models/ (same keys as --model_args)",
    "dtype": "auto (checkpoint dtype, default), float32 (fp32), bfloat16 (bf16) or float16 (fp16)",
    "device_map": "passed to from_pretrained (e.g. auto to spread a large target over several GPUs)",
    "quantization": "quantize the target as it loads: quanto-int8, torchao-int8, bnb-8bit or bnb-4bit; in a pair "
    "config also a transformers quantization config's dict (vlmspec.quantization; default none)",
    "draft_quantization": "quantize the draft as it loads (as quantization; default none)",
    "max_new_tokens": "upper bound on new tokens per request (the task's max_new_tokens is capped at it)",
    "num_frames": "frames sampled evenly from a video file (default 8)",
    "trust_remote_code": "run the checkpoints' own code (default false; only for checkpoints you trust)",
    "ar_reference": "output folder (or vlmspec_speed_<task>.json) of an earlier policy=ar run: measured speed-up",
    "speed_dir": "where vlmspec_speed_<task>.json files go (default: lmms-eval's --output_path)",
    "seed": "base seed of sampled generation (request seed = seed + doc_id; default 0)",
    "warmup": "one short generation before the first request, so its timing is not a cold start (default true)",
    "prefix_cache_gb": "memory for a prefix cache, so that requests starting as an earlier one did (several "
    "questions about one image) prefill only the rest (vlmspec.prefix_cache; default 0: none)",
    "reasoning_parser": "a thinking model's tags (qwen3, deepseek_r1): replies are scored on the answer after the "
    "reasoning (vlmspec.reasoning; default none: the whole reply)",
    "mm_processor_kwargs": "the processor's settings for every request's pictures and videos, a JSON object "
    '(mm_processor_kwargs={"max_pixels":401408}; vlmspec.processor_settings; default none)',
}
"""Every ``--model_args`` key with a one-line description (policy options come on top)."""

LMMS_EVAL_ARGS: tuple[str, ...] = ("batch_size", "max_batch_size", "device")
"""Keys lmms-eval itself passes to every model (from ``--batch_size``/``--device``; ``max_batch_size`` unused)."""

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
DTYPE_ALIASES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_IMAGE_PRUNE = 0.8  # SAGE's settings (the pipeline's defaults too)
DEFAULT_VIDEO_PRUNE = 0.9
_RATIO_NEED = "use a number in [0, 1) (the fraction of visual tokens the draft drops; 0 keeps them all)"

# Family by checkpoint name, most specific first.
_FAMILY_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("qwen3_vl", re.compile(r"qwen3[-_]vl", re.I)),
    ("qwen3_5", re.compile(r"qwen3\.5|qwen3_5", re.I)),  # also its mixture-of-experts sizes (qwen3_5_moe)
    ("qwen2_5_vl", re.compile(r"qwen2\.5[-_]vl|qwen2_5[-_]vl", re.I)),
    ("qwen2_vl", re.compile(r"qwen2[-_]vl", re.I)),
    ("llava_onevision", re.compile(r"llava[-_]onevision", re.I)),
    ("llava", re.compile(r"llava[-_]v?1\.5", re.I)),
    ("llava_next_video", re.compile(r"llava[-_]next[-_]video", re.I)),
    ("llava_next", re.compile(r"llava[-_]v1\.6|llava[-_]next", re.I)),
    ("internvl", re.compile(r"internvl", re.I)),
    ("gemma3", re.compile(r"gemma[-_]?3(?!n)", re.I)),  # not Gemma 3n, another architecture
    ("gemma4", re.compile(r"gemma[-_]?4", re.I)),
    ("smolvlm", re.compile(r"smolvlm2", re.I)),
    ("idefics3", re.compile(r"smolvlm(?!2)|idefics3", re.I)),  # SmolVLM (1) is Idefics3's architecture
    ("mistral3", re.compile(r"ministral[-_]3[-_]|mistral[-_]small[-_]3\.[12]", re.I)),  # the vision ones
    ("glm46v", re.compile(r"glm[-_]4\.6v", re.I)),
    ("glm4v_moe", re.compile(r"glm[-_]4\.5v", re.I)),
    ("glm4v", re.compile(r"glm[-_]4\.1v", re.I)),
    ("aya_vision", re.compile(r"aya[-_]vision", re.I)),
    ("ovis2", re.compile(r"ovis2(?![.\d])", re.I)),  # not Ovis2.5, another architecture
    ("janus", re.compile(r"janus", re.I)),
    ("deepseek_vl", re.compile(r"deepseek[-_]vl(?![-_]?2)", re.I)),  # not DeepSeek-VL2, another architecture
    ("video_llama_3", re.compile(r"video[-_]?llama[-_]?3", re.I)),
    ("perception_lm", re.compile(r"perception[-_]?lm", re.I)),
    ("lfm2_vl", re.compile(r"lfm2(\.5)?[-_]vl", re.I)),  # LFM2-VL and LFM2.5-VL
    ("lfm3_vl", re.compile(r"lfm3[-_]vl", re.I)),
    ("minicpmv4_6", re.compile(r"minicpm[-_]?v[-_]?4\.6", re.I)),
    ("minicpmv4_7", re.compile(r"minicpm[-_]?v[-_]?4\.7", re.I)),
    ("fast_vlm", re.compile(r"fast[-_]?vlm", re.I)),
)


@dataclass(frozen=True)
class ModelOptions:
    """Options of the ``vlmspec`` lmms-eval model (see :data:`MODEL_ARGS`), checked on construction: types from the
    declarations, then ranges, the policy and its options, the pair's families (each error an
    :class:`~vlmspec.errors.InvalidInputError` naming the key, the value and what is allowed)."""

    target: str = ""
    draft: str | None = None
    policy: str = "sage"
    policy_options: dict[str, Any] = field(default_factory=dict)
    prune_ratio: float | None = None
    """Set for both modalities when given (:func:`parse_model_args` copies it into the ratios not given)."""
    image_prune_ratio: float = DEFAULT_IMAGE_PRUNE
    video_prune_ratio: float = DEFAULT_VIDEO_PRUNE
    pruning: PruningMethod = "attention"
    config: str | None = None
    dtype: Dtype = "auto"
    device_map: str | None = None
    quantization: str | dict[str, Any] | None = None
    draft_quantization: str | dict[str, Any] | None = None
    max_new_tokens: int | None = None
    num_frames: int = 8
    trust_remote_code: bool = False
    ar_reference: str | None = None
    speed_dir: str | None = None
    seed: int = 0
    warmup: bool = True
    prefix_cache_gb: float = 0.0
    reasoning_parser: str | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    batch_size: int | None = 1
    """Requests decoded together; ``None`` (lmms-eval's ``auto``): the pipeline's choice."""
    device: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        if not self.target:
            raise InvalidInputError(
                "the vlmspec model needs target=... in --model_args (a hub id, a local folder, testbed-mini or "
                "tiny), or config=<pair config>"
            )
        config_class = _policy_config_class(self.policy)
        for name in ("prune_ratio", "image_prune_ratio", "video_prune_ratio"):
            value = getattr(self, name)
            _check(value is None or 0.0 <= value < 1.0, name, value, _RATIO_NEED)
        _check(
            0.0 <= self.prefix_cache_gb < float("inf"),
            "prefix_cache_gb",
            self.prefix_cache_gb,
            "use GiB >= 0",
        )
        known = ", ".join(REASONING_PARSERS)
        _check(
            self.reasoning_parser in (None, *REASONING_PARSERS),
            "reasoning_parser",
            self.reasoning_parser,
            f"use one of {known}",
        )
        for name in ("max_new_tokens", "num_frames"):
            value = getattr(self, name)
            _check(value is None or value >= 1, name, value, "expected an integer >= 1")
        for name in ("quantization", "draft_quantization"):  # read as from_pretrained will, before any load
            resolve_quantization_config(getattr(self, name), name)
        if self.batch_size is not None and self.batch_size < 1:
            raise InvalidInputError(
                f"lmms-eval's --batch_size {self.batch_size} is invalid: give an integer >= 1, or auto for the "
                "pipeline's choice"
            )
        try:
            config_class.from_dict(self.policy_options)
        except (TypeError, ValueError) as err:
            lists = (
                " (--model_args splits at commas: give a list option in a config= YAML)"
                if "a list" in str(err)
                else ""
            )
            raise InvalidInputError(
                f"bad option for policy {self.policy!r} in --model_args: {err}{lists}"
            ) from err
        check_pair_families(self.target, self.draft)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping for logs and the speed files."""
        return dataclasses.asdict(self)


def _check(ok: bool, key: str, value: Any, need: str) -> None:
    if not ok:
        raise InvalidInputError(f"{key}={value!r} is invalid: {need}")


# ---------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------
def parse_model_args(kwargs: Mapping[str, Any]) -> ModelOptions:
    """Check and convert the model's keyword arguments (``--model_args`` plus lmms-eval's own).

    Args:
        kwargs: ``key -> value`` as lmms-eval passes them (text or already converted); ``config`` names a pair
            config whose keys are used unless given here too.

    Returns:
        The validated :class:`ModelOptions`.

    Raises:
        InvalidInputError: an unknown key (the message lists the valid ones), a bad value (the message names the
            key, the value and what is expected), a missing ``target``, or a config that cannot be used.
    """
    values = _coerced(kwargs)
    if values.get("config") is None:
        return _options(values)
    path = resolve_config_path(values["config"])
    config = _coerced(load_pair_config(path))
    merged = _merge_pair_config(config, values)
    try:
        return _options(merged)
    except InvalidInputError as err:
        _blame_pair_config(path, config, merged)
        raise err


def _coerced(values: Mapping[str, Any]) -> dict[str, Any]:
    values = dict(values)
    # lmms-eval's --batch_size auto[:N]: the pipeline's choice (its cost probe)
    if isinstance(values.get("batch_size"), str) and values["batch_size"].startswith("auto"):
        values["batch_size"] = None
    if isinstance(values.get("mm_processor_kwargs"), str):  # a JSON object on the command line
        try:
            values["mm_processor_kwargs"] = json_object("mm_processor_kwargs", '{"max_pixels":401408}')(
                values["mm_processor_kwargs"]
            )
        except argparse.ArgumentTypeError as err:
            raise InvalidInputError(str(err)) from None
    return coerce_fields(ModelOptions, values)


def _merge_pair_config(config: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A pair config's keys under the given ones. A given ``prune_ratio`` also replaces the config's per-modality
    ratios, and a given ``policy`` drops the config's options of its own policy that the given one does not take
    (``gamma`` of a ``chain`` config under ``policy=sage``)."""
    if given.get("prune_ratio") is not None:
        config = {k: v for k, v in config.items() if k not in ("image_prune_ratio", "video_prune_ratio")}
    own_policy, policy = config.get("policy", "sage"), given.get("policy")
    if policy is not None and policy != own_policy and own_policy in available_policies():
        dropped = _policy_fields(own_policy) - _policy_fields(policy)
        config = {k: v for k, v in config.items() if k not in dropped}
    return {**config, **given}


def _blame_pair_config(path: Path, config: dict[str, Any], merged: dict[str, Any]) -> None:
    """Raise naming the pair config file when the config, with the run's target and draft, is invalid on its own:
    the fault is then the file's, not the command line's."""
    alone = {**config, "target": config.get("target", merged.get("target")), "config": None}
    alone.setdefault("draft", merged.get("draft"))
    try:
        _options(alone)
    except InvalidInputError as err:
        raise InvalidInputError(f"pair config {str(path)!r}: {err}") from err


def _options(values: dict[str, Any]) -> ModelOptions:
    values = dict(values)
    policy = values.get("policy", "sage")
    config_class = _policy_config_class(policy)
    policy_fields = [f.name for f in dataclasses.fields(config_class)]
    _check_keys(values, policy, policy_fields)
    policy_options = coerce_fields(
        config_class, {k: values.pop(k) for k in list(values) if k in policy_fields}
    )
    values.pop("max_batch_size", None)
    for key in ("image_prune_ratio", "video_prune_ratio"):
        if values.get(key) is None and values.get("prune_ratio") is not None:
            values[key] = values["prune_ratio"]
    if isinstance(values.get("dtype"), str):
        values["dtype"] = DTYPE_ALIASES.get(values["dtype"].lower(), values["dtype"])
    return ModelOptions(**{**values, "policy_options": policy_options})


def _policy_fields(policy: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(_policy_config_class(policy))}


def _policy_config_class(policy: Any) -> type[PolicyConfig]:
    names = available_policies()
    if not isinstance(policy, str) or policy not in names:
        raise InvalidInputError(
            f"policy={policy!r} is not a vlmspec policy; valid policies: {', '.join(names)}"
        )
    return policy_class(policy).config_class


def _check_keys(values: Mapping[str, Any], policy: str, policy_fields: list[str]) -> None:
    unknown = sorted(k for k in values if k not in {*MODEL_ARGS, *LMMS_EVAL_ARGS, *policy_fields})
    if unknown:
        extra = f"; options of policy {policy!r}: {', '.join(sorted(policy_fields))}" if policy_fields else ""
        spaced = [k for k in unknown if k != k.strip()]
        hint = f" ({', '.join(map(repr, spaced))}: remove the spaces around '=' and ',')" if spaced else ""
        raise InvalidInputError(
            f"unknown --model_args key(s) for the vlmspec model: {', '.join(map(repr, unknown))}{hint}; valid keys: "
            f"{', '.join(MODEL_ARGS)}{extra}"
        )


# ---------------------------------------------------------------------------------------------------------------
# Pair configs
# ---------------------------------------------------------------------------------------------------------------
def config_search_dirs() -> list[Path]:
    """Folders searched for a config given by name: ``./configs/models`` and the repository's ``configs/models``."""
    repo = Path(__file__).resolve().parents[3]
    dirs = [Path.cwd() / "configs" / "models", repo / "configs" / "models"]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def resolve_config_path(config: str | Path) -> Path:
    """The YAML file of a pair config given as a path or a name (``qwen2_5_vl-7b-3b``).

    Raises:
        InvalidInputError: no such file; the message lists the configs found by name.
    """
    path = Path(str(config)).expanduser()
    if path.is_file():
        return path
    for folder in config_search_dirs():
        for candidate in (folder / str(config), folder / f"{config}.yaml", folder / f"{config}.yml"):
            if candidate.is_file():
                return candidate
    known = sorted({p.stem for d in config_search_dirs() if d.is_dir() for p in d.glob("*.yaml")})
    raise InvalidInputError(
        f"config={config!r} is not a file nor a known pair config; known configs: {', '.join(known)}"
    )


def load_pair_config(config: str | Path) -> dict[str, Any]:
    """The keys of a pair config (``yaml.safe_load``; :func:`parse_model_args` checks them).

    Raises:
        InvalidInputError: missing file, not YAML, not a mapping, or a nested ``config``.
    """
    path = resolve_config_path(config)
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise InvalidInputError(f"pair config {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(values, dict):
        raise InvalidInputError(
            f"pair config {str(path)!r} must be a mapping of --model_args keys, got {type(values).__name__}"
        )
    if "config" in values:
        raise InvalidInputError(f"pair config {str(path)!r} must not name another config")
    return values


def family_from_name(name: str | Path | None) -> str | None:
    """The model family a checkpoint name or special target implies (``None`` when the name does not say).

    Examples: ``Qwen/Qwen2.5-VL-7B-Instruct`` -> ``qwen2_5_vl``; ``llava-hf/llava-onevision-qwen2-7b-ov-hf`` ->
    ``llava_onevision``; ``testbed-mini`` -> ``qwen2_vl``; ``tiny:qwen3_vl`` -> ``qwen3_vl``.
    """
    if name is None:
        return None
    text = str(name)
    special = _special(text)
    if special is not None:
        return special[1]
    for family, pattern in _FAMILY_PATTERNS:
        if pattern.search(text):
            return family
    return None


def check_pair_families(target: str, draft: str | None) -> None:
    """Refuse a target/draft pair whose names say they are of different families.

    Raises:
        InvalidInputError: naming both checkpoints and their families.
    """
    if draft is None:
        return
    t_family, d_family = family_from_name(target), family_from_name(draft)
    if t_family and d_family and t_family != d_family:
        raise InvalidInputError(
            f"target={target!r} is a {t_family} model but draft={draft!r} is a {d_family} model; the draft must be a "
            "smaller checkpoint of the target's family"
        )


def _special(target: str) -> tuple[str, str] | None:
    """``(name, family)`` for a pair name (``testbed-mini[:family]``, ``tiny[:family]``, ...), else ``None``."""
    if not is_pair_name(target):
        return None
    name, _, family = split_calibration(target)[0].partition(":")
    return name, family or DEFAULT_FAMILY


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------
def resolve_pair(options: ModelOptions) -> ResolvedPair:
    """The folders (or hub ids) to load, building the testbed/tiny pair first when the target names one; a folder
    written by ``pipe.save_pretrained`` gives its pair (run with these options, not its saved settings).

    Raises:
        InvalidInputError: a policy that needs a draft without one, or an unknown family for a special target.
    """
    uses_draft = policy_class(options.policy).uses_draft
    saved = is_pipeline_folder(options.target)
    if _special(options.target) is None and not saved:
        _check_target(options.target)
    if _special(options.target) is None and not saved and uses_draft and options.draft is None:
        raise InvalidInputError(
            f"policy={options.policy!r} needs draft=... (a smaller checkpoint of the target's family); "
            "use policy=ar for the target alone"
        )
    pair = resolve_named_pair(options.target, options.draft)
    if uses_draft and pair.draft is None:  # a saved pipeline without a draft
        raise InvalidInputError(
            f"policy={options.policy!r} needs a draft, but the saved pipeline {options.target!r} holds no draft/: "
            "give draft=... or use policy=ar"
        )
    return pair if uses_draft else dataclasses.replace(pair, draft=None)


def _check_target(target: str) -> None:
    """A mistyped target is named before the draft's absence is: a bare word that is no pair name, or a path that
    does not exist."""
    check_model_source(target, "target")
    if not HUB_ID.fullmatch(target) and not Path(target).expanduser().exists():
        raise InputNotFoundError(
            f"target {target!r} does not exist: give a model folder, a saved pipeline folder, a pair name or a hub id"
        )
