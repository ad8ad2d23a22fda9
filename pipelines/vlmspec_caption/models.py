"""The pair the job runs: names and folders resolved, the pipeline loaded once per process."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vlmspec.named_pairs import ResolvedPair

from .config import DEFAULT_POLICY, JobConfig, JobError


def resolve_pair(
    target: str | Path | None, draft: str | Path | None, family: str = "qwen2_vl"
) -> ResolvedPair:
    """The job's models: :func:`vlmspec.named_pairs.resolve_pair` (pair names, folders, hub ids; ``None``: the
    default pair) with ``family`` for a pair name that names none.

    Raises:
        JobError: an unknown name, family or calibration.
    """
    from vlmspec.named_pairs import resolve_pair as resolve_named_pair

    try:
        return resolve_named_pair(target, draft, family=family)
    except ValueError as err:
        raise JobError(f"--target {target}: {err}") from err


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


def run_meta(config: JobConfig) -> dict[str, Any]:
    """The ``policy``/``settings``/``model`` fields of every line ``config`` writes, without loading a model (names
    are resolved: a named pair may be built and cached, as for any run). With a saved pipeline as the target, the
    settings name its folder and hold what it brings (:func:`_brought_settings`), so that a resume compares them.

    Raises:
        JobError: as :func:`load_pipeline` for an unknown policy, bad options, a missing draft or an unknown pair.
    """
    policy, models = _policy_and_models(config)
    settings = config.settings()
    saved = _saved_pipeline(config)
    if saved is not None:
        settings = {"pipeline": saved, **settings, **_brought_settings(config, saved)}
    return {"policy": policy, "settings": settings, "model": models}


def _saved_pipeline(config: JobConfig) -> str | None:
    """The target's folder when it is a pipeline written by ``pipe.save_pretrained``, else ``None``."""
    from vlmspec.named_pairs import is_pipeline_folder

    return str(Path(config.target).expanduser()) if is_pipeline_folder(config.target) else None


def _saved_settings(folder: str) -> dict[str, Any]:
    from vlmspec.saving import read_settings

    try:
        return read_settings(folder)
    except ValueError as err:
        raise JobError(f"--target {folder}: {err}") from err


def _brought_settings(config: JobConfig, folder: str) -> dict[str, Any]:
    """What a saved pipeline brings where ``config`` sets nothing of its own: its policy options (the job's on top),
    pruning, processor settings and reasoning parser (by name), those it has."""
    import dataclasses

    saved = _saved_settings(folder)
    brought: dict[str, Any] = {}
    if config.policy is None:
        brought["policy_options"] = {**(saved["policy_options"] or {}), **config.policy_options}
    if config.prune_ratio is None and saved["pruning"] is not None:
        brought["pruning"] = dataclasses.asdict(saved["pruning"])
    if config.mm_processor_kwargs is None and saved["mm_processor_kwargs"]:
        brought["mm_processor_kwargs"] = saved["mm_processor_kwargs"]
    if config.reasoning_parser is None and saved["reasoning_parser"] is not None:
        parser = saved["reasoning_parser"]  # a name, or a parser of one's own (by its name)
        brought["reasoning_parser"] = getattr(parser, "name", parser)
    return brought


def _policy_and_models(config: JobConfig) -> tuple[str, dict[str, Any]]:
    """The policy's name and ``{"target": ..., "draft": ..., "calibration": ...}`` (``draft`` ``None`` when the
    policy uses none)."""
    from vlmspec import get_policy
    from vlmspec.loading import check_model_folder
    from vlmspec.policies import check_greedy
    from vlmspec.saving import saved_policy

    saved = _saved_pipeline(config)
    policy = (
        config.policy if config.policy is not None else "the saved pipeline's" if saved else DEFAULT_POLICY
    )
    try:
        if config.policy is None and saved is not None:  # the saved policy, the job's options on top
            chosen = saved_policy(saved, _saved_settings(saved), config.policy_options)
        else:
            chosen = get_policy(policy, **config.policy_options)
        check_greedy(
            chosen, "the caption job decodes greedily", "use a lossless policy such as --policy sage"
        )
    except (ValueError, TypeError) as err:
        raise JobError(f"policy {policy!r} with options {config.policy_options}: {err}") from err
    pair = resolve_pair(config.target, config.draft, config.family)
    try:
        check_model_folder(pair.target, "target")  # a mistyped folder, before it reads as a missing draft
    except FileNotFoundError as err:
        raise JobError(str(err)) from err
    if pair.draft is None and chosen.uses_draft:
        raise JobError(f"policy {policy!r} needs a draft model: pass --draft (or use --policy ar)")
    draft = pair.draft if chosen.uses_draft else None
    return chosen.name, {"target": pair.target, "draft": draft, "calibration": pair.calibration}


def load_pipeline(
    config: JobConfig, device_map: str | dict[str, Any] | None = None
) -> tuple[Any, dict[str, Any]]:
    """The :class:`~vlmspec.VLMSpecPipeline` of ``config`` (loaded once per process) and the models it holds.

    Args:
        config: the job's config (models, dtype, policy and its options, prune ratio).
        device_map: passed to ``from_pretrained`` (``config.device_map`` when ``None``).

    Returns:
        The pipeline and ``{"target": ..., "draft": ..., "calibration": ...}``, the resolved folders or hub ids
        (``draft`` is ``None`` when the policy does not use one; the ``model`` field of :func:`run_meta`).

    Raises:
        JobError: an unknown policy or bad policy options, a policy that needs a draft without one, or models
            that cannot be loaded (message names them).
    """
    from vlmspec import VLMSpecPipeline

    _, models = _policy_and_models(config)
    target, draft, calibration = models["target"], models["draft"], models["calibration"]
    # a saved pipeline is loaded whole: its policy, pruning, processor settings and parser come with it
    saved = _saved_pipeline(config)
    try:
        with _quiet_loading():
            pipe = VLMSpecPipeline.from_pretrained(
                saved or target,
                config.draft if saved else draft,
                policy=config.policy,
                torch_dtype=_torch_dtype(config.dtype),
                device_map=device_map if device_map is not None else config.device_map,
                prune_ratio=config.prune_ratio,
                calibration=calibration,
                quantization_config=config.quantization,
                draft_quantization_config=config.draft_quantization,
                **config.policy_options,
            )
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, ImportError) as err:
        raise JobError(
            f"could not load the models (target {target!r}, draft {draft!r}): {type(err).__name__}: {err}"
        ) from err
    try:  # the job's, where it sets them (a saved pipeline's stay otherwise)
        if config.reasoning_parser is not None:
            pipe.reasoning_parser = config.reasoning_parser
        if config.mm_processor_kwargs is not None:
            pipe.mm_processor_kwargs = config.mm_processor_kwargs
    except (
        ValueError,
        TypeError,
    ) as err:  # an end tag the replies' text drops; a setting the processor refuses
        raise JobError(str(err)) from err
    return pipe, models
