"""A prompt's language-model inputs, as the pruned, scored, batched and extended prefills build them: the text
embeddings with each visual placeholder replaced by its feature (:meth:`PromptInputs.embed_prompt`), the family's
extra inputs (Qwen3-VL's deepstack features, Gemma 3's picture blocks), cut to some positions or joined into a batch.
"""

from __future__ import annotations

from typing import Any

import torch

from .data import VisualFeatures


class PromptInputs:
    """The prompt-embedding part of :class:`~vlmspec.models.VLMAdapter` (a mixin: families override the hooks)."""

    model: torch.nn.Module

    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        """Features of the prompt's visual placeholders, keyed ``"image"`` / ``"video"`` (modalities present only).

        Families compute them with the model's own ``get_image_features`` / ``get_video_features``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support pruned/scored prefills yet")

    def extra_prompt_inputs(
        self, masks: dict[str, torch.Tensor], features: dict[str, VisualFeatures]
    ) -> dict[str, Any]:
        """Language-model inputs besides ``inputs_embeds`` for the whole prompt (none by default).

        Args:
            masks: per modality, ``[1, L]`` bool placeholder positions.
            features: the output of :meth:`visual_features`.
        """
        return {}

    def text_prompt(self, ids: torch.Tensor) -> dict[str, Any]:
        """Language-model inputs of ``[1, m]`` text tokens (no placeholder among them): ``inputs_embeds``, plus what a
        family's model reads besides (Gemma 4's per-layer inputs)."""
        return {"inputs_embeds": self.model.get_input_embeddings()(ids)}

    def select_prompt(self, prompt: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        """The language-model inputs of the prompt positions ``index`` only.

        Families whose :meth:`extra_prompt_inputs` adds per-position inputs override this to cut them too.

        Args:
            prompt: language-model inputs of a sequence of ``S`` positions (``inputs_embeds``: ``[1, S, D]``).
            index: ``[k]`` long, ascending positions into those ``S``.

        Returns:
            The inputs of the ``k`` positions (``inputs_embeds``: ``[1, k, D]``).
        """
        return {"inputs_embeds": prompt["inputs_embeds"][:, index]}

    def embed_prompt(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Language-model inputs for the whole prompt with the visual features merged in.

        Args:
            inputs: processor outputs for one prompt (batch 1).

        Returns:
            Keyword arguments of the language model: ``inputs_embeds`` ``[1, L, D]`` (text embeddings with every
            placeholder replaced by its visual feature) plus :meth:`extra_prompt_inputs`.
        """
        ids = inputs["input_ids"]
        embeds = self.model.get_input_embeddings()(ids)  # [1, L, D]
        features = self.visual_features(inputs)
        masks: dict[str, torch.Tensor] = {}
        for modality, feats in features.items():
            values = feats.embeds.to(embeds.device, embeds.dtype)
            mask = self.placeholder_mask(inputs, embeds, modality, values)
            embeds = embeds.masked_scatter(mask, values)
            masks[modality] = mask[..., 0]
        return {"inputs_embeds": embeds, **self.extra_prompt_inputs(masks, features)}

    def placeholder_mask(
        self, inputs: dict[str, torch.Tensor], embeds: torch.Tensor, modality: str, values: torch.Tensor
    ) -> torch.Tensor:
        """``[1, L, 1]`` bool: the placeholders of ``modality`` among the prompt ``inputs``' ids, by the model's own
        ``get_placeholder_mask``, which checks that they match the ``[n, D]`` features ``values`` (a model with one
        kind of placeholder gives its one mask; one with pictures and videos, both)."""
        given = {f"{modality}_features": values}
        masks = self.model.model.get_placeholder_mask(inputs["input_ids"], inputs_embeds=embeds, **given)
        if not isinstance(masks, tuple):
            return masks
        image_mask, video_mask = masks
        return image_mask if modality == "image" else video_mask

    def join_prompts(self, prompts: list[dict[str, Any]], length: int) -> dict[str, Any]:
        """Embedded prompts (:meth:`embed_prompt`, batch 1 each) as one batch right-padded to ``length``
        positions: ``inputs_embeds`` ``[B, length, D]``. Families whose :meth:`extra_prompt_inputs` adds inputs
        override this to join them too."""
        first = prompts[0]["inputs_embeds"]
        embeds = first.new_zeros(len(prompts), length, first.shape[-1])
        for row, prompt in enumerate(prompts):
            if set(prompt) != {"inputs_embeds"}:
                raise TypeError(f"{type(self).__name__}.join_prompts cannot join the inputs {sorted(prompt)}")
            embeds[row, : prompt["inputs_embeds"].shape[1]] = prompt["inputs_embeds"][0]
        return {"inputs_embeds": embeds}
