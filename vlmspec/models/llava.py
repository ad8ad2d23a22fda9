"""LLaVA-OneVision: a SigLIP tower + projector in front of a Qwen2 language model with 1-D RoPE."""

from __future__ import annotations

from .base import VLMAdapter


class LlavaOnevisionAdapter(VLMAdapter):
    model_types = ("llava_onevision",)

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id
