"""LFM3-VL (``LiquidAI/LFM3-VL-2B``): Qwen2-VL's flat patches read by LFM3-VL's own tower, in front of LFM3, a hybrid
language model of 7-wide short convolutions (recurrent layers), local (sliding-window) and global attention layers
with their own rotary tables, sandwich norms and 1-D positions, verified over trees.

The tiny pair is in ``test_more_families.py``'s matrix (every policy, a pruned draft, batches, a conversation) and
``test_hybrid.py``'s (a tree's paths for a picture, two, a video and text, the visual scores, sampling, EDD refused,
host reads). Here: that those cover what only this family has.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoProcessor

from vlmspec.testing import build_tiny_pair, make_inputs


def test_the_fixture_covers_every_kind_of_layer_and_the_local_window(tiny_root):
    """The tiny target has a convolution (7 wide: a path of 4 reads back into the committed inputs), a local layer
    (a 24-token window), a convolution and a global layer, each block's output normed; a video's prompt is longer
    than the window, so ``test_hybrid.py``'s tree over it sees each query's window only, as ``generate()``."""
    pair = build_tiny_pair("lfm3_vl", root=tiny_root)
    text = AutoConfig.from_pretrained(pair.target).text_config
    assert text.layer_types == ["conv", "sliding_attention", "conv", "full_attention"]
    assert text.conv_L_cache == 7 and text.sliding_window == 24 and text.use_sandwich_norm
    video = make_inputs(AutoProcessor.from_pretrained(pair.target), "video")
    assert video["input_ids"].shape[1] > text.sliding_window
