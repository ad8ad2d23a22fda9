"""Benchmark inputs and the default model pair: the trained testbed's, or synthetic inputs when asked for.

The testbed (``vlmspec.testbed``, shipped with the package) draws held-out pictures and clips with their prompts
and references (``sample(task, seed)``) and holds the default pairs. With ``--inputs synthetic`` the inputs are the
deterministic synthetic pictures and clips of :mod:`vlmspec.testing` with fixed prompts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vlmspec.named_pairs import (
    ENV_DEFAULT_PAIR,
    ResolvedPair,
    is_pair_name,
    is_pipeline_folder,
    split_calibration,
)
from vlmspec.named_pairs import resolve_pair as resolve_named_pair

from .bench_cli import INPUT_SOURCES, TASKS
from .methods import AR, EDD_PREFIX

_QA_PROMPTS: tuple[str, ...] = (
    "What color is the largest shape?",
    "How many objects are there? Answer briefly.",
    "Is there a circle in the image?",
    "Where is the red shape?",
)
_SYNTHETIC_PROMPTS: dict[str, str] = {
    "image_caption": "Describe this image in detail.",
    "video_caption": "Describe this video.",
}
_VIDEO_FRAMES = 4  # even (Qwen video processors need an even frame count)


@dataclass(frozen=True)
class TaskInput:
    """One benchmark input.

    Attributes:
        task: one of :data:`TASKS`.
        index: position of the input within its task (0-based).
        prompt: the user's text.
        image: a PIL image / path (or ``None``).
        video: a video path or list of frames (or ``None``).
        reference: the testbed's reference answer, if any (not used for speed; kept for the report).
        source: ``"testbed"`` or ``"synthetic"``.
    """

    task: str
    index: int
    prompt: str
    image: Any = None
    video: Any = None
    reference: str | None = None
    source: str = "synthetic"


def check_tasks(tasks: Sequence[str]) -> list[str]:
    """Validate task names (order kept, duplicates dropped).

    Raises:
        ValueError: an unknown task, listing the valid ones.
    """
    names = list(dict.fromkeys(t.strip() for t in tasks if t.strip()))
    bad = [t for t in names if t not in TASKS]
    if bad or not names:
        raise ValueError(f"unknown task(s) {bad or '(none given)'}; valid tasks: {', '.join(TASKS)}")
    return names


def load_inputs(tasks: Sequence[str], n: int, seed: int, source: str = "auto") -> list[TaskInput]:
    """``n`` inputs per task, from the testbed (``source`` ``"auto"`` or ``"testbed"``) or synthetic.

    Args:
        tasks: task names (see :data:`TASKS`).
        n: inputs per task (>= 1).
        seed: input ``i`` of a task uses seed ``seed + i``.
        source: ``"auto"``, ``"testbed"`` or ``"synthetic"``.

    Raises:
        ValueError: bad ``n``/``source``.
    """
    if n < 1:
        raise ValueError(f"n={n} is invalid: use at least 1 input per task")
    if source not in INPUT_SOURCES:
        raise ValueError(f"unknown input source {source!r}; valid: {', '.join(INPUT_SOURCES)}")
    make = _synthetic_input if source == "synthetic" else _testbed_input
    return [make(task, i, seed + i) for task in check_tasks(tasks) for i in range(n)]


def _testbed_input(task: str, index: int, seed: int) -> TaskInput:
    from vlmspec.testbed import sample

    example = sample(task, seed)
    return TaskInput(task, index, example.prompt, example.image, example.video, example.reference, "testbed")


def _synthetic_input(task: str, index: int, seed: int) -> TaskInput:
    from vlmspec.testing import make_image, make_video_frames

    if task == "video_caption":
        frames = make_video_frames(seed, num_frames=_VIDEO_FRAMES)
        return TaskInput(task=task, index=index, prompt=_SYNTHETIC_PROMPTS[task], video=frames)
    if task == "image_qa":
        prompt = _QA_PROMPTS[index % len(_QA_PROMPTS)]
        return TaskInput(task=task, index=index, prompt=prompt, image=make_image(1000 + seed))
    return TaskInput(task=task, index=index, prompt=_SYNTHETIC_PROMPTS[task], image=make_image(seed))


DEFAULT_SIZE = "base"
DEFAULT_CALIBRATION = "cpu"
"""The default pair's size and calibration (``testbed-base:<family>@cpu``) when ``--size``/``--calibration`` say none."""


def resolve_pair(
    target: str | None,
    draft: str | None,
    family: str,
    size: str | None = None,
    calibration: str | None = None,
) -> ResolvedPair:
    """The pair to benchmark: the explicit folders, a pair name (see :mod:`vlmspec.named_pairs`) or a folder written
    by ``pipe.save_pretrained`` (its pair; the bench keeps its own settings), else the pair named by
    ``VLMSPEC_DEFAULT_PAIR`` (when no ``size`` is given), else the testbed's shipped ``size`` pair of ``family``
    (default ``base``).

    ``calibration`` (``None``: not given) inflates the default pair (default ``cpu``) or a pair name that names
    none; ``"none"``: as trained.

    Raises:
        ValueError: see :func:`check_pair`.
    """
    check_pair(target, draft, size, calibration)
    if target is None and size is None and os.environ.get(ENV_DEFAULT_PAIR):
        resolve_named_pair(None)  # refuses a bad name, naming the variable
        target = os.environ[ENV_DEFAULT_PAIR]  # the user's default pair, as at every entry point
    if target is None:
        target = f"testbed-{size or DEFAULT_SIZE}:{family}"
        calibration = calibration or DEFAULT_CALIBRATION
    if calibration not in (None, "none") and split_calibration(target)[1] is None:
        target = f"{target}@{calibration}"
    return resolve_named_pair(target, draft, family=family)


