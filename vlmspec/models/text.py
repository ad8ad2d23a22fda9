"""A language model drafting for a VLM: the draft reads the prompt's text and none of its pictures or videos.

The smallest model of a series is often a language model only: ``gemma-3-1b-it`` under the Gemma 3 VLMs (4B is
their smallest), ``Qwen3-0.6B`` and ``Qwen2.5-0.5B-Instruct`` under Qwen3-VL and Qwen2.5-VL (2B and 3B are
theirs), sharing their tokenizers. Such a draft costs less per forward than any VLM of the series, and its prefill
runs no vision tower and no visual token. What it gives up is what the pictures tell: where the reply reads them
(a caption), it proposes less of what the target says (``docs/text_drafts.md`` has the figures). Under LLaVA-1.5,
whose series has no VLM below 7B, a small LLaMA is the usual draft.

How it reads a prompt: it is the draft's visual-token pruning taken to the end. The prompt's visual placeholder
tokens (the target's image and video placeholders) are left out, whatever the pipeline's prune ratio; the
tokens around them (``<|vision_start|>``, ``<start_of_image>``, ...) stay, so the draft knows that a picture was
there. The text tokens sit at *consecutive* positions ``0 .. T-1``, and the reply's tokens after them, so the
draft reads exactly the text-only prompt it was trained on; the engine's logical positions (which count the
target's visual tokens too) map to the draft's with ``rope_delta`` = minus the number of visual tokens left out.
Why consecutive rather than each token at the target's place (a VLM draft's pruning keeps the gaps, since its
rotary positions were trained with the pictures there): a language model has never seen a gap of hundreds of
positions inside its context, and nothing in its training says what one would mean.

A model with local layers (Gemma 3's text models) gets its window in the tree mask as a Gemma 3 VLM does
(:func:`~vlmspec.models.gemma3.window_masks`): its cache holds only its own tokens, at consecutive positions, so a
cache entry's index is its position, which is what the window rule reads.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache

from .base import VLMAdapter
from .gemma3 import layer_masks

TEXT_DRAFT_TYPES: tuple[str, ...] = ("qwen2", "qwen3", "gemma3_text", "llama", "cohere2", "cohere")
"""``model_type`` of the language models that draft for a VLM: the language models of the families vlmspec takes
(Qwen2 under Qwen2-VL, Qwen2.5-VL, LLaVA-OneVision, InternVL3 and Ovis2; Qwen3 under Qwen3-VL and InternVL3.5; Gemma 3's
text models under Gemma 3; LLaMA under LLaVA-1.5 and LLaVA-NeXT-Video, e.g. a Vicuna-tokenizer LLaMA of 68M-160M
parameters, the draft of Gagrani et al., "On Speculative Decoding for Multimodal Large Language Models", 2024; SmolLM2
under SmolVLM; Cohere2 and Cohere under Aya Vision, e.g. Command R7B or Aya Expanse 8B for aya-vision-32b). A draft must also share the target's tokenizer (:func:`vlmspec.loading.check_compatible`)."""


class TextDraftAdapter(VLMAdapter):
    """The engine's handle on a language model drafting for a VLM (see the module docstring).

    Args:
        model: the ``*ForCausalLM`` draft.
        target: the target's adapter, whose visual placeholder ids mark the tokens the draft leaves out.
    """

    reads_pictures = False

    def __init__(self, model: torch.nn.Module, target: VLMAdapter) -> None:
        super().__init__(model)
        self._visual_ids = target.visual_token_ids()

    def visual_token_ids(self) -> tuple[int, int]:
        return self._visual_ids

    def prompt_rope(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, L]`` positions that count the text tokens only (a visual token gets the position of the text token
        after it; none is ever run), and ``rope_delta`` = minus the number of visual tokens."""
        visual = self.prompt_layout(inputs).visual.to(self.device)  # [L] bool
        before = torch.cumsum(visual.long(), dim=0) - visual.long()  # visual tokens before each position
        positions = torch.arange(visual.numel(), device=self.device) - before
        return positions[None], -visual.sum()

    @staticmethod
    def rope_ids(positions: torch.Tensor, rope_delta: torch.Tensor) -> torch.Tensor:
        return (positions + rope_delta)[None]  # [1, n]

    def embed_prompt(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Token embeddings only (the visual placeholders, which no run keeps, embedded as id 0: a language
        model's table need not hold them, as ``gemma-3-1b``'s holds no ``<image_soft_token>``). A token the VLM's
        tokenizer added past the table (LLaVA-1.5's ``<pad>``, SmolVLM's tile markup) is read as the table's last
        row, the stand-in :meth:`vlmspec.draft.DraftVocab.feed` gives the reply's tokens."""
        ids = inputs["input_ids"]
        visual = self.prompt_layout(inputs).visual.to(ids.device)[None]  # [1, L]
        rows = self.model.get_input_embeddings().weight.shape[0]
        return {"inputs_embeds": self.embeddings(ids.masked_fill(visual, 0).clamp(max=rows - 1))}

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        return {}  # no media: the draft reads the text only

    def run_positions(
        self, inputs: dict[str, torch.Tensor], keep: torch.Tensor | None, start: int = 0
    ) -> torch.Tensor:
        """The prompt's text positions from ``start`` on, among ``keep`` when given (the pipeline's pruning may keep
        visual tokens; this draft leaves every one out): what a prefill, or an :meth:`extend` of a later turn, runs."""
        text = ~self.prompt_layout(inputs).visual.to(self.device)
        text[:start] = False
        if keep is not None:
            text &= torch.zeros_like(text).index_fill(0, keep.to(self.device).long(), True)
        return text.nonzero().flatten()

    def _prompt_rows(self, inputs: dict[str, torch.Tensor], keep: torch.Tensor | None) -> Any:
        return super()._prompt_rows(inputs, self.run_positions(inputs, keep))

    def _logits(
        self, cache: Cache, rows: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return super()._logits(cache, rows, position_ids, layer_masks(bias, position_ids, self.config))
