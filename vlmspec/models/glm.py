"""GLM-4.1V, GLM-4.5V and GLM-4.6V (``model_type`` ``glm4v``, ``glm4v_moe``, ``glm46v``; ``GLM-4.6V-Flash`` drafting
for ``GLM-4.6V``): Qwen2-VL's design (a ViT whose patches are merged 2 x 2, M-RoPE positions from the model's own
``get_rope_index``, pixel rows as patches with ``*_grid_thw``), so :class:`~vlmspec.models.qwen.QwenVLAdapter` reads
it, but for one thing: a video is written as its frames, each ``<|begin_of_image|>`` + ``<|image|>`` tokens +
``<|end_of_image|>`` + its time, so a video's placeholders are the pictures' token. What tells them apart is the
processor's ``mm_token_type_ids`` (1: a picture's, 2: a video's), which the model reads too; this adapter reads every
placeholder's modality from it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InvalidInputError
from .data import PromptLayout
from .qwen import QwenVLAdapter

_TYPE_IDS = {"image": 1, "video": 2}
"""``mm_token_type_ids`` of each modality's placeholders."""


class GlmVAdapter(QwenVLAdapter):
    model_types = ("glm4v", "glm4v_moe", "glm46v")
    pictures_apart_from_videos = (  # its get_placeholder_mask: "special_video_mask is special_image_mask"
        "transformers' GLM-V models (5.x) take a prompt's pictures and its videos' frames as one kind of placeholder "
        "and refuse the two together"
    )

    @property
    def min_video_frames(self) -> int:
        """Its video processor refuses a video shorter than the temporal patch (2 frames)."""
        return self.config.vision_config.temporal_patch_size

    def placeholders(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, L]`` bool each: the pictures' and the videos' placeholders, by their ``mm_token_type_ids``."""
        types = _type_ids(inputs)
        return types == _TYPE_IDS["image"], types == _TYPE_IDS["video"]

    def prompt_layout(self, inputs: dict[str, torch.Tensor]) -> PromptLayout:
        image, video = self.placeholders(inputs)
        return PromptLayout(visual=(image | video)[0], is_video=video[0])

    def placeholder_mask(
        self, inputs: dict[str, torch.Tensor], embeds: torch.Tensor, modality: str, values: torch.Tensor
    ) -> torch.Tensor:
        """``[1, L, 1]`` bool: the placeholders of ``modality`` by their ``mm_token_type_ids``, checked against the
        ``[n, D]`` features ``values`` as the model's own ``get_placeholder_mask`` checks them."""
        mask = self.placeholders(inputs)[modality == "video"][..., None].to(embeds.device)
        if int(mask.sum()) != values.shape[0]:
            raise InvalidInputError(
                f"the prompt holds {int(mask.sum())} {modality} placeholders for {values.shape[0]} visual features; "
                "build the inputs with the model's processor"
            )
        return mask


def _type_ids(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, L]`` the prompts' ``mm_token_type_ids`` (all text when there are none: a prompt of text only)."""
    types = inputs.get("mm_token_type_ids")
    if types is not None:
        return types
    if inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None:
        raise InvalidInputError(
            "GLM-V inputs with images/videos need `mm_token_type_ids` to tell a picture's placeholders from a "
            "video's; build the inputs with the model's processor (it returns them by default)"
        )
    return torch.zeros_like(inputs["input_ids"])
