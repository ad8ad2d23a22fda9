"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense and mixture-of-experts): M-RoPE positions.

Prompt positions come from the model's own ``get_rope_index`` (which needs the processor's
``mm_token_type_ids``); generated tokens are text, so their three rotary components are all
``logical_position + rope_delta``, exactly as ``generate()`` computes them.

Pruned/scored prefills (see :mod:`vlmspec.models.base`): visual features come from the model's
``get_image_features`` / ``get_video_features``. Qwen3-VL also adds "deepstack" visual features to the outputs of
its first decoder layers at the visual positions (``visual_pos_masks`` ``[1, L]`` and one ``[num_visual, D]``
tensor per deepstack layer); they are built here as its ``forward`` builds them and cut together with the
positions.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ..errors import InvalidInputError
from .base import VLMAdapter
from .data import VisualFeatures

_ROPE_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "attention_mask")


class QwenVLAdapter(VLMAdapter):
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
    layout_fields = (  # pixel rows are (channels x temporal x patch x patch); merge x merge patches make a token
        "vision_config.patch_size",
        "vision_config.temporal_patch_size",
        "vision_config.spatial_merge_size",
        "vision_config.in_channels",
    )
    fixed_processor_settings = frozenset({"do_resize"})  # pictures resized to whole merged patches
    rope_inputs: ClassVar[tuple[str, ...]] = _ROPE_KEYS
    """The processor outputs the model's ``get_rope_index`` reads besides the ids and ``mm_token_type_ids``; the
    first two are the items' grids, which a prompt with pictures or videos has."""

    @property
    def min_video_frames(self) -> int:
        """Qwen3-VL's video processor refuses a video shorter than its temporal patch (2 frames); Qwen2-VL's and
        Qwen2.5-VL's pad one themselves (padding it here would change Qwen2.5-VL's ``second_per_grid_ts``)."""
        return 2 if self.config.model_type in ("qwen3_vl", "qwen3_vl_moe") else 1

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def prompt_rope(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
        ids = inputs["input_ids"]
        has_visual = any(inputs.get(grid) is not None for grid in self.rope_inputs[:2])
        if not has_visual:
            positions = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, 1, -1)
            return positions, torch.zeros((), dtype=torch.long, device=ids.device)
        if inputs.get("mm_token_type_ids") is None:
            raise InvalidInputError(
                "Qwen-VL inputs with images/videos need `mm_token_type_ids` for M-RoPE; build the inputs with the "
                "model's processor (it returns them by default)"
            )
        extra = {k: inputs[k] for k in self.rope_inputs if inputs.get(k) is not None}
        positions, deltas = self.model.model.get_rope_index(ids, inputs["mm_token_type_ids"], **extra)
        return positions, deltas.reshape(()).to(torch.long)

    @staticmethod
    def rope_ids(positions: torch.Tensor, rope_delta: torch.Tensor) -> torch.Tensor:
        return (positions + rope_delta).view(1, 1, -1).expand(3, 1, -1)  # [3, 1, n]

    # ---- pruned/scored prefill hooks ----------------------------------------------------------------------
    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        core = self.model.model
        found: dict[str, VisualFeatures] = {}
        if inputs.get("pixel_values") is not None:
            out = core.get_image_features(
                inputs["pixel_values"], inputs.get("image_grid_thw"), return_dict=True
            )
            found["image"] = _features(out)
        if inputs.get("pixel_values_videos") is not None:
            out = core.get_video_features(
                inputs["pixel_values_videos"], inputs.get("video_grid_thw"), return_dict=True
            )
            found["video"] = _features(out)
        return found

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """Pixel rows are patches: each item has ``t * h * w`` of them (its ``*_grid_thw`` row)."""
        found: dict[str, Any] = {}
        for pixels, grid, items in (
            ("pixel_values", "image_grid_thw", images),
            ("pixel_values_videos", "video_grid_thw", videos),
        ):
            if inputs.get(grid) is None:
                continue
            rows = item_rows(inputs[grid].prod(-1), items)
            if rows is None:
                continue
            found[pixels], found[grid] = inputs[pixels][rows], inputs[grid][items]
            if grid == "video_grid_thw" and inputs.get("second_per_grid_ts") is not None:
                found["second_per_grid_ts"] = inputs["second_per_grid_ts"][items]
        return found

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Item ``i`` of a modality has ``t * h * w / merge**2`` placeholder tokens (its ``*_grid_thw`` row): rows
        take the items in order until their placeholders are covered."""
        merge = self.config.vision_config.spatial_merge_size**2
        per_modality = []
        for placeholders, grid in zip(
            self.placeholders(inputs), ("image_grid_thw", "video_grid_thw"), strict=True
        ):
            tokens = (inputs[grid].prod(-1) // merge).tolist() if inputs.get(grid) is not None else []
            wanted = (placeholders & keep).sum(-1).tolist()  # [B] placeholders per row
            per_modality.append(take_items(tokens, wanted, grid))
        return list(zip(*per_modality, strict=True))

    def placeholders(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, L]`` bool each: the prompts' picture placeholders and their video placeholders."""
        image_id, video_id = self.visual_token_ids()
        return inputs["input_ids"] == image_id, inputs["input_ids"] == video_id

    def extra_prompt_inputs(
        self, masks: dict[str, torch.Tensor], features: dict[str, VisualFeatures]
    ) -> dict[str, Any]:
        """Qwen3-VL's ``visual_pos_masks`` ``[1, L]`` and joint ``deepstack_visual_embeds`` (``[num_visual, D]``
        per deepstack layer, image and video rows at their own visual slots); nothing for Qwen2/2.5-VL."""
        deep = {m: f.deepstack for m, f in features.items() if f.deepstack is not None}
        if not deep:
            return {}
        visual = torch.zeros_like(next(iter(masks.values())))  # [1, L]
        for modality in deep:
            visual |= masks[modality]
        first = next(iter(deep.values()))
        joint = [layer.new_zeros(int(visual.sum()), layer.shape[-1]) for layer in first]
        for modality, layers in deep.items():
            rows = masks[modality][visual]  # [num_visual] bool: the visual slots of this modality
            for out, layer in zip(joint, layers, strict=True):
                out[rows] = layer.to(out.dtype)
        return {"visual_pos_masks": visual, "deepstack_visual_embeds": joint}

    def join_prompts(self, prompts: list[dict[str, Any]], length: int) -> dict[str, Any]:
        """Qwen3-VL: ``visual_pos_masks`` right-padded to ``[B, length]`` and each deepstack layer's rows of all
        prompts in row order, the order the mask's visual slots take (a prompt without media adds none)."""
        deep = [p for p in prompts if "visual_pos_masks" in p]
        joined = super().join_prompts([{"inputs_embeds": p["inputs_embeds"]} for p in prompts], length)
        if not deep:
            return joined
        visual = torch.zeros(
            len(prompts), length, dtype=torch.bool, device=deep[0]["visual_pos_masks"].device
        )
        for row, prompt in enumerate(prompts):
            if "visual_pos_masks" in prompt:
                visual[row, : prompt["visual_pos_masks"].shape[1]] = prompt["visual_pos_masks"][0]
        layers = zip(*(p["deepstack_visual_embeds"] for p in deep), strict=True)
        return {
            **joined,
            "visual_pos_masks": visual,
            "deepstack_visual_embeds": [torch.cat(x) for x in layers],
        }

    def select_prompt(self, prompt: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        selected = super().select_prompt(prompt, index)
        visual = prompt.get("visual_pos_masks")
        if visual is None:
            return selected
        kept = visual[:, index]  # [1, k]
        if not bool(kept.any()):
            return selected  # no visual position left: no deepstack injection at all
        rank = visual[0].long().cumsum(0) - 1  # [S] visual slot of each position
        rows = rank[index][kept[0]]  # [k_visual] deepstack rows of the kept visual positions
        selected["visual_pos_masks"] = kept
        selected["deepstack_visual_embeds"] = [layer[rows] for layer in prompt["deepstack_visual_embeds"]]
        return selected


def _features(out: Any) -> VisualFeatures:
    """``VisualFeatures`` from a ``get_image_features``/``get_video_features`` output (per-item tuples)."""
    deepstack = getattr(out, "deepstack_features", None)
    return VisualFeatures(
        embeds=torch.cat(out.pooler_output, dim=0),
        deepstack=[torch.cat(layer, dim=0) for layer in deepstack] if deepstack is not None else None,
    )


def item_rows(sizes: torch.Tensor, items: slice) -> slice | None:
    """The rows of the items ``items`` in a tensor that holds ``sizes[i]`` rows for item ``i``, one item after the
    other (Qwen's pixel rows: an item's patches); ``None`` when ``items`` selects none."""
    picked = range(sizes.shape[0])[items]
    if not picked:
        return None
    bounds = sizes.cumsum(0).tolist()  # rows up to the end of each item
    return slice(bounds[picked.start - 1] if picked.start else 0, bounds[picked.stop - 1])


def take_items(tokens: list[int], wanted: list[int], grid: str) -> list[int]:
    """How many consecutive items (``tokens[i]`` placeholders each) cover each row's ``wanted[b]`` placeholders."""
    counts, item = [], 0
    for b, need in enumerate(wanted):
        start = item
        while need > 0 and item < len(tokens):
            need -= tokens[item]
            item += 1
        if need != 0:
            raise InvalidInputError(
                f"the inputs' {grid} does not match the placeholder tokens of row {b}; build the inputs with the "
                "model's processor, each prompt's images and videos in its own list"
            )
        counts.append(item - start)
    return counts
