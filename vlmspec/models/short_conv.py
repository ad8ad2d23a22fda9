"""An LFM2 short-convolution layer (LFM2-VL's recurrent layers) over a tree of tokens, one forward for the whole tree.

transformers' layer runs its tokens as one sequence. Here every new entry's convolution reads its own ancestors'
inputs (:meth:`vlmspec.recurrent_cache.RecurrentRows.convolved`); the rest is the layer's own maths through its
modules: ``B, C, x = in_proj(h)``, the gated input ``B * x`` convolved (``K`` wide, depthwise), gated again by ``C``,
then ``out_proj``.
"""

from __future__ import annotations

import torch

from .hybrid import LayerCall


def short_conv_tree(layer: torch.nn.Module, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
    """The output ``[B, n, D]`` of ``layer`` (a ``...ShortConv``) for ``hidden`` ``[B, n, D]`` (the normed input of
    ``n`` new entries per row), whose convolution inputs are written to ``call.recurrent`` as pending entries."""
    gate_in, gate_out, value = layer.in_proj(hidden).chunk(3, dim=-1)  # [B, n, D] each
    mixed = call.recurrent.convolved(call.links, call.index, gate_in * value, layer.conv)  # [B*n, D]
    return layer.out_proj(gate_out * mixed.to(hidden.dtype).view_as(value))
