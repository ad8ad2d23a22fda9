"""Video time windows (:class:`vlmspec.VideoClip`): which frames a clip samples, in the pipeline, in messages, and
the errors that name a bad window."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmspec import VideoClip, VLMSpecPipeline
from vlmspec.inputs import load_video
from vlmspec.testing import make_image, make_video_frames, write_video

FPS = 4
FRAMES = 12  # 3 seconds at FPS


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):
    frames = make_video_frames(3, num_frames=FRAMES, size=(64, 64))
    return write_video(tmp_path_factory.mktemp("clip") / "clip.mp4", frames, fps=FPS)


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, torch_dtype=torch.float32)


def _pixels(frames) -> list[np.ndarray]:
    return [np.asarray(frame) for frame in frames]


def test_a_clip_of_a_file_samples_only_its_window_and_keeps_the_frames_places(clip_file):
    every, _ = load_video(clip_file, num_frames=FRAMES)
    frames, meta = load_video(VideoClip(clip_file, start=1.0, end=2.0), num_frames=3)
    # 1 s to 2 s at 4 fps: frames 4..8, three of them sampled evenly; the window's frame count, as qwen_vl_utils
    # counts a clip (Qwen2.5-VL's time spacing comes from it), with the frames' places in the whole video.
    assert meta.frames_indices == [4, 6, 8] and meta.total_num_frames == 5 and meta.fps == pytest.approx(FPS)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(_pixels(frames), _pixels(every[i] for i in (4, 6, 8)), strict=True)
    )
    assert load_video(VideoClip(clip_file, start=2.0), num_frames=8)[1].frames_indices == [8, 9, 10, 11]
    assert load_video(VideoClip(clip_file, end=0.5), num_frames=8)[1].frames_indices == [0, 1, 2]
    assert (
        load_video(VideoClip(clip_file), num_frames=4)[1].frames_indices
        == load_video(clip_file, 4)[1].frames_indices
    )


def test_a_clip_of_frames_keeps_every_frame_of_its_window():
    frames = make_video_frames(1, num_frames=8)
    clipped, meta = load_video(VideoClip(frames, start=1.0, end=2.5), fps=2.0)
    assert meta.frames_indices == [2, 3, 4, 5] and meta.total_num_frames == 4
    assert len(clipped) == 4
    assert all(np.array_equal(a, b) for a, b in zip(_pixels(clipped), _pixels(frames[2:6]), strict=True))


def test_the_pipeline_answers_a_clip_as_it_answers_the_clips_frames(pipe, clip_file):
    frames = make_video_frames(1, num_frames=8)
    clip = pipe(None, "Describe this video.", video=VideoClip(frames, start=1.0, end=2.5), max_new_tokens=12)
    cut = pipe(None, "Describe this video.", video=frames[2:6], max_new_tokens=12)
    assert (
        clip.token_ids == cut.token_ids and clip.stats.target_visual_tokens == cut.stats.target_visual_tokens
    )
    whole = pipe(None, "Describe this video.", video=frames, max_new_tokens=12)
    assert whole.stats.target_visual_tokens > clip.stats.target_visual_tokens
    # A messages video item clips with qwen_vl_utils' keys, and gives what the VideoClip gives.
    item = {"type": "video", "video": str(clip_file), "video_start": 1.0, "video_end": 2.5}
    messages = [{"role": "user", "content": [item, {"type": "text", "text": "Describe this video."}]}]
    by_messages = pipe(messages=messages, max_new_tokens=12, num_frames=4)
    by_clip = pipe(
        None, "Describe this video.", video=VideoClip(clip_file, 1.0, 2.5), max_new_tokens=12, num_frames=4
    )
    assert by_messages.token_ids == by_clip.token_ids


def test_bad_windows_are_refused_naming_the_window_and_the_video(pipe, clip_file):
    with pytest.raises(ValueError, match=r"end=1 must come after start=2"):
        VideoClip(clip_file, start=2, end=1)
    with pytest.raises(ValueError, match=r"start=-1 is invalid: use seconds >= 0"):
        VideoClip(clip_file, start=-1)
    with pytest.raises(ValueError, match=r"end=inf is invalid"):
        VideoClip(clip_file, end=float("inf"))
    with pytest.raises(TypeError, match=r"start='1' must be a number of seconds"):
        VideoClip(clip_file, start="1")
    with pytest.raises(
        ValueError,
        match=r"clip\.mp4'.*from 10s to 12s holds no frame of a video of 12 frames at 4 fps \(3\.00s\)",
    ):
        load_video(VideoClip(clip_file, 10, 12))
    with pytest.raises(ValueError, match=r"video of 8 frames: the clip from 5s to the end"):
        load_video(VideoClip(make_video_frames(1, num_frames=8), start=5))
    with pytest.raises(
        ValueError, match=r"from 1\.1s to 1\.2s holds no frame .* at least one frame interval \(0\.25s\)"
    ):
        load_video(VideoClip(clip_file, 1.1, 1.2))  # inside the video, between two frames
    with pytest.raises(ValueError, match=r"source is already a VideoClip .* give the window once"):
        VideoClip(VideoClip(clip_file, 1, 2), start=1.5)
    bad = [
        {
            "role": "user",
            "content": [{"type": "video", "video": str(clip_file), "video_start": 3, "video_end": 2}],
        }
    ]
    with pytest.raises(
        ValueError, match=r"messages\[0\]\.content\[0\]: VideoClip end=2 must come after start=3"
    ):
        pipe(messages=bad, max_new_tokens=4)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_a_one_frame_video_is_answered_in_every_family(tiny_pairs, family):
    """Qwen3-VL's video processor refuses fewer frames than its temporal patch (2): the pipeline repeats the last
    frame as Qwen2-VL's processor does itself."""
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    frame = make_image(0)
    inputs = pipe.prepare_inputs(None, "What moves?", [frame])
    assert int(inputs["video_grid_thw"][0, 0]) == 1
    assert pipe(None, "What moves?", video=[frame], max_new_tokens=8).token_ids == pipe.reference_generate(
        inputs, 8
    )
