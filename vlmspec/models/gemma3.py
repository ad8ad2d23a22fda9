"""Gemma 3 (``gemma-3-4b-it`` drafting for ``-12b-it`` or ``-27b-it``): a SigLIP tower whose patches are
average-pooled and projected, in front of a Gemma 3 language model with 1-D RoPE whose layers are local (a
sliding attention window) or global, five local per global one.

Pictures only: Gemma 3 takes no video (a video reaches it as its frames' pictures, each after a label with its time:
:func:`vlmspec.conversations.frames_as_pictures`). The processor writes a picture as ``<start_of_image>`` +
``mm_tokens_per_image`` ``<image_soft_token>`` + ``<end_of_image>``, one row of ``pixel_values`` ``[n, C, H, W]``
per such block (pan-and-scan crops are blocks too, each its own row): a prompt's media items are its blocks.

Two things the other families do not have, and what this adapter does about them:

* **A picture's tokens see each other both ways.** In the prompt, the tokens of one picture attend to every token
  of that picture, later ones included (``token_type_ids`` mark them); everything else is causal. The full prefill
  is the model's own forward, which builds that mask from ``token_type_ids`` exactly as ``generate()``'s prefill
  does. The prefills vlmspec builds itself (batched, pruned, extended prompts) carry each position's picture
  (``image_blocks``) with the embedded prompt and build the same masks with transformers' own
  ``create_masks_for_vision_model``. Generated tokens are text: the engine's tree mask is all they need.
* **Local layers see a window.** A local layer's query at logical position ``q`` sees the keys at ``q - W + 1 ..
  q`` (``W``: ``sliding_window``). vlmspec keeps every layer's keys in one full cache (its tree surgery moves
  entries in place, which a rolling window buffer would not allow) and gives the local layers the tree mask with
  the keys outside the window hidden. A cache entry's index is its logical position for every committed token of
  the target (the target is never pruned, and only accepted paths stay), so the window is taken on cache indices:
  key ``j`` is hidden from query ``q`` when ``j <= q - W``. A tree's own nodes sit past the committed entries,
  within ``depth < W`` of their queries, so the window never hides them (trees are far shallower than Gemma 3's
  1024-token window). This is what ``generate()``'s rolling window computes. A pruned draft's cache is shorter
  than its sequence, so its local layers see a few more tokens than the target's would; only the target decides
  the output.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from transformers.cache_utils import DynamicCache
from transformers.models.gemma3.modeling_gemma3 import (
    create_masks_for_vision_model,
    get_block_sequence_ids_for_mask,
)

from ..cache import cache_length
from .base import VLMAdapter
from .blocks import PlaceholderBlocks
from .data import VisualFeatures


class BothWaysPictures(VLMAdapter):
    """The prompts of a family whose pictures' tokens see each other both ways in the local layers (Gemma 3, Gemma 4;
    see the module docstring): the prefills vlmspec builds itself carry each position's picture (``image_blocks``)
    and build the family's own prefill masks from it (:attr:`vision_masks`). Every input of such a prompt is per
    position (``[1, L, ...]``), so cutting or joining prompts cuts or pads each along the positions."""

    vision_masks: ClassVar[Any] = staticmethod(create_masks_for_vision_model)
    """The family's ``create_masks_for_vision_model``: its prefill masks per layer type, from the picture blocks."""
    padding: ClassVar[dict[str, int]] = {"image_blocks": -1}
    """What pads each per-position input where a joined prompt is shorter than the batch (0 for the others)."""

    def picture_blocks(self, masks: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """``[1, L]``: each prompt position's picture (``0, 1, ..`` in order; ``-1``: text), or ``None`` where the
        prompt's tokens all attend causally (``masks``: per modality, ``[1, L]`` bool placeholder positions)."""
        image = masks.get("image")
        return None if image is None else get_block_sequence_ids_for_mask(image.long(), device=image.device)

    def extra_prompt_inputs(
        self, masks: dict[str, torch.Tensor], features: dict[str, VisualFeatures]
    ) -> dict[str, Any]:
        """``image_blocks`` ``[1, L]`` (:meth:`picture_blocks`), where some picture's tokens see each other."""
        blocks = self.picture_blocks(masks)
        return {} if blocks is None else {"image_blocks": blocks}

    def select_prompt(self, prompt: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
        return {key: value[:, index] for key, value in prompt.items()}

    def join_prompts(self, prompts: list[dict[str, Any]], length: int) -> dict[str, Any]:
        joined = {}
        for key in dict.fromkeys(key for prompt in prompts for key in prompt):
            first = next(prompt[key] for prompt in prompts if key in prompt)
            rows = first.new_full((len(prompts), length, *first.shape[2:]), self.padding.get(key, 0))
            for row, prompt in enumerate(prompts):
                if key in prompt:
                    rows[row, : prompt[key].shape[1]] = prompt[key][0]
            joined[key] = rows  # [B, length, ...]
        return joined

    def _run_language_model(
        self, prompt: dict[str, Any], position_ids: torch.Tensor, cache: DynamicCache, bias: Any = None
    ) -> torch.Tensor:
        """The decoder on prompt positions under the family's own prefill masks: causal, each picture's tokens
        seeing the whole picture, the local layers' window (the cache's earlier entries belong to no picture here)."""
        prompt = dict(prompt)
        blocks = prompt.pop("image_blocks", None)
        if blocks is not None:
            before = cache_length(cache)
            # the cached entries (earlier pictures included) lie before every query: causal is right for them
            if before:
                blocks = torch.cat([blocks.new_full((blocks.shape[0], before), -1), blocks], dim=-1)
            bias = self.vision_masks(
                config=self.config.get_text_config(),
                inputs_embeds=prompt["inputs_embeds"],
                attention_mask=bias,
                cache=cache,
                position_ids=position_ids,
                block_sequence_ids=blocks,
            )
        return super()._run_language_model(prompt, position_ids, cache, bias)

    # ---- the local layers' window -------------------------------------------------------------------------------
    def _logits(
        self, cache: Any, rows: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """The tree mask for the global layers; for the local ones, the same with the keys outside the window
        hidden (see the module docstring)."""
        return super()._logits(cache, rows, position_ids, layer_masks(bias, position_ids, self.config))


class Gemma3Adapter(BothWaysPictures, PlaceholderBlocks):
    model_types = ("gemma3",)
    layout_fields = (  # pictures of image_size pixels, patch_size patches each, pooled to mm_tokens_per_image
        "vision_config.image_size",
        "vision_config.patch_size",
        "vision_config.num_channels",
        "mm_tokens_per_image",
    )
    fixed_processor_settings = frozenset({"size", "do_resize"})  # SigLIP's input side
    placeholder, block = "<image_soft_token>", "picture"
    write_hint = "write each picture in the prompt as <start_of_image> and let the processor expand it"

    @property
    def block_tokens(self) -> int:
        """Placeholders per picture (or pan-and-scan crop): the patches pooled to ``mm_tokens_per_image``."""
        return self.config.mm_tokens_per_image


def layer_masks(
    bias: torch.Tensor, position_ids: torch.Tensor, config: Any
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The tree mask ``bias`` for a model of ``config``: per layer type (:func:`window_masks`) where its language
    model has sliding-window layers (Gemma 3's local ones, Cohere2's), else ``bias`` itself."""
    text = config.get_text_config()
    if "sliding_attention" not in (getattr(text, "layer_types", None) or ()):
        return bias
    return window_masks(bias, position_ids, text.sliding_window)


def window_masks(bias: torch.Tensor, position_ids: torch.Tensor, window: int) -> dict[str, torch.Tensor]:
    """The masks of a model whose layers are global or local (the local ones seeing ``window`` positions), as
    transformers takes them per layer type: ``bias`` ``[B, 1, n, K]`` for the global layers and, for the local ones,
    the same with the keys outside the window of each query hidden, read on cache indices (``position_ids``
    ``[B, n]``: the queries' positions; a cache entry's index is its position, see the module docstring)."""
    keys = torch.arange(bias.shape[-1], device=bias.device)  # [K] cache indices
    outside = keys[None, None, :] <= position_ids[:, :, None] - window  # [B, n, K]
    local = bias.masked_fill(outside[:, None], torch.finfo(bias.dtype).min)
    return {"full_attention": bias, "sliding_attention": local}
