"""Building (training) and caching testbed pairs: ``build()`` and ``pair_paths()``.

A pair lives in ``<root>/<family>-<size>-v<TESTBED_VERSION>/`` with ``target/`` and ``draft/`` (each a
``save_pretrained`` model plus the shared processor files) and ``manifest.json``. A pair is built in a private
staging folder; the manifest is written last and the folder then renamed into place, so a half-built pair is
never used. A folder counts as built only when its manifest exists and names the current version.

**Shipped pairs.** The trained ``base`` and ``mini`` pairs of every family in :data:`FAMILIES` ship inside the package
(``vlmspec/testbed/weights/``, safetensors with their manifests, and the base targets' EDD drafts: 60 MB), so nothing trains on first use:
with no ``root`` named, :func:`build` and :func:`pair_paths` return the shipped pair. ``vlmspec testbed build``
still trains a pair (into the cache) and :func:`compare_with_shipped` says whether it matches what ships.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidInputError
from .tokenizer import FAMILIES, build_processor, check_family
from .train import (
    SIZES,
    TRAIN_SEED_OFFSET,
    SizeConfig,
    deterministic,
    get_size,
    model_spec,
    train_draft,
    train_target,
)

__all__ = [
    "SHIPPED_ROOT",
    "TESTBED_VERSION",
    "TestbedPair",
    "build",
    "check_gates",
    "compare_with_shipped",
    "default_root",
    "pair_folder",
    "pair_paths",
    "prune",
    "shipped_pair",
]

TESTBED_VERSION = "7"
"""Bumped whenever the world, tokenizer, models or training recipe change (old folders are then rebuilt)."""

MANIFEST = "manifest.json"
SHIPPED_ROOT = Path(__file__).parent / "weights"
"""Where the package's own trained pairs are (``<family>-<size>-v<version>/``, as in a cache)."""
_ESTIMATE_MINUTES = {"base": "15-20", "mini": "1-2"}


@dataclass(frozen=True)
class TestbedPair:
    """A built testbed pair.

    Attributes:
        family: One of :data:`FAMILIES` (``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"llava_onevision"``, ``"internvl"``, ``"qwen3_vl"``).
        size: ``"base"`` or ``"mini"``.
        folder: The pair's folder.
        target: Target model folder (``AutoModelForImageTextToText`` / ``AutoProcessor.from_pretrained``).
        draft: Draft model folder (same processor files).
        manifest: The parsed ``manifest.json``.
    """

    family: str
    size: str
    folder: Path
    target: Path
    draft: Path
    manifest: dict[str, Any] = field(repr=False)


