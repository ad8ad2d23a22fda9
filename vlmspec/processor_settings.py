"""How the target's processor lays out a request's pictures and videos, set per request: vLLM's
``mm_processor_kwargs`` (``pipe(..., mm_processor_kwargs={"max_pixels": 401408})``; ``pipe.mm_processor_kwargs`` for
every request; ``vlmspec serve --mm-processor-kwargs``).

They are the image and video processors' own call-time settings: Qwen's ``min_pixels`` / ``max_pixels`` (or
``size``), InternVL's ``max_patches`` and ``crop_to_patches``, ``do_resize``, ``image_mean``, ... Fewer pixels, fewer
visual tokens: a request trades detail for speed. Speculative decoding is unchanged by them (the draft reads the
target's processor outputs, whatever they are), and greedy output stays what ``generate()`` gives on the same
inputs.

Three kinds of setting are refused, each by name: those the model fixes (patch and merge sizes, tokens per tile,
anyres pinpoints; and each family's own, its adapter's ``fixed_processor_settings``: LLaVA-OneVision's and InternVL's
tile ``size``, resizing on or off: another value would not match the model's weights or its vision tower's input),
the frame sampling (vlmspec samples a video's frames itself: ``num_frames``), and what the call sets itself (the
text and media, the output's form and device). A setting the processor does not know is refused too, where
transformers would log it and go on.

A processor that fails under a request's settings is reported naming them only when it runs without them; a
picture the processor refuses whatever the settings is named as the picture's fault (:func:`vlmspec.inputs.run_processor`).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from typing import Any

from .errors import InputTypeError, InvalidInputError

FIELD = "mm_processor_kwargs"
FIXED_BY_MODEL = frozenset(
    {"patch_size", "merge_size", "temporal_patch_size", "image_seq_length", "image_grid_pinpoints"}
)
FRAME_SAMPLING = frozenset(
    {"do_sample_frames", "num_frames", "fps", "min_frames", "max_frames", "video_metadata", "return_metadata"}
)
CALL_SETS = frozenset(
    {"text", "images", "videos", "audio", "return_tensors", "data_format", "input_data_format", "device"}
)


MODALITIES = {"images": ("images_kwargs", "image_processor"), "videos": ("videos_kwargs", "video_processor")}


def processor_settings(processor: Any, media: Collection[str] = tuple(MODALITIES)) -> frozenset[str] | None:
    """The settings ``processor``'s image and video processors (those of ``media``: ``"images"``, ``"videos"``)
    take at call time (``None`` when it does not say), as transformers' ``ProcessorMixin`` reads them: its
    ``*_kwargs`` declarations and each sub-processor's own."""
    declared = getattr(processor, "valid_processor_kwargs", None)
    if declared is None:
        return None
    names: set[str] = set()
    for modality, part in (MODALITIES[kind] for kind in media):
        names |= set(getattr(declared.__annotations__.get(modality), "__annotations__", {}))
        names |= set(
            getattr(getattr(getattr(processor, part, None), "valid_kwargs", None), "__annotations__", {})
        )
    return frozenset(names)


def check_processor_kwargs(
    processor: Any,
    settings: Any,
    name: str = FIELD,
    fixed: Collection[str] = (),
    media: Collection[str] = tuple(MODALITIES),
) -> dict[str, Any]:
    """``settings`` as a dict of ``processor``'s settings (a copy: later edits of the caller's do not reach it),
    checked; ``{}`` for ``None``. ``fixed``: the settings the model's family fixes besides :data:`FIXED_BY_MODEL`;
    ``media``: the kinds of media they are for (a request's own: a setting only its image processor takes does
    nothing to a request of videos only, as Qwen3-VL's ``max_pixels``, and is refused there).

    Raises:
        InputTypeError: not a dict of string keys.
        InvalidInputError: a key the processor does not take, or one of the three kinds this module refuses.
    """
    settings = check_settings_form(settings, name, fixed)
    known = processor_settings(processor, media)
    if known is not None and (unknown := sorted(set(settings) - known)):
        allowed = sorted(known - FIXED_BY_MODEL - set(fixed) - FRAME_SAMPLING - CALL_SETS)
        for_media = "" if set(media) == set(MODALITIES) else f" for {' and '.join(media)}"
        raise InvalidInputError(
            f"{name} sets {', '.join(unknown)}, which the target's processor does not take{for_media}; it takes "
            f"{', '.join(allowed)}"
        )
    return settings


def check_settings_form(settings: Any, name: str = FIELD, fixed: Collection[str] = ()) -> dict[str, Any]:
    """What :func:`check_processor_kwargs` checks without the processor: a dict of string keys, none of the three
    kinds this module refuses; ``{}`` for ``None``.

    Raises:
        InputTypeError, InvalidInputError: as :func:`check_processor_kwargs`.
    """
    if settings is None:
        return {}
    if not isinstance(settings, Mapping) or not all(isinstance(key, str) for key in settings):
        raise InputTypeError(
            f'{name}={settings!r:.60} is invalid: use a dict of the processor\'s settings ({{"max_pixels": 401408}})'
        )
    for key in settings:
        if key in FIXED_BY_MODEL or key in fixed:
            raise InvalidInputError(f"{name} sets {key}, which the model fixes: leave it out")
        if key in FRAME_SAMPLING:
            raise InvalidInputError(
                f"{name} sets {key}, but vlmspec samples a video's frames itself (pipe(..., num_frames=N); 8 by "
                "default): leave it out"
            )
        if key in CALL_SETS:
            raise InvalidInputError(f"{name} sets {key}, which the call sets itself: leave it out")
    return copy.deepcopy(dict(settings))


class ProcessorSettingsAttribute:
    """``pipe.mm_processor_kwargs``: settings every request of the pipeline starts from (a request's own win),
    checked against the pipeline's processor and model when set (``pipe.check_mm_processor_kwargs``); ``{}`` (none)
    by default. Reading it gives a copy: the settings change only by assignment, which checks them."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, pipe: Any, owner: type | None = None) -> Any:
        return self if pipe is None else copy.deepcopy(getattr(pipe, self.slot, {}))

    def __set__(self, pipe: Any, settings: Any) -> None:
        setattr(pipe, self.slot, pipe.check_mm_processor_kwargs(settings, "pipe.mm_processor_kwargs"))
