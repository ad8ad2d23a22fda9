"""A family's processor outputs cut by prompt and by media item: how a batch of prompts becomes each prompt's own
inputs (:meth:`MediaRows.split_rows`) and how a prompt's later images and videos are picked out (the families'
:meth:`MediaRows.media_items`)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidInputError


class MediaRows:
    """The media-cutting part of :class:`~vlmspec.models.VLMAdapter` (a mixin: each family overrides
    :meth:`media_items` and :meth:`media_counts` for its processor's layout)."""

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The visual inputs (pixels and their per-item metadata) of the prompt's images ``images`` and videos
        ``videos`` (slices of their order in the inputs): the later media :meth:`extend` sends through the vision
        tower, or one row's media in :meth:`split_rows`. Modalities with nothing selected are left out.

        The pixels are cut as the family's processor lays them out: Qwen ``pixel_values`` ``[patches, D]`` with
        ``image_grid_thw`` ``[items, 3]`` (``t * h * w`` patches per item); LLaVA-OneVision ``pixel_values``
        ``[items, tiles, C, H, W]`` with ``image_sizes`` ``[items, 2]``.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot select a prompt's media yet")

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """``(images, videos)`` of each of the ``B`` rows of a batch of processor outputs, in order (``keep``:
        ``[B, L]`` bool, the rows' real tokens; the rest is padding).

        Raises:
            ValueError: the media cannot be matched to the rows' placeholders (the message says what to do).
        """
        raise NotImplementedError(f"{type(self).__name__} cannot split a batch of prompts yet")

    def media_rows(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The processed media of one prompt's processor outputs, one row (or patch) per medium along dim 0 in the
        order of the prompt, so that a prompt's media start with another's exactly when its rows do (what the
        prefix cache compares): every tensor but the per-token ones (``input_ids``' shape). Families whose
        processor pads a prompt's media to the largest one lay them out without that padding."""
        shape = inputs["input_ids"].shape
        return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.shape != shape}

    def row_media(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """One row's visual inputs in :meth:`split_rows` (:meth:`media_items` unless a family adds per-row data)."""
        return self.media_items(inputs, images, videos)

    def split_rows(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        """One prompt's processor outputs per row of a (padded) batch of them: each row's real tokens and its own
        images and videos, as the processor gives them for that prompt alone.

        Args:
            inputs: processor outputs for ``B`` prompts (``input_ids`` ``[B, L]``, ``attention_mask`` marking padding).

        Returns:
            ``B`` dicts of batch-1 inputs (per-token tensors ``[1, L_b]``).
        """
        ids = inputs["input_ids"]
        mask = inputs.get("attention_mask")
        keep = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)  # [B, L]
        per_token = [k for k, v in inputs.items() if torch.is_tensor(v) and v.shape == ids.shape]
        rows, image, video = [], 0, 0
        for b, (images, videos) in enumerate(self.media_counts(inputs, keep)):
            row = {k: inputs[k][b][keep[b]][None] for k in per_token}
            row.update(self.row_media(inputs, slice(image, image + images), slice(video, video + videos)))
            rows.append(row)
            image, video = image + images, video + videos
        if self.media_items(inputs, slice(image, None), slice(video, None)):  # items no placeholder took
            raise InvalidInputError(
                f"the inputs hold more images or videos than the {len(rows)} prompts' placeholders take; build them "
                "with the model's processor, each prompt's images and videos in its own list"
            )
        return rows


def pictures_per_row(placeholders: list[int], picture_tokens: list[int]) -> list[int]:
    """Pictures of each row of a batch whose pictures' token counts depend on their sizes (LLaVA-NeXT, Mistral 3):
    the pictures ``picture_tokens`` (placeholders each, in order) dealt to the rows in order, as many as make up each
    row's ``placeholders``.

    Raises:
        InvalidInputError: a row's placeholders are not whole pictures.
    """
    tokens = iter(picture_tokens)
    counts = []
    for left in placeholders:
        pictures = 0
        while left > 0:
            left -= next(tokens, left + 1)  # no picture left: overshoot
            pictures += 1
        if left:
            raise InvalidInputError(
                "a prompt's picture placeholders do not add up to whole pictures of the inputs' image_sizes; build "
                "the inputs with the model's processor, each prompt's pictures in its own list"
            )
        counts.append(pictures)
    return counts


def pictures_with_sizes(inputs: dict[str, Any], images: slice) -> dict[str, Any]:
    """The pictures ``images`` of processor outputs with one ``pixel_values`` row and one ``image_sizes`` row per
    picture (LLaVA-NeXT, Mistral 3); ``{}`` when that selects none."""
    pixels = inputs.get("pixel_values")
    if pixels is None or not range(pixels.shape[0])[images]:
        return {}
    return {"pixel_values": pixels[images], "image_sizes": inputs["image_sizes"][images]}


def equal_items_per_row(placeholders: torch.Tensor, pixels: torch.Tensor | None) -> list[int]:
    """Items (pictures or videos, one row of ``pixels`` each) of each row of a batch whose placeholders are
    ``placeholders`` ``[B, L]`` bool, where every item has as many placeholders as any other (the items of one call
    share their frame or tile count: LLaVA-NeXT-Video's videos, Perception LM's pictures and videos); all zero when
    there are no ``pixels``, or no placeholders (the items no prompt takes are then reported by the caller).

    Raises:
        InvalidInputError: the placeholders are not whole items of equal size.
    """
    per_row = placeholders.sum(-1)  # [B]
    total = int(per_row.sum())
    if pixels is None or total == 0:
        return [0] * per_row.shape[0]
    if total % pixels.shape[0]:
        raise InvalidInputError(
            f"the prompts' {total} placeholders are not {pixels.shape[0]} items of equal size; build the inputs with "
            "the model's processor, each prompt's pictures and videos in its own list"
        )
    return (per_row // (total // pixels.shape[0])).tolist()
