"""LFM2-VL (``LFM2-VL-450M`` drafting for ``-1.6B`` or ``-3B``, or the LFM2.5-VL sizes): a SigLIP2 NaFlex tower
reading a picture at its own aspect ratio, its patches unshuffled 2 x 2 into a token and projected, in front of an
LFM2 language model with 1-D RoPE, whose layers are short gated convolutions (recurrent layers: :mod:`.hybrid`,
:mod:`.short_conv`) and a few attention layers.

The processor reads a small picture whole (between ``min_image_tokens`` and ``max_image_tokens`` tokens) and cuts a
larger one into tiles of ``tile_size`` pixels plus a thumbnail of the whole, writing ``<|image_start|>``, each tile's
``<|img_row_r_col_c|>`` + one ``<image>`` per token, ``<|img_thumbnail|>`` + its tokens, ``<|image_end|>``.
``pixel_values`` ``[items, P, 3 * p * p]`` holds one row of patches per tile, thumbnail or whole picture, padded to
the most patches (``pixel_attention_mask``), ``spatial_shapes`` ``[items, 2]`` its patch grid. So vlmspec reads a
prompt's media items as those rows, counted as images in order (SmolVLM2's tiles are read so too): an item's tokens
are its grid's, 2 x 2 patches each.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import NO_VIDEO_TOKEN
from .data import VisualFeatures
from .hybrid import HybridDecoder, LayerCall
from .media import pictures_per_row
from .short_conv import short_conv_tree

_ROWS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
"""The processor outputs with one row per item."""


class LfmDecoder(HybridDecoder):
    """LFM2's and LFM3's decoder (the families' adapters' shared part)."""

    attention_norm_name, final_norm_name = "operator_norm", "embedding_norm"

    def decoder_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
        """LFM2's and LFM3's decoder layer: norm, mixer (attention, or the short convolution), its output normed
        where the layer has a norm there (LFM3's sandwich norms), residual; the same around the MLP."""
        mixed = layer.operator_norm(hidden)
        if layer.is_attention_layer:
            mixed = layer.self_attn(hidden_states=mixed, **call.attend)[0]
        else:
            mixed = short_conv_tree(layer.conv, mixed, call)
        hidden = hidden + _after(layer, "post_operator_norm")(mixed)
        return hidden + _after(layer, "post_ffn_norm")(layer.feed_forward(layer.ffn_norm(hidden)))


def _after(layer: torch.nn.Module, norm: str) -> torch.nn.Module:
    """The layer's norm ``norm`` (LFM3's sandwich norms; an ``Identity`` where its config turns them off), or an
    identity (LFM2 has none)."""
    found = getattr(layer, norm, None)
    return _IDENTITY if found is None else found


_IDENTITY = torch.nn.Identity()


class Lfm2VlAdapter(LfmDecoder):
    model_types = ("lfm2_vl",)
    layout_fields = ("vision_config.patch_size", "downsample_factor")
    fixed_processor_settings = frozenset({"encoder_patch_size", "downsample_factor"})

    def visual_token_ids(self) -> tuple[int, int]:
        return self.config.image_token_id, NO_VIDEO_TOKEN

    # ---- pictures ----------------------------------------------------------------------------------------------
    def visual_features(self, inputs: dict[str, torch.Tensor]) -> dict[str, VisualFeatures]:
        if inputs.get("pixel_values") is None:
            return {}
        out = self.model.model.get_image_features(
            inputs["pixel_values"], inputs["spatial_shapes"], inputs["pixel_attention_mask"], return_dict=True
        )
        return {"image": VisualFeatures(embeds=torch.cat(out.pooler_output))}  # [tokens, D]

    def _tokens_per_item(self, inputs: dict[str, Any]) -> list[int]:
        """Each item's visual tokens: its patch grid, ``downsample_factor`` x ``downsample_factor`` patches each."""
        shapes = inputs.get("spatial_shapes")
        if shapes is None:
            return []
        return (shapes // self.config.downsample_factor).prod(-1).tolist()

    def media_items(self, inputs: dict[str, Any], images: slice, videos: slice) -> dict[str, Any]:
        """The items ``images`` (their patch rows, masks and grids; ``videos`` selects nothing)."""
        pixels = inputs.get("pixel_values")
        if pixels is None or not range(pixels.shape[0])[images]:
            return {}
        return {name: inputs[name][images] for name in _ROWS}

    def media_counts(self, inputs: dict[str, Any], keep: torch.Tensor) -> list[tuple[int, int]]:
        """Each row's items: the items in order, as many as make up the row's placeholders."""
        placeholders = ((inputs["input_ids"] == self.config.image_token_id) & keep).sum(-1).tolist()
        return [(items, 0) for items in pictures_per_row(placeholders, self._tokens_per_item(inputs))]
