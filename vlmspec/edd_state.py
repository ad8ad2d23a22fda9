"""What ``vlmspec edd train`` keeps in ``--out`` between runs: the self-distillation data, keyed by everything
that shapes it, and crash-safe checkpoints that record the settings that shape training.

::

    out/
        data.safetensors           the target's replies; its metadata holds the key of the inputs that made it
        data-parts/                while the replies are generated: one file per example done (resumable)
        checkpoint/progress.json   the commit point: {"step", "folder", "settings", "param_groups"}
        checkpoint/step-00000012/  edd_config.json, model.safetensors, optimizer.safetensors of that step
        edd_config.json, model.safetensors   the final draft

**Atomicity.** Every file is written under a temporary name, fsynced, and renamed into place (then its folder
fsynced, as the caption store does). A checkpoint is first written whole into a new ``step-N`` folder; only then
is ``progress.json`` replaced (one atomic rename) to point at it, and only after that are older step folders
removed. A crash at any moment leaves ``progress.json`` pointing at a complete checkpoint: the old one or the new.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .artifacts import fsync_dir, write_atomic
from .errors import InvalidInputError, VLMSpecError

DATA_NAME = "data.safetensors"
DATA_PARTS = "data-parts"
CHECKPOINT = "checkpoint"
PROGRESS = "progress.json"
OPTIMIZER = "optimizer.safetensors"
_TMP = ".tmp-"
#: What ``--out`` may hold before a run: this job's own files (a run to resume, a draft to replace).
OWN_FILES = frozenset({DATA_NAME, DATA_PARTS, CHECKPOINT, "edd_config.json", "model.safetensors"})


class CheckpointError(VLMSpecError, ValueError):
    """A checkpoint in ``--out`` cannot be resumed: damaged, or from a run with other settings."""


# ---- atomic writes -------------------------------------------------------------------------------------------------
def write_json_atomic(path: Path, value: Any) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(json.dumps(value, sort_keys=True)))


def read_json(path: Path) -> Any:
    """``path``'s JSON value (``None``: no file, or not JSON)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def check_out_folder(out: Path) -> None:
    """Refuse an ``--out`` that holds other things than this job's own files (as ``pipe.save_pretrained`` does).

    Raises:
        InvalidInputError: naming the folder, the foreign entries and what to do.
    """
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in OWN_FILES and not p.name.startswith(_TMP))
    if foreign:
        raise InvalidInputError(
            f"--out {str(out)!r} is not empty and holds no EDD training run (it holds {foreign[:5]}): give a new "
            "or empty folder, or one an earlier `vlmspec edd train` wrote"
        )


# ---- the self-distillation data's key ------------------------------------------------------------------------------
def _media_identity(media: Any) -> Any:
    """A JSON-able identity of an image/video input: a file's path, size and modification time; an in-memory
    picture's or array's content digest."""
    if media is None:
        return None
    if isinstance(media, list | tuple):
        return [_media_identity(item) for item in media]
    if isinstance(media, str | os.PathLike):
        path = Path(media)
        if path.is_file():
            stat = path.stat()
            return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]
        return str(media)  # a URL or a missing file (the target's processor reports those)
    if hasattr(media, "tobytes"):  # PIL pictures, numpy arrays
        head = [type(media).__name__, str(getattr(media, "mode", "")), str(getattr(media, "size", ""))]
        return [*head, str(getattr(media, "shape", "")), hashlib.sha256(media.tobytes()).hexdigest()]
    if torch.is_tensor(media):
        return [
            "tensor",
            list(media.shape),
            hashlib.sha256(media.detach().cpu().numpy().tobytes()).hexdigest(),
        ]
    return repr(media)


