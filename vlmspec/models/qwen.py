"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL (dense): M-RoPE positions.

Prompt positions come from the model's own ``get_rope_index`` (which needs the processor's
``mm_token_type_ids``); generated tokens are text, so their three rotary components are all
``logical_position + rope_delta``, exactly as ``generate()`` computes them.
"""

from __future__ import annotations

import torch

from .base import VLMAdapter

_ROPE_KEYS = ("image_grid_thw", "video_grid_thw", "second_per_grid_ts", "attention_mask")


class QwenVLAdapter(VLMAdapter):
    model_types = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def prompt_rope(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
        ids = inputs["input_ids"]
        has_visual = inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None
        if not has_visual:
            positions = torch.arange(ids.shape[1], device=ids.device).view(1, 1, -1).expand(3, 1, -1)
            return positions, torch.zeros((), dtype=torch.long, device=ids.device)
        if inputs.get("mm_token_type_ids") is None:
            raise ValueError(
                "Qwen-VL inputs with images/videos need `mm_token_type_ids` for M-RoPE; build the inputs with the "
                "model's processor (it returns them by default)"
            )
        extra = {k: inputs[k] for k in _ROPE_KEYS if inputs.get(k) is not None}
        positions, deltas = self.model.model.get_rope_index(ids, inputs["mm_token_type_ids"], **extra)
        return positions, deltas.reshape(()).to(torch.long)

    def rope_ids(self, positions: torch.Tensor, rope_delta: torch.Tensor) -> torch.Tensor:
        return (positions + rope_delta).view(1, 1, -1).expand(3, 1, -1)  # [3, 1, n]