def default_root() -> Path:
    """``$VLMSPEC_CACHE/testbed`` or ``~/.cache/vlmspec/testbed``."""
    env = os.environ.get("VLMSPEC_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "vlmspec") / "testbed"


def pair_folder(size: str, family: str, root: str | Path | None = None) -> Path:
    """The folder of a pair (built or not)."""
    get_size(size)
    check_family(family)
    return _cache_root(root) / _folder_name(family, size)


def _cache_root(root: str | Path | None) -> Path:
    return Path(root).expanduser() if root is not None else default_root()


def _folder_name(family: str, size: str, version: str = TESTBED_VERSION) -> str:
    return f"{family}-{size}-v{version}"


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    path = folder / MANIFEST
    if not path.is_file() or not (folder / "target").is_dir() or not (folder / "draft").is_dir():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return manifest if manifest.get("testbed_version") == TESTBED_VERSION else None


def _pair(folder: Path, manifest: dict[str, Any]) -> TestbedPair:
    return TestbedPair(
        family=manifest["family"],
        size=manifest["size"],
        folder=folder,
        target=folder / "target",
        draft=folder / "draft",
        manifest=manifest,
    )


def shipped_pair(size: str, family: str) -> TestbedPair | None:
    """The pair that ships with the package, or ``None`` when this version ships none of ``size``/``family``."""
    folder = pair_folder(size, family, SHIPPED_ROOT)
    manifest = _read_manifest(folder)
    return _pair(folder, manifest) if manifest is not None else None


def compare_with_shipped(pair: TestbedPair) -> str:
    """One line: whether ``pair``'s weights are the shipped ones (bit for bit), or by how much they differ."""
    from safetensors.torch import load_file

    shipped = shipped_pair(pair.size, pair.family)
    if shipped is None:
        return f"{pair.family}/{pair.size}: no shipped pair to compare with"
    worst, differing = 0.0, []
    for role in ("target", "draft"):
        built = load_file(str(getattr(pair, role) / "model.safetensors"))
        ships = load_file(str(getattr(shipped, role) / "model.safetensors"))
        if built.keys() != ships.keys():
            return f"{pair.family}/{pair.size}: differs from the shipped pair ({role} parameter names differ)"
        for name, tensor in built.items():
            if not tensor.equal(ships[name]):
                differing.append(f"{role}.{name}")
                worst = max(worst, (tensor.float() - ships[name].float()).abs().max().item())
    if not differing:
        return f"{pair.family}/{pair.size}: matches the shipped pair bit for bit"
    return (
        f"{pair.family}/{pair.size}: differs from the shipped pair in {len(differing)} tensors "
        f"(largest |difference| {worst:.3g}; first {differing[0]})"
    )


def check_gates(config: SizeConfig, quality: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Compares quality figures with the size's gates.

    ``caption_accuracy``, ``qa_exact_match`` and ``video_accuracy`` are the target's; ``draft_gap`` is the
    target's minus the draft's mean of those three.

    Returns:
        ``{gate: {"value": float, "min": float, "passed": bool}}``.
    """
    target, draft = quality["target"], quality["draft"]
    keys = ("caption_accuracy", "qa_exact_match", "video_accuracy")
    values = {k: target[k] for k in keys}
    values["draft_gap"] = round(sum(target[k] - draft[k] for k in keys) / len(keys), 4)
    values.update({k: quality[k] for k in ("entropy_autocorr", "draft_agreement")})
    return {
        name: {"value": values[name], "min": threshold, "passed": bool(values[name] >= threshold)}
        for name, threshold in config.gates
    }


def _summary(family: str, config: SizeConfig, manifest: dict[str, Any]) -> str:
    q = manifest["quality"]
    t, d = q["target"], q["draft"]
    lines = [
        f"testbed {family}/{config.name}: trained in {manifest['wall_seconds'] / 60:.1f} min; "
        f"target {manifest['target']['params']['total'] / 1e6:.2f}M params, "
        f"draft {manifest['draft']['params']['total'] / 1e6:.2f}M",
        f"  target: caption acc {t['caption_accuracy']:.3f}, QA exact {t['qa_exact_match']:.3f}, "
        f"video acc {t['video_accuracy']:.3f}",
        f"  draft:  caption acc {d['caption_accuracy']:.3f}, QA exact {d['qa_exact_match']:.3f}, "
        f"video acc {d['video_accuracy']:.3f}",
        f"  entropy autocorrelation lag1 {q['entropy_autocorr']:.3f} (lag2 {q['entropy_autocorr_lag2']:.3f}); "
        f"draft agreement {q['draft_agreement']:.3f} (confident {q.get('draft_agreement_confident', float('nan')):.3f},"
        f" uncertain {q.get('draft_agreement_uncertain', float('nan')):.3f})",
    ]
    failed = [f"{k} {v['value']} < {v['min']}" for k, v in manifest["gates"].items() if not v["passed"]]
    lines.append("  gates: all passed" if not failed else "  gates FAILED: " + "; ".join(failed))
    return "\n".join(lines)


def _train(family: str, config: SizeConfig, out: Path, progress: bool) -> dict[str, Any]:
    """Trains and evaluates a pair, saves it under ``out`` and returns the manifest (not yet written)."""
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    from .evaluate import evaluate_pair
    from .models import count_parameters

    start = time.perf_counter()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    total = config.target_steps + config.draft_steps + sum(config.vision_steps)
    bar = tqdm(
        total=total, desc=f"{family}/{config.name}", unit="step", disable=not progress, file=sys.stderr
    )

    def on_step(role: str) -> Any:
        def update(step: int, loss: float) -> None:
            bar.update(1)
            if step % 10 == 0:
                bar.set_postfix_str(f"{role} loss {loss:.3f}")

        return update

    try:
        with deterministic(config.threads):
            processor = build_processor(family)
            target, target_info = train_target(family, config, processor, on_step=on_step("target"))
            draft, draft_info = train_draft(family, config, processor, target, on_step=on_step("draft"))
            bar.set_postfix_str("evaluating on held-out scenes")
            quality = evaluate_pair(target, draft, processor, config.eval_examples)
        bar.close()
        for name, model in (("target", target), ("draft", draft)):
            model.save_pretrained(out / name)
            processor.save_pretrained(out / name)
    finally:
        bar.close()
        if bars:
            hf_logging.enable_progress_bar()
    manifest: dict[str, Any] = {
        "testbed_version": TESTBED_VERSION,
        "family": family,
        "size": config.name,
        "seed": config.seed,
        "threads": config.threads,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "task_cycle": list(config.task_cycle),
        "train_seed_offset": TRAIN_SEED_OFFSET,
        "eval_examples_per_task": config.eval_examples,
        "vocab_size": len(processor.tokenizer),
        "target": {
            "spec": model_spec(family, config, "target").to_dict(),
            "params": count_parameters(target),
            "training": target_info,
        },
        "draft": {
            "spec": model_spec(family, config, "draft").to_dict(),
            "params": count_parameters(draft),
            "training": draft_info,
        },
        "quality": quality,
    }
    manifest["gates"] = check_gates(config, quality)
    manifest["gates_passed"] = all(g["passed"] for g in manifest["gates"].values())
    manifest["wall_seconds"] = round(time.perf_counter() - start, 1)
    return manifest


def build(
    size: str = "base",
    family: str = "qwen2_vl",
    root: str | Path | None = None,
    force: bool = False,
    progress: bool = True,
) -> TestbedPair:
    """Returns the testbed pair: the shipped one, else a built one in the cache, else it trains it first.

    Args:
        size: ``"base"`` (benchmarks, demo; ~15-20 min on 2 CPU cores) or ``"mini"`` (tests; ~1-2 min).
        family: One of :data:`FAMILIES` (``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"llava_onevision"``, ``"internvl"``, ``"qwen3_vl"``).
        root: Cache folder; naming one skips the shipped pair. Default: the shipped pair, else
            :func:`default_root`.
        force: Train again (into the cache) even if a built or shipped pair exists.
        progress: Print the explanation line, a progress bar and the quality summary.

    Returns:
        The :class:`TestbedPair`.

    Raises:
        ValueError: If ``size`` or ``family`` is unknown.
    """
    from filelock import FileLock

    config = get_size(size)
    check_family(family)
    shipped = shipped_pair(size, family) if root is None and not force else None
    if shipped is not None:
        return shipped
    folder = pair_folder(size, family, root)
    manifest = None if force else _read_manifest(folder)
    if manifest is not None:
        return _pair(folder, manifest)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One builder at a time (test workers, accelerate processes): the others wait, then find the pair built.
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        manifest = None if force else _read_manifest(folder)
        if manifest is not None:
            return _pair(folder, manifest)
        for stale in folder.parent.glob(
            f".{folder.name}.partial-*"
        ):  # left by a killed build (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        if progress:
            print(
                f"vlmspec testbed: training the {size} {family} target/draft pair on procedurally drawn shapes "
                f"(CPU, about {_ESTIMATE_MINUTES[size]} min, once; cached in {folder}).",
                flush=True,
            )
        staging = folder.parent / f".{folder.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            manifest = _train(family, config, staging, progress)
            (staging / MANIFEST).write_text(
                json.dumps(manifest, indent=2) + "\n"
            )  # last: marks the pair complete
            if folder.exists():
                shutil.rmtree(folder)
            staging.rename(folder)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    if progress:
        print(_summary(family, config, manifest), flush=True)
    return _pair(folder, manifest)


def pair_paths(
    size: str = "base", family: str = "qwen2_vl", root: str | Path | None = None
) -> tuple[Path, Path]:
    """``(target, draft)`` folders of the testbed pair, building it first if needed (see :func:`build`)."""
    pair = build(size=size, family=family, root=root)
    return pair.target, pair.draft


def edd_path(size: str = "base", family: str = "qwen2_vl") -> Path:
    """The EDD draft (:mod:`vlmspec.models.edd`) trained for the shipped ``size`` target of ``family``.

    Raises:
        InvalidInputError: none ships for that pair. The shipped ones were trained with ``vlmspec edd train --target
            testbed-base:<family> --data testbed --examples 2000 --max-new-tokens 128 --lr 1e-3 --epochs 8 --out
            vlmspec/testbed/weights/<family>-base-v7/edd`` (settings in their ``edd_config.json``).
    """
    folder = SHIPPED_ROOT / _folder_name(family, size) / "edd"
    if not folder.is_dir():
        shipped = sorted(p.parent.name for p in SHIPPED_ROOT.glob("*/edd"))
        raise InvalidInputError(
            f"no EDD draft ships for the testbed {size} {family} target (shipped: {', '.join(shipped) or 'none'}); "
            f"train one with `vlmspec edd train --target testbed-{size}:{family} --data testbed --out DIR` and "
            "pass draft=DIR"
        )
    return folder


def prune(root: str | Path | None = None, dry_run: bool = False) -> list[Path]:
    """Removes the pair folders that another testbed version built (they are never read again).

    Only folders named ``<family>-<size>-v<version>`` with a version other than :data:`TESTBED_VERSION` go;
    the current pairs, build locks and anything else in ``root`` stay.

    Args:
        root: Cache folder (default: :func:`default_root`).
        dry_run: List what would go without removing it.

    Returns:
        The old folders, sorted (removed unless ``dry_run``).
    """
    base = _cache_root(root)
    if not base.is_dir():
        return []
    pairs = [(family, size) for family in FAMILIES for size in SIZES]
    current = {_folder_name(family, size) for family, size in pairs}
    prefixes = tuple(_folder_name(family, size, version="") for family, size in pairs)
    old = sorted(
        p for p in base.iterdir() if p.is_dir() and p.name.startswith(prefixes) and p.name not in current
    )
    if not dry_run:
        for folder in old:
            shutil.rmtree(folder)
    return old