def data_key(examples: Sequence[Any], settings: dict[str, Any]) -> str:
    """A digest of every input that shapes the self-distillation data: each example's prompt and media identity
    (order included) and ``settings`` (target layer, reply length, kept top-k, the target's dtype)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for example in examples:
        row = [example.prompt, _media_identity(example.image), _media_identity(example.video)]
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def stored_data_key(path: Path) -> str | None:
    """The key recorded in ``data.safetensors`` (``None``: no file, an older or unreadable one)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as handle:
            raw = (handle.metadata() or {}).get("meta")
        return json.loads(raw).get("key") if raw else None
    except Exception:  # a torn or foreign file: regenerated, never trusted
        return None


# ---- checkpoints ---------------------------------------------------------------------------------------------------
#: Settings a checkpoint records, compared on resume, with the flag that sets each.
SETTING_FLAGS = {
    "lr": "--lr",
    "weight_decay": "--weight-decay",
    "batch_size": "--batch-size",
    "block_min": "--block-min",
    "block_max": "--block-max",
    "epochs": "--epochs",
    "seed": "--seed",
    "use_hidden": "--no-hidden",
    "hidden_layer": "--hidden-layer",
    "data": "--data, --examples, --seed, --max-new-tokens, --teacher-top-k, --dtype or the target",
}


def training_settings(config: Any, layer: int, key: str) -> dict[str, Any]:
    """The settings that shape the trained weights, recorded in a checkpoint and compared on resume.

    - ``lr``, ``weight_decay``: AdamW's; a checkpoint's optimizer state carries its own, so a resume with others
      would silently train with the old ones.
    - ``batch_size``, ``epochs``, ``seed``: the steps (which examples, in which order); a resumed run only equals
      an uninterrupted one with the same list of steps (fewer epochs could not rewind past the checkpoint).
    - ``block_min``, ``block_max``: the block lengths drawn at every step.
    - ``use_hidden``: what the draft reads (hidden states or token embeddings); mixing the two is neither model.
    - ``hidden_layer`` (resolved): which target layer the soft prompt comes from.
    - ``data``: the self-distillation data's key (:func:`data_key`: examples, reply length, top-k, dtype).

    Not recorded: ``checkpoint_every`` (when checkpoints are written changes no weight) and ``max_new_tokens`` /
    ``teacher_top_k`` on their own (they are in ``data``).
    """
    return {
        "lr": float(config.lr),
        "weight_decay": float(config.weight_decay),
        "batch_size": config.batch_size,
        "block_min": config.block_min,
        "block_max": config.block_max,
        "epochs": config.epochs,
        "seed": config.seed,
        "use_hidden": bool(config.use_hidden),
        "hidden_layer": layer,
        "data": key,
    }


def _difference(name: str, was: Any, now: Any) -> str:
    """How a setting differs, in flags: ``--lr 0.001, this run has --lr 0.002``."""
    if name == "data":
        return f"other self-distillation data than this run's ({SETTING_FLAGS[name]} differ)"
    if name == "use_hidden":
        was, now = ("no --no-hidden", "--no-hidden") if was else ("--no-hidden", "no --no-hidden")
        return f"{was}, this run has {now}"
    return f"{SETTING_FLAGS[name]} {was!r}, this run has {SETTING_FLAGS[name]} {now!r}"


