"""Gemma 4 (``gemma-4-E2B-it`` or ``-E4B-it`` drafting for ``-31B-it`` or ``-26B-A4B-it``): Gemma 4's vision tower,
whose patches (of any aspect ratio, up to a budget of tokens) are pooled and projected, in front of a Gemma 4
language model with 1-D RoPE and local (sliding-window) and global layers, as Gemma 3's (:mod:`.gemma3`, whose
window masks and both-ways picture blocks this adapter shares).

The processor writes a picture as ``<|image>`` + one ``<|image|>`` per visual token + ``<image|>`` (its count from
the picture's size: ``num_soft_tokens_per_image``), a video as each frame's time, then ``<|image>`` + one
``<|video|>`` per visual token + ``<image|>``. ``pixel_values`` ``[pictures, patches, P]`` and
``pixel_values_videos`` ``[frames, patches, P]`` are padded to the budget's patches, the padding marked ``-1`` in
``image_position_ids`` / ``video_position_ids``; ``num_frames_per_video`` cuts the frames by video. Audio is not
read (a prompt with audio is refused by the model's placeholders: vlmspec never passes audio features).

What the other families do not have, and what this adapter does about it:

* **Per-layer inputs** (E2B, E4B: ``hidden_size_per_layer_input``). Each decoder layer adds a vector looked up
  from the token's id in its own table. The model would recover ids from ``inputs_embeds`` by comparing them with
  every row of the embedding table (``[n, V, D]``: gigabytes at Gemma 4's vocabulary of 262,144), so vlmspec
  always passes them: a prompt's from its ids (placeholders read as padding, as the model's own forward does),
  a decoding forward's carried in its input rows: :meth:`Gemma4Adapter.embed` appends each token's per-layer
  vector to its embedding (``[n, D + layers * P]``) and :meth:`Gemma4Adapter.row_inputs` splits them again, so the
  rows pass through the engine, the batcher and the tree code as any family's do.
* **Layers reusing earlier layers' keys** (``num_kv_shared_layers``). The last layers have no keys of their own:
  they read those of the last earlier layer of their kind, as that layer returns them from the cache within the
  same forward. vlmspec's cache keeps every entry (:func:`vlmspec.cache.new_cache`), so a reusing layer sees the
  same keys, and the tree mask of its kind, as the layer it reads; the cache has no entries of its own for it.
* **Both-ways attention over a picture** (31B, 26B-A4B: ``use_bidirectional_attention="vision"``) holds in the
  local layers only; the global ones are causal. ``create_masks_for_vision_model`` of Gemma 4 builds that.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.gemma4.modeling_gemma4 import (
    create_masks_for_vision_model,
    get_block_sequence_ids_for_mask,
)

from ..errors import InvalidInputError
from .data import VisualFeatures
from .gemma3 import BothWaysPictures
from .media import pictures_per_row


class Gemma4Adapter(BothWaysPictures):
    model_types = ("gemma4",)
    layout_fields = (  # patches of patch_size pixels, pooled pooling_kernel_size x pooling_kernel_size into a token
        "vision_config.patch_size",
        "vision_config.pooling_kernel_size",
    )
    fixed_processor_settings = frozenset({"patch_size", "pooling_kernel_size"})
    vision_masks = staticmethod(create_masks_for_vision_model)

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, self.config.video_token_id

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._text = model.config.get_text_config()  # read at every decoding forward

    @property
    def _layer_inputs(self) -> torch.nn.Module | None:
        """The per-layer inputs' table (``None``: a model without them, 31B's)."""
        if not self._text.hidden_size_per_layer_input:
            return None
        return self.model.model.language_model.embed_tokens_per_layer

    # ---- pictures and videos ----------------------------------------------------------------------------------
    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        inner, features = self.model.model, {}
        if inputs.get("pixel_values") is not None:
            out = inner.get_image_features(
                inputs["pixel_values"], inputs["image_position_ids"], return_dict=True
            )
            features["image"] = VisualFeatures(embeds=torch.cat(out.pooler_output))  # [tokens, D]
        if inputs.get("pixel_values_videos") is not None:
            out = inner.get_video_features(
                inputs["pixel_values_videos"],
                inputs["video_position_ids"],
                num_frames_per_video=inputs["num_frames_per_video"],
                return_dict=True,
            )
            features["video"] = VisualFeatures(embeds=torch.cat(out.pooler_output))
        return features

    def placeholder_mask(
        self, inputs: dict[str, torch.Tensor], embeds: torch.Tensor, modality: str, values: torch.Tensor
    ) -> torch.Tensor:
        """``[1, L, 1]``: the placeholders of ``modality``, which must be as many as its ``[n, D]`` features."""
        image, video, _ = self.model.model.get_placeholder_mask(inputs["input_ids"])
        mask = image if modality == "image" else video
        if int(mask.sum()) != values.shape[0]:
            raise InvalidInputError(
                f"the prompt holds {int(mask.sum())} {modality} placeholders but its {modality}s make "
                f"{values.shape[0]} visual tokens; build the inputs with the model's processor"
            )
        return mask[..., None]

    def _tokens_per_item(self, positions: torch.Tensor | None) -> torch.Tensor:
        """``[items]`` visual tokens of each picture or frame, from its patches' ``positions`` ``[items, P, 2]``
        (padding ``-1``): its real patches, pooled."""
        if positions is None:
            return torch.zeros(0, dtype=torch.long)
        pooled = self.config.vision_config.pooling_kernel_size**2
        return (positions != -1).all(-1).sum(-1) // pooled

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The pictures ``images`` (pixel and position rows) and the videos ``videos`` (their frames' rows and
        frame counts)."""
        items: dict[str, Any] = {}
        pixels = inputs.get("pixel_values")
        if pixels is not None and range(pixels.shape[0])[images]:
            items |= {
                "pixel_values": pixels[images],
                "image_position_ids": inputs["image_position_ids"][images],
            }
        frames = inputs.get("num_frames_per_video")
        chosen = range(0 if frames is None else frames.shape[0])[videos]
        if chosen:
            starts = [0, *torch.cumsum(frames, 0).tolist()]  # [videos + 1] first frame of each video
            rows = slice(starts[chosen.start], starts[chosen.stop])
            items |= {
                "pixel_values_videos": inputs["pixel_values_videos"][rows],
                "video_position_ids": inputs["video_position_ids"][rows],
                "num_frames_per_video": frames[videos],
            }
        return items

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's pictures and videos: the items in order, as many as make up the row's placeholders (an
        item's count from its real patches)."""
        ids = inputs["input_ids"]
        image_id, video_id = self.visual_token_ids()
        pictures = self._tokens_per_item(inputs.get("image_position_ids")).tolist()
        frames = self._tokens_per_item(inputs.get("video_position_ids"))
        counts = inputs.get("num_frames_per_video")
        videos = [] if counts is None else [int(t.sum()) for t in torch.split(frames, counts.tolist())]
        images = pictures_per_row(((ids == image_id) & keep).sum(-1).tolist(), pictures)
        clips = pictures_per_row(((ids == video_id) & keep).sum(-1).tolist(), videos)
        return list(zip(images, clips, strict=True))

    # ---- per-layer inputs and both-ways blocks ----------------------------------------------------------------
    def picture_blocks(self, masks: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Each position's picture or video frame (a run of visual tokens), where the model's pictures are read
        both ways (``use_bidirectional_attention="vision"``); else ``None``."""
        if self._text.use_bidirectional_attention != "vision" or not masks:
            return None
        visual = torch.stack(list(masks.values())).any(0)  # [1, L]
        return get_block_sequence_ids_for_mask(visual.long(), device=visual.device)

    def embed_prompt(self, inputs: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The base's, plus ``per_layer_inputs`` ``[1, L, layers, P]``: each placeholder read as padding, as the
        model's own forward reads it."""
        prompt = super().embed_prompt(inputs)
        if self._layer_inputs is not None:
            ids = inputs["input_ids"]
            image, video, audio = self.model.model.get_placeholder_mask(ids)
            text_ids = ids.masked_fill(image | video | audio, self._text.pad_token_id)
            prompt["per_layer_inputs"] = self._unpacked(self._layer_inputs(text_ids))
        return prompt

    def text_prompt(self, ids: torch.Tensor) -> dict[str, Any]:
        prompt = super().text_prompt(ids)
        if self._layer_inputs is not None:
            prompt["per_layer_inputs"] = self._unpacked(self._layer_inputs(ids))
        return prompt

    def _unpacked(self, packed: torch.Tensor) -> torch.Tensor:
        """``[..., layers * P]`` -> ``[..., layers, P]``."""
        return packed.unflatten(-1, (self._text.num_hidden_layers, self._text.hidden_size_per_layer_input))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids -> ``[n, D]`` embeddings, each followed by its per-layer vectors where the model has
        them: ``[n, D + layers * P]`` (see the module docstring)."""
        rows = self.embeddings(tokens)
        if self._layer_inputs is None:
            return rows
        return torch.cat([rows, self._layer_inputs(tokens).to(rows.dtype)], dim=-1)

    def row_inputs(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[B, n, D (+ layers * P)]`` rows of :meth:`embed` -> ``inputs_embeds`` (and ``per_layer_inputs``)."""
        if self._layer_inputs is None:
            return {"inputs_embeds": rows}
        width = self._text.hidden_size
        return {"inputs_embeds": rows[..., :width], "per_layer_inputs": self._unpacked(rows[..., width:])}
