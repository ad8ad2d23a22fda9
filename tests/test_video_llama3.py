"""VideoLLaMA3 (``VideoLLaMA3-2B`` drafting for ``VideoLLaMA3-7B``): the tiny ``video_llama_3`` pair (a tower reading
each picture at its own size, a Qwen2 language model with 1-D positions) is lossless like the other families
(``test_more_families.py``). Here, its own ways: a video's token compression, which drops the frame tokens that
repeat the previous frame's, so a video's features are not all its placeholders and two videos of a batch keep
different counts."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, check_a_padded_batch_splits_into_its_prompts, language_model_inputs

from vlmspec import InvalidInputError, VLMSpecPipeline
from vlmspec.models import check_model_type
from vlmspec.models.video_llama3 import VideoLlama3Adapter
from vlmspec.testing import build_tiny_pair, make_image, make_video_frames

_MEDIA_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "image_merge_sizes",
    "pixel_values_videos",
    "video_grid_thw",
    "video_merge_sizes",
    "video_compression_mask",
)


@pytest.fixture(scope="module")
def video_llama3(tiny_root):
    pair = build_tiny_pair("video_llama_3", root=tiny_root)
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def test_a_compressed_video_is_embedded_as_the_model_embeds_it(video_llama3):
    """The processor drops some of a video's frame tokens (its compression mask is not all kept): the language-model
    inputs the adapter builds (what the pruned draft's prefill, a batch's prefill and a conversation's later turns
    run) are bit for bit those the model's own forward builds, and the placeholders are the kept tokens only."""
    pipe = video_llama3
    inputs = pipe.prepare_inputs(None, PROMPTS[2], video=make_video_frames(3))
    kept = inputs["video_compression_mask"]
    assert 0 < int(kept.sum()) < kept.numel()
    placeholders = inputs["input_ids"][0] == pipe.target.config.video_token_id
    assert int(placeholders.sum()) == int(kept.sum())
    adapter = VideoLlama3Adapter(pipe.target)
    assert torch.equal(
        adapter.embed_prompt(inputs)["inputs_embeds"], language_model_inputs(pipe.target, inputs)
    )
    assert torch.equal(adapter.prompt_layout(inputs).is_video, placeholders)


def test_a_padded_processor_batch_splits_into_each_prompt_s_media(video_llama3):
    """Two videos that keep different numbers of tokens (a moving shape; a still clip, whose later frames keep one
    token each), pictures and a text prompt in one processor batch: each row
    gets its own pixels, grids, merge sizes and part of the compression mask, as the processor gives them for that
    prompt alone, and its reply is that prompt's ``generate()``."""
    prompts = [
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[2]}], [], make_video_frames(3)),
        (
            [{"type": "image"}, {"type": "image"}, {"type": "text", "text": PROMPTS[0]}],
            [make_image(1), make_image(2)],
            None,
        ),
        ([{"type": "text", "text": PROMPTS[3]}], [], None),
        ([{"type": "video"}, {"type": "text", "text": PROMPTS[1]}], [], [make_image(5)] * 4),  # a still clip
    ]

    def same_media(row, alone, b):
        for key in _MEDIA_KEYS:
            assert (key in row) == (key in alone), (b, key)
            if key in alone:
                assert torch.equal(row[key], alone[key]), (b, key)

    batch = check_a_padded_batch_splits_into_its_prompts(video_llama3, prompts, same_media)
    kept = batch["video_compression_mask"].split((batch["video_grid_thw"].prod(-1) // 4).tolist())
    assert [int(k.sum()) for k in kept] == [14, 7]


def test_the_remote_code_checkpoints_are_refused_naming_the_conversion():
    """DAMO-NLP-SG's own checkpoints run their own code (``videollama3_qwen2``): the error names the conversion."""
    with pytest.raises(InvalidInputError, match=r"videollama3_qwen2.*lkhl/VideoLLaMA3-2B-Image-HF"):
        check_model_type("videollama3_qwen2", "DAMO-NLP-SG/VideoLLaMA3-7B")
