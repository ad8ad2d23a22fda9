"""``--model_args`` of the ``vlmspec`` lmms-eval model: parsing, validation and pair configs.

lmms-eval hands the model its ``--model_args key=value,...`` as keyword arguments (values already turned into
``bool``/``int``/``float`` where they look like one). :func:`parse_model_args` checks every key and value before
any model is loaded, so a typo fails in a second with a message naming it::

    --model_args target=Qwen/Qwen2.5-VL-7B-Instruct,draft=Qwen/Qwen2.5-VL-3B-Instruct,policy=sage
    --model_args config=qwen2_5_vl-7b-3b            # configs/models/qwen2_5_vl-7b-3b.yaml, same keys
    --model_args config=qwen2_5_vl-7b-3b,policy=ar  # keys given on the command line win over the config's
                                                    # (a given prune_ratio replaces the config's per-modality ones)

Pair configs (``configs/models/*.yaml``) hold the same keys as ``--model_args`` (flat mapping, loaded with
``yaml.safe_load``). Per-modality pruning is written ``image_prune_ratio``/``video_prune_ratio``;
``prune_ratio`` sets both. The options of the chosen policy's config (e.g. ``gamma`` for ``chain``, ``d_max``
for ``sage``) are valid keys too.

Special target names (no download, built locally on first use):

* ``testbed-mini`` / ``testbed-base`` (optionally ``:<family>``, default ``qwen2_vl``): the trained testbed pair
  of :mod:`vlmspec.testbed` (``pair_paths(size, family)``); the draft comes with it.
* ``tiny`` (optionally ``:<family>``): the tiny random pair of :mod:`vlmspec.testing` (machinery checks only).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vlmspec.named_pairs import DEFAULT_FAMILY, PAIR_NAMES, ResolvedPair, is_pair_name, split_calibration
from vlmspec.named_pairs import resolve_pair as resolve_named_pair

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
    "'@<calibration>', e.g. testbed-base@cpu)",
    "draft": "draft model of the same family (hub id or folder); not needed for policy=ar or the special targets",
    "policy": "tree policy (default sage); see vlmspec.policies.available_policies()",
    "prune_ratio": "fraction of visual tokens the draft drops, images and videos alike, in [0, 1)",
    "image_prune_ratio": "fraction of image tokens the draft drops, in [0, 1) (default 0.8)",
    "video_prune_ratio": "fraction of video tokens the draft drops, in [0, 1) (default 0.9)",
    "pruning": "how the draft picks visual tokens: attention (default) or uniform",
    "config": "a pair config: a YAML path or a name in configs/models/ (same keys as --model_args)",
    "dtype": "auto (checkpoint dtype, default), float32, bfloat16 or float16",
    "device_map": "passed to from_pretrained (e.g. auto to spread a large target over several GPUs)",
    "max_new_tokens": "upper bound on new tokens per request (the task's max_new_tokens is capped at it)",
    "num_frames": "frames sampled evenly from a video file (default 8)",
    "trust_remote_code": "run the checkpoints' own code (default false; only for checkpoints you trust)",
    "ar_reference": "output folder (or vlmspec_speed_<task>.json) of an earlier policy=ar run: measured speed-up",
    "speed_dir": "where vlmspec_speed_<task>.json files go (default: lmms-eval's --output_path)",
    "seed": "base seed of sampled generation (request seed = seed + doc_id; default 0)",
    "warmup": "one short generation before the first request, so its timing is not a cold start (default true)",
}
"""Every ``--model_args`` key with a one-line description (policy options come on top)."""

LMMS_EVAL_ARGS: tuple[str, ...] = ("batch_size", "max_batch_size", "device")
"""Keys lmms-eval itself passes to every model (from ``--batch_size``/``--device``)."""

DTYPES: dict[str, str] = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}
PRUNING_METHODS: tuple[str, ...] = ("attention", "uniform")
DEFAULT_IMAGE_PRUNE = 0.8  # SAGE's settings (the pipeline's defaults too)
DEFAULT_VIDEO_PRUNE = 0.9
SPECIAL_TARGETS: tuple[str, ...] = PAIR_NAMES

# Family by checkpoint name, most specific first.
_FAMILY_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("qwen3_vl", re.compile(r"qwen3[-_]vl", re.I)),
    ("qwen2_5_vl", re.compile(r"qwen2\.5[-_]vl|qwen2_5[-_]vl", re.I)),
    ("qwen2_vl", re.compile(r"qwen2[-_]vl", re.I)),
    ("llava_onevision", re.compile(r"llava[-_]onevision", re.I)),
)


@dataclass(frozen=True)
class ModelOptions:
    """Validated options of the ``vlmspec`` lmms-eval model (see :data:`MODEL_ARGS`)."""

    target: str
    draft: str | None = None
    policy: str = "sage"
    policy_options: dict[str, Any] = field(default_factory=dict)
    image_prune_ratio: float = DEFAULT_IMAGE_PRUNE
    video_prune_ratio: float = DEFAULT_VIDEO_PRUNE
    pruning: str = "attention"
    config: str | None = None
    dtype: str = "auto"
    device_map: str | None = None
    max_new_tokens: int | None = None
    num_frames: int = 8
    trust_remote_code: bool = False
    ar_reference: str | None = None
    speed_dir: str | None = None
    seed: int = 0
    warmup: bool = True
    batch_size: int | None = 1
    device: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping for logs and the speed files."""
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------
def parse_model_args(kwargs: Mapping[str, Any]) -> ModelOptions:
    """Check and convert the model's keyword arguments (``--model_args`` plus lmms-eval's own).

    Args:
        kwargs: ``key -> value`` as lmms-eval passes them; ``config`` names a pair config whose keys are used
            unless given here too.

    Returns:
        The validated :class:`ModelOptions`.

    Raises:
        ValueError: an unknown key (the message lists the valid ones), a bad value (the message names the key,
            the value and what is expected), a missing ``target``, or a config that cannot be used.
    """
    values = dict(kwargs)
    config = values.pop("config", None)
    if config is not None:
        values = _merge_config(load_pair_config(config), values)
    policy = _check_policy(values.get("policy", "sage"))
    policy_fields = _policy_fields(policy)
    _check_keys(values, policy, policy_fields)
    if values.get("target") in (None, ""):
        raise ValueError(
            "the vlmspec model needs target=... in --model_args (a hub id, a local folder, testbed-mini or tiny), "
            "or config=<pair config>"
        )
    _ratio("prune_ratio", values.get("prune_ratio"), 0.0)  # checked first so its errors name it
    policy_options = {k: values.pop(k) for k in list(values) if k in policy_fields}
    _check_policy_options(policy, policy_options)
    options = ModelOptions(
        target=_text("target", values["target"]),
        draft=_optional_text("draft", values.get("draft")),
        policy=policy,
        policy_options=policy_options,
        image_prune_ratio=_ratio(
            "image_prune_ratio", _first(values, "image_prune_ratio", "prune_ratio"), DEFAULT_IMAGE_PRUNE
        ),
        video_prune_ratio=_ratio(
            "video_prune_ratio", _first(values, "video_prune_ratio", "prune_ratio"), DEFAULT_VIDEO_PRUNE
        ),
        pruning=_choice("pruning", values.get("pruning", "attention"), PRUNING_METHODS),
        config=None if config is None else str(config),
        dtype=DTYPES[_choice("dtype", values.get("dtype", "auto"), tuple(DTYPES))],
        device_map=_optional_text("device_map", values.get("device_map")),
        max_new_tokens=_optional_positive_int("max_new_tokens", values.get("max_new_tokens")),
        num_frames=_positive_int("num_frames", values.get("num_frames", 8)),
        trust_remote_code=_bool("trust_remote_code", values.get("trust_remote_code", False)),
        ar_reference=_optional_text("ar_reference", values.get("ar_reference")),
        speed_dir=_optional_text("speed_dir", values.get("speed_dir")),
        seed=_int("seed", values.get("seed", 0)),
        warmup=_bool("warmup", values.get("warmup", True)),
        batch_size=_batch_size(values.get("batch_size", 1)),
        device=_optional_text("device", values.get("device")),
    )
    check_pair_families(options.target, options.draft)
    return options


