"""Gemma 3 (``gemma-3-4b-it`` drafting for ``-12b-it`` / ``-27b-it``): the tiny ``gemma3`` pair is lossless like
the other families, and the two things only Gemma 3 has are exercised, not just present:

* its local layers attend over a window (24 tokens in the fixture, so that every reply runs past it): the replies
  checked here differ from what the same model gives without the window;
* a picture's tokens attend to each other both ways in the prefill: the prefills vlmspec builds itself (batched,
  pruned, a conversation's later turns) rebuild that mask, and a batch differs without it.

Pictures only: a video reaches the model as its frames, each a picture after a label with its time (the caption job
included)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import vlmspec_caption
from conftest import PROMPTS
from test_batching import (
    mixed_requests,
)
from test_batching import reference as batch_reference

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.models import gemma3
from vlmspec.testing import build_tiny_pair, input_kinds, make_image, make_video_frames, write_video

POLICIES = ("ar", "chain", "static", "sage", "eagle2")
MAX_NEW = 48
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 64, "pan_and_scan_max_num_crops": 4}
"""Processor settings that cut a wide picture into crops (a 900x300 picture: itself and three crops)."""
MEDIA = {"image": make_image(0), "two_images": [make_image(1), make_image(2)], "text": None}


@pytest.fixture(scope="module")
def gemma(tiny_root):
    """The pair's pipeline, and ``generate()``'s reply to every input kind x two prompts."""
    pair = build_tiny_pair("gemma3", root=tiny_root)
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    cases = []
    for kind in input_kinds("gemma3"):
        for prompt in PROMPTS[:2]:
            inputs = pipe.prepare_inputs(MEDIA[kind], prompt)
            cases.append((kind, prompt, MEDIA[kind], pipe.reference_generate(inputs, MAX_NEW), inputs))
    return pipe, cases


def test_the_pair_has_local_and_global_layers_and_replies_run_past_the_window(gemma):
    pipe, cases = gemma
    assert input_kinds("gemma3") == ("image", "two_images", "text")
    for model in (pipe.target, pipe.draft):
        text = model.config.get_text_config()
        assert type(model).__name__ == "Gemma3ForConditionalGeneration"
        assert set(text.layer_types) == {"sliding_attention", "full_attention"}
        assert text.sliding_window == 24
    for kind, _, _, expected, inputs in cases:
        assert inputs["input_ids"].shape[1] + len(expected) > 2 * 24, kind


def test_the_window_and_the_pictures_masks_decide_the_replies(gemma):
    """Without the window (or with a causal prefill) the same weights give other replies: the lossless tests below
    check both masks, not a model on which they make no difference."""
    pipe, cases = gemma
    text = pipe.target.config.get_text_config()
    text.sliding_window = 10_000
    try:
        unwindowed = [pipe.reference_generate(inputs, MAX_NEW) for *_, inputs in cases]
    finally:
        text.sliding_window = 24
    assert sum(got != case[3] for got, case in zip(unwindowed, cases, strict=True)) >= 3
    pictures = [case for case in cases if case[2] is not None]
    causal = [
        pipe.reference_generate({k: v for k, v in inputs.items() if k != "token_type_ids"}, MAX_NEW)
        for *_, inputs in pictures
    ]
    assert any(got != case[3] for got, case in zip(causal, pictures, strict=True))


def test_pan_and_scan_crops_alone_pruned_and_in_a_batch(gemma):
    """Pan-and-scan (a processor setting): a wide picture becomes the picture and its crops, each a block of its
    own; the replies stay the target's alone, with a pruned draft and beside another request in a batch."""
    pipe, _ = gemma
    pipe.policy = get_policy("sage")
    wide = make_image(0).resize((900, 300))
    settings = PAN_AND_SCAN
    inputs = pipe.prepare_inputs(wide, "Describe.", mm_processor_kwargs=settings)
    assert inputs["pixel_values"].shape[0] == 4  # the picture and three crops
    expected = pipe.reference_generate(inputs, MAX_NEW)
    assert pipe(wide, "Describe.", mm_processor_kwargs=settings, max_new_tokens=MAX_NEW).token_ids == expected
    pruned = pipe(wide, "Describe.", mm_processor_kwargs=settings, max_new_tokens=MAX_NEW, prune_ratio=0.5)
    assert pruned.token_ids == expected
    assert pruned.stats.draft_visual_tokens == pruned.stats.target_visual_tokens // 2
    requests = [
        {"image": wide, "prompt": "Describe.", "mm_processor_kwargs": settings, "max_new_tokens": MAX_NEW},
        {"image": make_image(1), "prompt": PROMPTS[0], "max_new_tokens": MAX_NEW},
    ]
    assert pipe.batch(requests, batch_size=2)[0].token_ids == expected


def test_a_batch_needs_the_pictures_both_way_mask(gemma, monkeypatch):
    """The batched prefill is vlmspec's own: without each position's picture it would be causal, and some reply
    would not be the target's (so the batch test above checks the mask it rebuilds)."""
    pipe, _ = gemma
    pipe.policy = get_policy("chain")
    requests = mixed_requests(without=("video",))
    monkeypatch.setattr(gemma3.Gemma3Adapter, "extra_prompt_inputs", lambda self, masks, features: {})
    outputs = pipe.batch(requests, batch_size=6)
    assert any(out.token_ids != batch_reference(pipe, r) for r, out in zip(requests, outputs, strict=True))


