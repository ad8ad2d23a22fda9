"""A pipeline saved to a folder and loaded back: the pair, and the settings a user chose.

``pipe.save_pretrained(folder)`` writes::

    folder/
      target/                  the target (save_pretrained) and its processor
      draft/                   the draft (with the target's tokenizer; an EDD draft in its own format)
      vlmspec_pipeline.yaml    the policy, the options the user set, the pruning

``VLMSpecPipeline.from_pretrained(folder)`` and ``vlmspec demo --target folder`` load it back; every other entry
point that takes a target (``bench``, ``caption``, lmms-eval's ``target=``) takes its pair. Options the user left to the machine (node budget,
depth, PCT's cost ratio) are not saved: they are fitted again, by the cost probe, on the machine that loads it.
"""

from __future__ import annotations

import dataclasses
import numbers
import shutil
from pathlib import Path
from typing import Any

import yaml

from .errors import InvalidInputError
from .models import EDDDraft
from .named_pairs import PIPELINE_FILE, is_pipeline_folder
from .pruning import PruningConfig

SETTINGS = ("policy", "policy_options", "pruning")


def save_pipeline(pipe: Any, folder: str | Path) -> Path:
    """Write ``pipe``'s pair and settings into ``folder`` (see the module docstring); returns the folder.

    A folder that holds an earlier save is replaced; any other non-empty folder is refused.

    Raises:
        ValueError: ``folder`` exists, is not empty and is not a saved pipeline.
    """
    folder = Path(folder)
    settings = yaml.safe_dump(
        _plain(
            {
                "policy": pipe.policy.name,
                "policy_options": pipe.policy.requested,
                "pruning": dataclasses.asdict(pipe.pruning),
            }
        ),
        sort_keys=False,
    )  # first, so that a value YAML cannot hold fails before anything is written
    if folder.exists() and any(folder.iterdir()) and not is_pipeline_folder(folder):
        raise InvalidInputError(
            f"{str(folder)!r} is not empty and holds no saved pipeline; save into a new or empty folder"
        )
    for part in ("target", "draft", PIPELINE_FILE):  # an earlier save's parts go first
        path = folder / part
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    folder.mkdir(parents=True, exist_ok=True)
    pipe.target.save_pretrained(folder / "target")
    pipe.processor.save_pretrained(folder / "target")
    if pipe.draft is not None:
        pipe.draft.save_pretrained(folder / "draft")
        if not isinstance(pipe.draft, EDDDraft):  # the pair passed the vocabulary check: the tokenizers agree
            pipe.tokenizer.save_pretrained(folder / "draft")
    (folder / PIPELINE_FILE).write_text(settings)
    return folder


def read_settings(folder: str | Path) -> dict[str, Any]:
    """The settings of a saved pipeline: ``policy`` (a name), ``policy_options`` (a dict), ``pruning`` (a
    :class:`~vlmspec.pruning.PruningConfig`).

    Raises:
        ValueError: the file is not YAML, not a mapping, has unknown keys or values of the wrong kind (named).
    """
    file = Path(folder) / PIPELINE_FILE
    where = f"saved pipeline settings {str(file)!r}"
    try:
        values = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise InvalidInputError(f"{where} could not be read as YAML: {err}") from err
    if not isinstance(values, dict) or set(values) - set(SETTINGS):
        raise InvalidInputError(
            f"{where} must be a mapping with the keys {', '.join(SETTINGS)}, got {values!r:.120}"
        )
    policy, options, pruning = (values.get(key) for key in SETTINGS)
    if (
        not isinstance(policy, str)
        or not isinstance(options or {}, dict)
        or not isinstance(pruning or {}, dict)
    ):
        raise InvalidInputError(
            f"{where}: policy must be a name, policy_options and pruning mappings; got {values!r:.120}"
        )
    try:
        pruning_config = PruningConfig(**(pruning or {}))
    except TypeError as err:
        raise InvalidInputError(f"{where}: pruning: {err}") from None
    return {"policy": policy, "policy_options": dict(options or {}), "pruning": pruning_config}


def _plain(value: Any) -> Any:
    """Tuples as lists and numbers (numpy's too) as Python's, recursively: what ``yaml.safe_dump`` writes and the
    configs read back."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value