def _merge_config(config: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """Config keys under the given ones; a given ``prune_ratio`` also replaces the config's per-modality ratios."""
    base = dict(config)
    if given.get("prune_ratio") is not None:
        base.pop("image_prune_ratio", None)
        base.pop("video_prune_ratio", None)
    return {**base, **given}


def _first(values: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if values.get(key) is not None:
            return values[key]
    return None


def _check_policy(policy: Any) -> str:
    from vlmspec.policies import available_policies

    names = available_policies()
    if not isinstance(policy, str) or policy not in names:
        raise ValueError(f"policy={policy!r} is not a vlmspec policy; valid policies: {', '.join(names)}")
    return policy


def _policy_fields(policy: str) -> set[str]:
    from vlmspec.policies import policy_class

    return {f.name for f in dataclasses.fields(policy_class(policy).config_class)}


def _check_keys(values: Mapping[str, Any], policy: str, policy_fields: set[str]) -> None:
    valid = set(MODEL_ARGS) | set(LMMS_EVAL_ARGS) | policy_fields
    unknown = sorted(k for k in values if k not in valid)
    if unknown:
        extra = f"; options of policy {policy!r}: {', '.join(sorted(policy_fields))}" if policy_fields else ""
        raise ValueError(
            f"unknown --model_args key(s) for the vlmspec model: {', '.join(unknown)}; valid keys: "
            f"{', '.join(MODEL_ARGS)}{extra}"
        )


def _check_policy_options(policy: str, options: dict[str, Any]) -> None:
    from vlmspec.policies import policy_class

    try:
        policy_class(policy).config_class.from_dict(options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad option for policy {policy!r} in --model_args: {err}") from err


# ---------------------------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------------------------
def _text(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float, Path)):
        raise ValueError(f"{key}={value!r} is invalid: expected a string")
    return str(value)


def _optional_text(key: str, value: Any) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return _text(key, value)


def _ratio(key: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise ValueError(
            f"{key}={value!r} is invalid: use a number in [0, 1) (the fraction of visual tokens the draft drops; "
            "0 keeps them all)"
        )
    return float(value)


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.lower() not in choices:
        raise ValueError(f"{key}={value!r} is invalid; valid values: {', '.join(choices)}")
    return value.lower()


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ValueError(f"{key}={value!r} is invalid: expected an integer")
    return value


def _positive_int(key: str, value: Any) -> int:
    number = _int(key, value)
    if number < 1:
        raise ValueError(f"{key}={value!r} is invalid: expected an integer >= 1")
    return number


def _optional_positive_int(key: str, value: Any) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return _positive_int(key, value)


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{key}={value!r} is invalid: expected true or false")


def _batch_size(value: Any) -> int | None:
    if value is None or isinstance(value, str) and value.startswith("auto"):
        return None  # the pipeline's choice (its cost probe)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return _positive_int("batch_size", value)


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
        ValueError: no such file; the message lists the configs found by name.
    """
    path = Path(str(config)).expanduser()
    if path.is_file():
        return path
    for folder in config_search_dirs():
        for candidate in (folder / str(config), folder / f"{config}.yaml", folder / f"{config}.yml"):
            if candidate.is_file():
                return candidate
    known = sorted({p.stem for d in config_search_dirs() if d.is_dir() for p in d.glob("*.yaml")})
    raise ValueError(
        f"config={config!r} is not a file nor a known pair config; known configs: {', '.join(known)}"
    )


def load_pair_config(config: str | Path) -> dict[str, Any]:
    """The keys of a pair config (``yaml.safe_load``), checked to be ``--model_args`` keys.

    Raises:
        ValueError: missing file, not a mapping, nested ``config``, or unknown keys (listing the valid ones).
    """
    path = resolve_config_path(config)
    try:
        values = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"pair config {str(path)!r} is not valid YAML: {err}") from err
    if not isinstance(values, dict):
        raise ValueError(
            f"pair config {str(path)!r} must be a mapping of --model_args keys, got {type(values).__name__}"
        )
    if "config" in values:
        raise ValueError(f"pair config {str(path)!r} must not name another config")
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
        ValueError: naming both checkpoints and their families.
    """
    if draft is None:
        return
    t_family, d_family = family_from_name(target), family_from_name(draft)
    if t_family and d_family and t_family != d_family:
        raise ValueError(
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
    """The folders (or hub ids) to load, building the testbed/tiny pair first when the target names one.

    Raises:
        ValueError: a policy that needs a draft without one, or an unknown family for a special target.
    """
    from vlmspec.policies import policy_class

    uses_draft = policy_class(options.policy).uses_draft
    if _special(options.target) is None and uses_draft and options.draft is None:
        raise ValueError(
            f"policy={options.policy!r} needs draft=... (a smaller checkpoint of the target's family); "
            "use policy=ar for the target alone"
        )
    pair = resolve_named_pair(options.target, options.draft)
    return pair if uses_draft else dataclasses.replace(pair, draft=None)