def _frames_as_pictures_chat(frames: list, times: list[float], text: str) -> list[dict]:
    """By hand, what vlmspec gives Gemma 3 for a video: each frame a picture after its time."""
    content = [{"type": "image", "image": make_image(3)}]
    for frame, seconds in zip(frames, times, strict=True):
        content += [{"type": "text", "text": f"Frame at {seconds} s:"}, {"type": "image", "image": frame}]
    return [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]


@pytest.mark.parametrize("policy", ["sage", "chain"])
def test_a_video_is_given_as_its_frames_pictures_each_after_its_time(gemma, policy):
    """Gemma 3 takes no video: a video reaches it as its frames, each a picture after a label with its time (frames
    given as a list: consecutive at 2 frames a second), in place among the turn's other pictures."""
    pipe, _ = gemma
    frames = make_video_frames(0)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": make_image(3)},
                {"type": "video", "video": frames},
                {"type": "text", "text": "What happens?"},
            ],
        }
    ]
    inputs = pipe.prepare_messages(messages)
    by_hand = pipe.processor.apply_chat_template(
        _frames_as_pictures_chat(frames, [0.0, 0.5, 1.0, 1.5], "What happens?"),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert inputs["input_ids"].tolist() == by_hand["input_ids"].tolist()
    assert torch.equal(inputs["pixel_values"], by_hand["pixel_values"])
    assert inputs["pixel_values"].shape[0] == 1 + len(frames)
    pipe.policy = get_policy(policy)
    out = pipe(messages=messages, max_new_tokens=MAX_NEW)
    assert out.token_ids == pipe.reference_generate(inputs, MAX_NEW)
    assert out.stats.mean_accepted > 0
    wide = [frame.resize((900, 300)) for frame in frames]  # the pictures' settings apply to the frames
    inputs = pipe.prepare_inputs(None, "What happens?", video=wide, mm_processor_kwargs=PAN_AND_SCAN)
    assert inputs["pixel_values"].shape[0] == 4 * len(frames)


def test_the_caption_job_captions_videos_with_a_gemma_3_target(gemma, tiny_root, tmp_path):
    """The caption job (video only) works with a family that reads pictures only: each caption is the target's own
    greedy reply to the video's sampled frames (times from the file's frame rate)."""
    pipe, _ = gemma
    pair = build_tiny_pair("gemma3", root=tiny_root)
    for i in range(2):
        write_video(tmp_path / "videos" / f"clip{i}.mp4", make_video_frames(i, num_frames=6), fps=4)
    out = tmp_path / "captions.jsonl"
    args = [str(tmp_path / "videos"), f"--out={out}", f"--target={pair.target}", f"--draft={pair.draft}"]
    assert vlmspec_caption.main([*args, "--max-new-tokens", "16", "--num-frames", "4", "--no-progress"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["clip0.mp4", "clip1.mp4"]
    for record in records:
        inputs = pipe.prepare_inputs(
            None, record["prompt"], video=str(tmp_path / "videos" / record["id"]), num_frames=4
        )
        prompt = pipe.processor.tokenizer.decode(inputs["input_ids"][0])
        # frames 0, 2, 3 and 5 of 6 at 4 frames a second
        labels = [f"Frame at {seconds} s:" for seconds in (0.0, 0.5, 0.8, 1.2)]
        positions = [prompt.find(label) for label in labels]
        assert min(positions) > 0 and positions == sorted(positions)
        reply = pipe.reference_generate(inputs, 16)
        assert record["caption"] == pipe.tokenizer.decode(reply, skip_special_tokens=True)


def test_a_template_that_writes_the_bos_token_gets_no_second_one(gemma):
    """Gemma's chat template starts with ``{{ bos_token }}``, and its tokenizer adds one more unless told not to: a
    prompt then has one, as ``processor.apply_chat_template(tokenize=True)`` gives it."""
    pipe, _ = gemma
    processor = copy.deepcopy(pipe.processor)
    processor.tokenizer.bos_token = "<|endoftext|>"
    processor.tokenizer.add_bos_token = True  # the tokenizer adds it to what it encodes, as Gemma's does
    processor.chat_template = "{{ bos_token }}" + processor.chat_template
    bos = processor.tokenizer.bos_token_id
    assert processor.tokenizer("hi")["input_ids"][0] == bos
    with_bos = VLMSpecPipeline(pipe.target, pipe.draft, processor, policy="chain")
    ids = with_bos.prepare_inputs(MEDIA["image"], PROMPTS[0])["input_ids"][0].tolist()
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": MEDIA["image"]}, {"type": "text", "text": PROMPTS[0]}],
        }
    ]
    expected = processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, add_generation_prompt=True, return_tensors="pt"
    )["input_ids"][0].tolist()
    assert ids == expected and ids.count(bos) == 1