def check_settings(folder: Path, recorded: dict[str, Any], settings: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint made with other settings, naming the flag and both values."""
    for name in SETTING_FLAGS:
        if recorded.get(name) != settings[name]:
            raise CheckpointError(
                f"{folder} is a checkpoint of a run with {_difference(name, recorded.get(name), settings[name])}: "
                f"rerun with the checkpoint's flags to resume it, or give a new --out (or delete {folder}) to "
                "train from scratch"
            )


def save_draft(draft: Any, out: Path) -> None:
    """Write the trained draft's files (``edd_config.json``, ``model.safetensors``) into ``out`` so that a crash
    at any moment leaves each of them whole, the earlier draft's or this one's: written beside them first, then
    each renamed over its earlier version."""
    staging = out / f"{_TMP}draft"
    shutil.rmtree(staging, ignore_errors=True)
    draft.save_pretrained(staging)
    _fsync_files(staging)
    for file in sorted(staging.iterdir()):
        os.replace(file, out / file.name)
    fsync_dir(out)
    shutil.rmtree(staging, ignore_errors=True)


def _fsync_files(folder: Path) -> None:
    """Flush every file in ``folder`` and the folder's entries to the disk."""
    for file in folder.iterdir():
        with open(file, "rb+") as handle:
            os.fsync(handle.fileno())
    fsync_dir(folder)


def save_checkpoint(
    folder: Path, draft: Any, optimizer: torch.optim.Optimizer, step: int, settings: dict[str, Any]
) -> None:
    """Write step ``step``'s checkpoint (weights, AdamW state, settings) so that a crash at any moment leaves the
    previous checkpoint or this one, whole (module docstring)."""
    folder.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    staging = folder / f"{_TMP}{name}"
    shutil.rmtree(staging, ignore_errors=True)
    draft.save_pretrained(staging)
    state = optimizer.state_dict()
    tensors = {
        f"{index}.{key}": value.detach().contiguous().cpu()
        for index, slots in state["state"].items()
        for key, value in slots.items()
        if torch.is_tensor(value)
    }
    save_file(tensors, str(staging / OPTIMIZER))
    _fsync_files(staging)
    shutil.rmtree(folder / name, ignore_errors=True)
    os.replace(staging, folder / name)
    fsync_dir(folder)
    progress = {"step": step, "folder": name, "settings": settings, "param_groups": state["param_groups"]}
    write_json_atomic(folder / PROGRESS, progress)  # the commit point
    for old in folder.iterdir():
        if old.name != name and old.name != PROGRESS:
            shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)


def _damaged(path: Path, folder: Path, why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {path} is damaged ({why}): delete {folder} to train again from step 0, or give a new --out"
    )


def read_progress(folder: Path) -> dict[str, Any] | None:
    """The committed checkpoint's record (``None``: no checkpoint in ``folder``)."""
    path = folder / PROGRESS
    if not path.is_file():
        return None
    try:
        progress = json.loads(path.read_text())
        if (
            not isinstance(progress, dict)
            or not {"step", "folder", "settings", "param_groups"} <= progress.keys()
        ):
            raise ValueError("missing step, folder, settings or param_groups: written by an older vlmspec?")
    except ValueError as error:
        raise _damaged(path, folder, str(error)) from error
    return progress


def load_checkpoint(
    folder: Path,
    draft: Any,
    optimizer: torch.optim.Optimizer,
    target: torch.nn.Module,
    settings: dict[str, Any],
) -> int:
    """Restore the committed checkpoint in ``folder`` into ``draft`` and ``optimizer``; the next step to run (0:
    none there).

    Raises:
        CheckpointError: it was made with other settings (naming the flag), or one of its files is damaged.
        ValueError: it is a draft of another target.
    """
    from .models import EDDDraft
    from .models.edd import check_target, read_config

    progress = read_progress(folder)
    if progress is None:
        return 0
    check_settings(folder, progress["settings"], settings)
    step_folder = folder / progress["folder"]
    try:
        config = read_config(step_folder)
    except Exception as error:
        raise _damaged(step_folder / "edd_config.json", folder, f"{type(error).__name__}: {error}") from error
    check_target(config, target, where=str(step_folder))
    try:
        loaded = EDDDraft.from_pretrained(step_folder, target)
    except Exception as error:
        raise _damaged(
            step_folder / "model.safetensors", folder, f"{type(error).__name__}: {error}"
        ) from error
    draft.load_state_dict(loaded.state_dict())
    try:
        tensors = load_file(str(step_folder / OPTIMIZER))
    except Exception as error:
        raise _damaged(step_folder / OPTIMIZER, folder, f"{type(error).__name__}: {error}") from error
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": progress["param_groups"]})
    return int(progress["step"]) + 1