def check_pair(
    target: str | None, draft: str | None, size: str | None = None, calibration: str | None = None
) -> None:
    """Refuse what names no pair, before anything loads.

    Raises:
        ValueError: a draft without a target; a folder/hub-id target without a draft (a saved pipeline brings its
            own, when it has one); ``size`` with a target (it picks the default pair); ``calibration`` (but
            ``"none"``) with a target that is not a pair name, or with a pair name of another calibration; an
            unknown calibration.
    """
    if (target is None) != (draft is None) and not is_pair_name(target):
        if not is_pipeline_folder(target):
            raise ValueError(
                "give both --target and --draft, a pair name or a saved pipeline as --target, or neither (the "
                "default pair)"
            )
        if not (Path(str(target)) / "draft").is_dir():
            raise ValueError(f"the saved pipeline {target!r} holds no draft/: give --draft")
    if target is not None and size is not None:
        raise ValueError(
            f"--size {size} picks the default pair's size, but --target {target!r} names the pair; name "
            f"testbed-{size} as --target instead"
        )
    if calibration is None:
        return
    if calibration != "none":
        from vlmspec.testbed.calibrate import get_calibration

        get_calibration(calibration)  # an unknown name: the message lists the valid ones
        if target is not None and not is_pair_name(target):
            raise ValueError(
                f"--calibration {calibration} inflates a pair name or the default pair, but --target {target!r} is "
                "a folder or hub id, whose models load as they are"
            )
    named = split_calibration(str(target))[1] if is_pair_name(target) else None
    if named is not None and named != calibration:
        raise ValueError(
            f"--target {target!r} names calibration {named!r} but --calibration says {calibration!r}: give one"
        )


def load_edd_pipeline(pipe: Any, pair: ResolvedPair | None, config: Any) -> tuple[Any, str]:
    """``(pipeline, "")``: the bench's target with an EDD draft (``--edd``: a folder, or ``auto``: the one shipped
    for a testbed pair), inflated like the target; ``(None, why)`` when there is none."""
    from vlmspec import VLMSpecPipeline
    from vlmspec.errors import InvalidInputError
    from vlmspec.testbed import edd_path

    source = config.edd
    if source == "auto":
        testbed = testbed_size_family(pair)
        if testbed is None:
            return None, "--edd auto finds EDD drafts for testbed pairs only; give --edd FOLDER"
        try:
            source = str(edd_path(*testbed))
        except InvalidInputError as err:
            return None, f"{err} (the bench: --edd DIR)"
    if pair is None:
        return None, "the bench was given a pipeline, not a pair: no EDD draft can be loaded for it"
    loaded = load_pipeline(replace(pair, draft=source), config.dtype, config.quantization)
    return VLMSpecPipeline(pipe.target, loaded.draft, pipe.processor, policy=AR), ""


def section_edd_pipeline(pipe: Any, pair: ResolvedPair | None, config: Any, policies: Sequence[str]) -> Any:
    """The EDD pipeline that a section's ``edd+<policy>`` rows run on (:func:`load_edd_pipeline`), ``None`` when
    ``policies`` name none; exits with the reason when one is named and there is no EDD draft."""
    if not any(policy.startswith(EDD_PREFIX) for policy in policies):
        return None
    edd_pipe, missing = load_edd_pipeline(pipe, pair, config)
    if edd_pipe is None:
        raise SystemExit(f"vlmspec bench: error: no edd+<policy> rows: {missing}")
    return edd_pipe


def testbed_size_family(pair: ResolvedPair | None) -> tuple[str, str] | None:
    """``(size, family)`` of a testbed pair (``pair.source``: ``testbed:<size>:<family>[@<calibration>]``), else
    ``None``."""
    parts = pair.source.split("@")[0].split(":") if pair is not None else []
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "testbed" else None


def load_pipeline(
    pair: ResolvedPair, dtype: str, quantization: Any = None, draft_quantization: Any = None
) -> Any:
    """The pipeline of ``pair`` in ``dtype`` (policy ``ar``; the bench swaps policies per run), its models quantized
    as the bench's ``--quantization`` / ``--draft-quantization`` say."""
    from vlmspec import VLMSpecPipeline

    return VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy=AR, torch_dtype=dtype, calibration=pair.calibration,
        quantization_config=quantization, draft_quantization_config=draft_quantization,
    )  # fmt: skip


def pair_heading(pair: ResolvedPair, config: Any) -> str:
    """``pair.source`` with the models ``config`` quantizes (``--quantization``), for the sections' headings."""
    given = (("target", config.quantization), ("draft", config.draft_quantization))
    quantized = [f"{role} {value}" for role, value in given if value is not None]
    return pair.source + (f" (quantized: {', '.join(quantized)})" if quantized else "")


def load_config_pair(config: Any) -> tuple[ResolvedPair, Any]:
    """The pair ``config`` names (its default pair when it names none) and that pair's pipeline."""
    pair = resolve_pair(config.target, config.draft, config.family, config.size, config.calibration)
    return pair, load_pipeline(pair, config.dtype, config.quantization, config.draft_quantization)
