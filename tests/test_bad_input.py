"""Bad input gets a clear error naming it, or means what the user meant (issue: bad input never costs a user)."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from PIL import Image
from synthetic import peaked, synthetic_tree

from vlmspec import (
    InputTypeError,
    InvalidInputError,
    VLMSpecError,
    VLMSpecPipeline,
    get_policy,
)
from vlmspec.inputs import load_image, load_images, load_video
from vlmspec.loading import check_dtype
from vlmspec.policies import EAGLE2Config, SAGEConfig, SAGEPolicy, available_policies, policy_class
from vlmspec.pruning import PruningConfig, pruning_config
from vlmspec.testing import make_image


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", gamma=2, torch_dtype=torch.float32
    )


# ---- options are checked by their declared types -------------------------------------------------------------
@pytest.mark.parametrize(
    ("policy", "option", "value", "expected"),
    [
        ("sage", "d_max", "8", "an integer"),
        ("sage", "n_max", 32.0, "an integer"),
        ("sage", "theta_scale", "0.1", "a number"),
        ("sage", "confidence", 3, "a string"),
        ("eagle2", "top_k", True, "an integer"),
        ("pct", "cost_ratio", "0.1", "a number or None"),
        ("wetap", "acceptance", 1, "a string"),
        ("chain", "gamma", None, "an integer"),
        ("static", "paths", 5, "a list"),
        ("dsbd", "top_k", "5", "an integer or None"),
    ],
)
def test_a_wrong_type_is_named_with_what_was_expected(policy, option, value, expected):
    with pytest.raises(ValueError, match=rf"{option}={value!r} is invalid: expected {expected}, got"):
        get_policy(policy, **{option: value})


def test_every_policy_config_accepts_its_own_defaults_and_yaml_lists():
    for name in available_policies():
        config_class = policy_class(name).config_class
        assert config_class.from_dict(config_class().to_dict()) == config_class(), name
    assert SAGEConfig(theta_scale=1).theta_scale == 1  # an int is a number
    assert get_policy("static", paths=[[0], [1], [0, 0]]).config.paths == ((0,), (1,), (0, 0))


def test_pruning_config_names_a_wrong_type_too():
    with pytest.raises(
        ValueError, match=r"PruningConfig.image_ratio must be a number in \[0, 1\).*got '0.5'"
    ):
        PruningConfig(image_ratio="0.5")


def test_eagle2_working_set_is_bounded():
    with pytest.raises(ValueError, match=r"top_k=100 is invalid: at most 36 at depth 6"):
        EAGLE2Config(top_k=100)
    assert EAGLE2Config(top_k=30).with_budget(depth=64).depth == 9  # fitted depths stay within the bound


def test_top_k_above_the_vocabulary_is_the_vocabulary():
    for growth in ("cost", "paper"):
        policy = SAGEPolicy(SAGEConfig(top_k=500, w_max=6, growth=growth))
        draft, _ = synthetic_tree(peaked(16, 0.6))  # a 16-token vocabulary
        tree = policy.build_tree(draft)
        assert tree.num_nodes > 0 and policy.trace()["width"] <= 16
    assert 0.0 <= policy.trace()["alpha"] <= 1.0


# ---- inputs mean what users mean ---------------------------------------------------------------------------------
def _frames(dtype, scale=1.0, n=3, size=(12, 10)):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(n, size[1], size[0], 3))
    return [(f * scale).astype(dtype) for f in frames], frames.astype(np.uint8)


def test_float_frames_in_unit_range_are_scaled_not_blackened():
    floats, uint8 = _frames(np.float32, 1 / 255)
    images, _ = load_video(floats)
    assert all(np.array_equal(np.asarray(im), ref) for im, ref in zip(images, uint8, strict=True))
    wide, _ = _frames(np.int64)
    assert np.array_equal(np.asarray(load_video(wide)[0][0]), uint8[0])  # other integers in [0, 255]: exact


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (np.full((4, 4, 3), 2.0, dtype=np.float32), r"float32 array with values in \[2, 2\]"),
        (np.full((4, 4, 3), np.nan, dtype=np.float64), r"float64 array"),
        (np.full((4, 4, 3), 300, dtype=np.int32), r"int32 array with values in \[300, 300\]"),
        (np.full((4, 4, 3), -1, dtype=np.int16), r"int16 array with values in \[-1, -1\]"),
    ],
)
def test_frames_out_of_their_range_are_refused_with_dtype_and_range(frame, message):
    with pytest.raises(ValueError, match=rf"video frame 0 is a {message}"):
        load_video([frame])


def test_frames_of_different_sizes_and_wrong_types_are_refused():
    with pytest.raises(ValueError, match=r"video frame 1 is 8x8 but frame 0 is 4x4"):
        load_video([Image.new("RGB", (4, 4)), Image.new("RGB", (8, 8))])
    with pytest.raises(
        TypeError, match=r"video frame 0 must be a PIL image or an HxWx3 array, got ndarray of shape"
    ):
        load_video([np.zeros((4, 4), dtype=np.uint8)])
    with pytest.raises(TypeError, match="video must be a file path or a list of frames, got int"):
        load_video(42)
    with pytest.raises(
        TypeError,
        match="image must be a PIL image, a file path, an image file's bytes or a list of them, got int",
    ):
        load_images(42)


def test_stop_strings_takes_one_string_like_generate(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    image = make_image(0)
    full = pipe(image, "Describe.", max_new_tokens=24)
    stop = full.text[len(full.text) // 2 :][:3]  # a piece of the reply's second half
    one = pipe(image, "Describe.", max_new_tokens=24, stop_strings=stop)
    listed = pipe(image, "Describe.", max_new_tokens=24, stop_strings=[stop])
    assert one.token_ids == listed.token_ids and stop in one.text
    assert len(one.token_ids) > 2  # not cut at the first token by one of the string's letters


# ---- one answer for names -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "draft", "message"),
    [
        (
            "testbed-huge",
            None,
            r"target 'testbed-huge' is not an existing folder, a pair name .*did you mean 'testbed-base'",
        ),
        ("tinny", None, r"target 'tinny' is not .*did you mean 'tiny'"),
        ("testbed-base@cpu", "draftt", r"draft 'draftt' is not an existing folder"),
    ],
)
def test_an_unknown_name_is_reported_before_any_download(target, draft, message):
    with pytest.raises(ValueError, match=message):
        VLMSpecPipeline.from_pretrained(target, draft)


def test_hub_ids_and_paths_still_pass_the_name_check():
    from vlmspec.named_pairs import resolve_pair

    assert resolve_pair("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2-VL-2B-Instruct").source == "explicit"
    assert resolve_pair("./not/here").target == "./not/here"  # the loader says the folder does not exist


def test_user_errors_are_the_library_s_own_and_the_builtin_ones():
    """Every check of user input raises a VLMSpecError that is also the built-in error callers expect."""
    import vlmspec
    from vlmspec.inputs import load_image
    from vlmspec.named_pairs import resolve_pair

    cases = [
        (lambda: resolve_pair("testbed-huge"), vlmspec.InvalidInputError, ValueError),
        (lambda: get_policy("sage", d_max="8"), vlmspec.InvalidInputError, ValueError),
        (lambda: get_policy("nope"), vlmspec.InvalidInputError, ValueError),
        (lambda: load_image("/no/such/image.png"), vlmspec.InputNotFoundError, FileNotFoundError),
        (lambda: load_image(42), vlmspec.InputTypeError, TypeError),
        (
            lambda: load_video([Image.new("RGB", (4, 4)), Image.new("RGB", (6, 6))]),
            vlmspec.VLMSpecError,
            Exception,
        ),
    ]
    for call, own, builtin in cases:
        with pytest.raises(own) as caught:
            call()
        assert isinstance(caught.value, vlmspec.VLMSpecError) and isinstance(caught.value, builtin)


# ---- every argument is checked where it is owned, and refused as the library's own error ------------------------
@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"do_sample": True, "top_p": "0.5"}, InvalidInputError, r"top_p='0.5' is invalid: use a number in"),
        ({"do_sample": True, "seed": "abc"}, InvalidInputError, r"seed='abc' is invalid: use an integer"),
        ({"do_sample": True, "seed": 1.5}, InvalidInputError, r"seed=1.5 is invalid: use an integer"),
        ({"seed": "abc"}, InvalidInputError, r"seed='abc' is invalid"),  # greedy: still a mistake
        (
            {"stop_strings": 5},
            InputTypeError,
            r"stop_strings=5 is invalid: use a string or a list of strings",
        ),
        ({"stop_strings": [1]}, InputTypeError, r"stop_strings=\[1\] is invalid: use a string or a list"),
        (
            {"streamer": 5},
            InputTypeError,
            r"streamer=5 is not a streamer: it has no put\(\) or end\(\); pass",
        ),
        ({"max_new_tokens": True}, InvalidInputError, r"max_new_tokens=True is invalid: use an integer >= 1"),
        ({"do_sample": "no"}, InvalidInputError, r"do_sample='no' is invalid: use True .* or False"),
        ({"num_frames": "8"}, InvalidInputError, r"num_frames='8' is invalid: use an integer >= 1"),
        ({"num_frames": True}, InvalidInputError, r"num_frames=True is invalid"),
        ({"eos_token_id": -1}, InvalidInputError, r"eos_token_id=-1 is invalid: token ids are integers >= 0"),
        (
            {"eos_token_id": [2, 10**9]},
            InvalidInputError,
            r"eos_token_id=\[2, 1000000000\] is invalid: the vocab",
        ),
        (
            {"repetition_penalty": "high"},
            InvalidInputError,
            r"repetition_penalty='high' is invalid: use a number",
        ),
        (
            {"max_tokens": 4},
            InputTypeError,
            r"pipe\(...\) does not take max_tokens: it takes image, prompt, video, max_new_tokens, .*eos_token_id, output_scores, structured_outputs, tools, chat_template_kwargs, mm_processor_kwargs; "
            r"did you mean 'max_new_tokens'\?$",
        ),
    ],
)
def test_call_arguments_are_refused_naming_them(pipe, options, error, message):
    with pytest.raises(error, match=message) as caught:
        pipe(make_image(0), "Describe.", **{"max_new_tokens": 4, **options})
    assert isinstance(caught.value, VLMSpecError)


def test_batch_refuses_an_unknown_argument_with_the_calls_own_message(pipe):
    requests = [{"prompt": "Hi", "max_new_tokens": 2}, {"prompt": "Hi", "max_tokens": 2}]
    with pytest.raises(
        InputTypeError,
        match=r"^pipe.batch: request 1: pipe\(...\) does not take max_tokens: it takes image, .*did you",
    ):
        pipe.batch(requests)
    with pytest.raises(InputTypeError, match=r"^pipe\(...\) does not take foo, bar: it takes image, prompt"):
        pipe(None, "Hi", foo=1, bar=2)


def test_batch_takes_a_list_of_requests_and_says_so(pipe):
    with pytest.raises(
        InputTypeError,
        match=r"^pipe.batch takes a list of requests, but got one request as a dict \(keys 'image', 'prompt'\); "
        r"pass a list of dicts",
    ):
        pipe.batch({"image": make_image(0), "prompt": "Hi"})
    with pytest.raises(
        InputTypeError, match=r"^pipe.batch_iter takes a list of requests, but got one request"
    ):
        next(pipe.batch_iter({"prompt": "Hi"}))
    with pytest.raises(
        InputTypeError, match=r"^pipe.batch: request 1: a str is not a request: give one dict"
    ):
        pipe.batch([{"prompt": "Hi", "max_new_tokens": 2}, "Hi"])


def test_prompt_ids_must_be_the_models_token_ids(pipe):
    inputs = pipe.prepare_inputs(None, "Describe.")
    floats = {**inputs, "input_ids": inputs["input_ids"].float()}
    with pytest.raises(
        InvalidInputError, match=r"^inputs\['input_ids'\] is a float32 tensor; token ids are integers"
    ):
        pipe(inputs=floats, max_new_tokens=2)
    with pytest.raises(InvalidInputError, match=r"^input_ids is a float32 tensor; token ids are integers"):
        pipe.generate(**floats, max_new_tokens=2)
    vocab = min(model.get_input_embeddings().weight.shape[0] for model in (pipe.target, pipe.draft))
    outside = {**inputs, "input_ids": inputs["input_ids"].clone()}
    outside["input_ids"][0, -1] = vocab
    message = (
        rf"holds ids in \[\d+, {vocab}\], outside the models' vocabulary \[0, {vocab}\); build the inputs"
    )
    with pytest.raises(InvalidInputError, match=rf"^inputs\['input_ids'\] {message}"):
        pipe(inputs=outside, max_new_tokens=2)
    with pytest.raises(InvalidInputError, match=rf"^input_ids {message}"):
        pipe.generate(**outside, max_new_tokens=2)


def test_a_batch_size_beyond_the_requests_allocates_rows_for_them_only(pipe):
    requests = [{"prompt": "Hi", "max_new_tokens": 3}, {"prompt": "Describe.", "max_new_tokens": 4}]
    huge = pipe.batch(requests, batch_size=10**9)  # before: a KV cache of 10**9 rows was allocated
    assert [o.token_ids for o in huge] == [o.token_ids for o in pipe.batch(requests, batch_size=1)]


def test_prompt_inputs_with_a_key_the_model_does_not_take_are_refused(pipe):
    inputs = pipe.prepare_inputs(make_image(0), "Describe.")
    typo = {("pixel_value" if k == "pixel_values" else k): v for k, v in inputs.items()}
    with pytest.raises(
        InvalidInputError, match=r"^inputs has 'pixel_value', which the target model does not take"
    ):
        pipe(inputs=typo, max_new_tokens=2)  # before: decoded without the image
    with pytest.raises(InvalidInputError, match=r"request 0: inputs has 'foo'"):
        pipe.batch([{"inputs": {**inputs, "foo": torch.ones(1)}, "max_new_tokens": 2}])
    assert len(pipe(inputs=inputs, max_new_tokens=2).token_ids) == 2


def test_generate_refuses_what_generate_would_not_use_and_takes_its_tokenizer(pipe):
    inputs = pipe.prepare_inputs(make_image(0), "Describe.")
    with pytest.raises(
        InputTypeError, match=r"pipe.generate\(\) does not take foo: it takes processor outputs"
    ):
        pipe.generate(**inputs, foo=torch.ones(1), max_new_tokens=2)
    with pytest.raises(
        InputTypeError, match=r"does not take max_tokens: .*; did you mean 'max_new_tokens'\?$"
    ):
        pipe.generate(**inputs, max_tokens=2)
    with pytest.raises(InvalidInputError, match=r"^pipe.generate: row 0: temperature=-1.0 is invalid"):
        pipe.generate(**inputs, do_sample=True, temperature=-1.0, max_new_tokens=2)
    with pytest.raises(InvalidInputError, match=r"batch_size=0 is invalid: use an integer >= 1"):
        pipe.generate(**inputs, batch_size=0, max_new_tokens=2)
    with pytest.raises(InputTypeError, match=r"pad_token_id='x' is invalid: use one token id"):
        pipe.generate(**inputs, pad_token_id="x", max_new_tokens=2)
    with pytest.raises(InvalidInputError, match=r"seed='abc' is invalid: use an integer"):
        pipe.generate(**inputs, do_sample=True, seed="abc", max_new_tokens=2)
    # generate() needs a tokenizer with stop_strings: taken, and the pipeline's own used
    full = pipe(make_image(0), "Describe.", max_new_tokens=16)
    stop = full.text[len(full.text) // 2 :][:3]
    with_tokenizer = pipe.generate(**inputs, max_new_tokens=16, stop_strings=stop, tokenizer=pipe.tokenizer)
    assert torch.equal(with_tokenizer, pipe.generate(**inputs, max_new_tokens=16, stop_strings=stop))
    new = with_tokenizer[0, inputs["input_ids"].shape[1] :].tolist()
    assert new == pipe(make_image(0), "Describe.", max_new_tokens=16, stop_strings=stop).token_ids


def test_an_unknown_dtype_is_refused_before_loading(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    with pytest.raises(
        InvalidInputError, match=r"^torch_dtype='float99' is invalid: use 'auto' .*'bfloat16'"
    ):
        VLMSpecPipeline.from_pretrained(pair.target, pair.draft, torch_dtype="float99")
    with pytest.raises(InvalidInputError, match=r"torch_dtype=5 is invalid"):
        check_dtype(5)
    for taken in (
        "auto",
        "bfloat16",
        torch.float16,
        None,
        {"text_config": "float32", "vision_config": torch.float32},
    ):
        check_dtype(taken)


def test_a_directory_is_named_as_one_not_as_missing(tmp_path):
    where = re.escape(str(tmp_path))
    with pytest.raises(InvalidInputError, match=rf"^image path '{where}' is a directory, not an image file"):
        load_image(tmp_path)
    with pytest.raises(InvalidInputError, match=rf"^video path '{where}' is a directory, not a video file"):
        load_video(str(tmp_path))


def test_image_bytes_are_read_as_an_image_file(pipe):
    image = make_image(0)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    assert np.array_equal(np.asarray(load_image(data)), np.asarray(image.convert("RGB")))
    assert len(load_images(data)) == 1  # one image, not a list of its bytes
    assert (
        pipe(data, "Describe.", max_new_tokens=6).token_ids
        == pipe(image, "Describe.", max_new_tokens=6).token_ids
    )
    with pytest.raises(
        InvalidInputError,
        match=r"^image bytes \(4 bytes, starting b'\\x89PNG'\) are not a readable image file; pass",
    ):
        pipe(b"\x89PNG", "Describe.", max_new_tokens=2)


def test_prune_ratio_zero_keeps_the_pruning_method(pipe):
    for method in ("attention", "uniform"):
        config = pruning_config(method, 0)
        assert config.method == method and not config.enabled and not config.needs_scores
    built = VLMSpecPipeline(
        pipe.target,
        pipe.draft,
        pipe.processor,
        policy=get_policy("chain", gamma=2),
        pruning="attention",
        prune_ratio=0,
    )
    assert built.pruning == PruningConfig(method="attention", image_ratio=0, video_ratio=0, min_keep=0)
    # A later per-call ratio prunes the way that was asked: by the target's attention.
    call = built._prepare({"image": make_image(0), "prompt": "Describe.", "prune_ratio": 0.5})
    assert call.draft.needs_scores


def test_media_the_processor_cannot_take_are_refused_naming_what_to_change(pipe):
    with pytest.raises(
        InvalidInputError, match=r"image 'https://example.com/a.png' is a URL: vlmspec reads local"
    ):
        pipe("https://example.com/a.png", "Describe.", max_new_tokens=2)
    with pytest.raises(InvalidInputError, match=r"processor refused .*aspect ratio must be smaller than 200"):
        pipe(Image.new("RGB", (5, 3000)), "Describe.", max_new_tokens=2)
    with pytest.raises(
        InvalidInputError, match=r"holds the model's image placeholder '<\|image_pad\|>' \(1 more"
    ):
        pipe(None, "What is <|image_pad|>?", max_new_tokens=2)


def test_llava_s_image_placeholder_in_the_prompt_text_is_refused(tiny_pairs):
    pair = tiny_pairs["llava_onevision"]
    llava = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    with pytest.raises(
        InvalidInputError, match=r"placeholder '<image>' \(1 more than the 1 image\(s\) given\)"
    ):
        llava(make_image(0), "<image>\nDescribe this.", max_new_tokens=2)
    assert len(llava(make_image(0), "Describe this.", max_new_tokens=2).token_ids) == 2


def test_policy_options_beside_a_policy_object_are_refused_not_dropped(pipe):
    with pytest.raises(
        InvalidInputError, match=r"policy options gamma were given with a policy object \('chain'\)"
    ):
        VLMSpecPipeline(pipe.target, pipe.draft, pipe.processor, policy=get_policy("chain"), gamma=7)
    built = VLMSpecPipeline(pipe.target, pipe.draft, pipe.processor, policy="chain", gamma=7)
    assert built.policy.config.gamma == 7


def test_chat_options_and_system_prompt_are_checked_when_the_chat_starts(pipe):
    with pytest.raises(InputTypeError, match=r"does not take max_tokens.*did you mean 'max_new_tokens'"):
        pipe.chat(max_tokens=3)
    with pytest.raises(
        InputTypeError, match=r"pipe.chat\(system=...\) must be a string \(the system prompt\), got 5"
    ):
        pipe.chat(system=5)


def test_a_testbed_pair_without_a_shipped_edd_draft_is_the_library_s_error():
    with pytest.raises(InvalidInputError, match="no EDD draft ships for the testbed mini qwen2_vl target"):
        VLMSpecPipeline.from_pretrained("testbed-mini", draft="edd")


def test_a_model_whose_attention_cannot_take_a_tree_mask_is_refused(pipe):
    text = pipe.target.config.get_text_config()
    previous, text._attn_implementation = text._attn_implementation, "flash_attention_2"
    try:
        with pytest.raises(
            InvalidInputError, match=r"target model uses attn_implementation='flash_attention_2'.*sdpa"
        ):
            VLMSpecPipeline(pipe.target, pipe.draft, pipe.processor, policy="chain")
    finally:
        text._attn_implementation = previous


def test_an_undecodable_video_s_error_keeps_decord_s_reason_not_its_log_prefix(tmp_path):
    from vlmspec.inputs import load_video, undecodable_video

    logged = "[01:37:03] /github/workspace/src/video/video_reader.cc:270: [a.mp4] Failed to measure duration."
    assert str(undecodable_video("a.mp4", RuntimeError(logged))) == (
        "video file 'a.mp4' could not be decoded (Failed to measure duration.); check that it is a valid video"
    )
    (bad := tmp_path / "bad.mp4").write_bytes(b"not a video")
    with pytest.raises(InvalidInputError, match=r"bad.mp4' could not be decoded \((?!\[\d)"):
        load_video(bad)
    make_image(0).save(picture := tmp_path / "shot.png")
    with pytest.raises(InvalidInputError, match=r"shot.png' is a picture: pass it as an image"):
        load_video(picture)


# ---- images and videos as transformers reads them (found by a QA pass on media inputs) -----------------------------


def test_images_convert_as_transformers_converts_them(tmp_path, monkeypatch):
    """A transparent PIL image composited onto white (the image processors' convert_to_rgb), a file read with its
    EXIF orientation (transformers' load_image, which chat templates use for paths), a data URI as its bytes."""
    import base64

    from transformers.image_transforms import convert_to_rgb
    from transformers.image_utils import load_image as hf_load_image

    pixels = np.array(make_image(0).convert("RGBA"))
    pixels[:, :20, 3] = 0
    rgba = Image.fromarray(pixels, "RGBA")
    assert np.array_equal(np.array(load_image(rgba)), convert_to_rgb(rgba, return_numpy=True))
    assert not np.array_equal(np.array(load_image(rgba)), np.array(rgba.convert("RGB")))
    photo = make_image(1).resize((64, 32))
    exif = photo.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees on display
    path = tmp_path / "photo.jpg"
    photo.save(path, exif=exif)
    assert load_image(path).size == hf_load_image(str(path)).size == (32, 64)
    assert np.array_equal(np.array(load_image(str(path))), np.array(hf_load_image(str(path))))
    buffer = io.BytesIO()
    make_image(2).save(buffer, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    assert np.array_equal(np.array(load_image(uri)), np.array(load_image(buffer.getvalue())))
    assert np.array_equal(np.array(load_image(memoryview(buffer.getvalue()))), np.array(load_image(uri)))
    with pytest.raises(InvalidInputError, match="data URI .* is not an image"):
        load_image("data:image/png;base64,%%%")
    with pytest.raises(InvalidInputError, match="image path is an empty string"):
        load_image("")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(InvalidInputError, match=r"MAX_IMAGE_PIXELS if you trust the file"):
        load_image(buffer.getvalue())


def test_video_arguments_that_are_not_one_video_are_named(tmp_path):
    from vlmspec.inputs import VideoClip
    from vlmspec.testing import make_video_frames

    with pytest.raises(InputTypeError, match="a video file's bytes are not read: write them to a file"):
        load_video(b"\x00\x00\x00\x18ftypmp42")
    with pytest.raises(InvalidInputError, match=r"video takes one video .* list of 2 str items; .*messages="):
        load_video(["a.mp4", "b.mp4"])
    # A clip counts its own frames (qwen_vl_utils): Qwen2.5-VL's time spacing comes from that count.
    frames, metadata = load_video(VideoClip(make_video_frames(0, num_frames=8), 1.0, 2.0), fps=2.0)
    assert metadata.total_num_frames == len(frames) == 3 and metadata.frames_indices == [2, 3, 4]


def test_a_prompt_s_videos_of_different_lengths_are_named_for_llava(tiny_pairs):
    """LLaVA-OneVision's processor stacks a prompt's videos into one tensor: videos of 3 and 5 frames are refused
    naming the frame counts (its own message suggests padding=True, which a pipeline call cannot take)."""
    from vlmspec import VLMSpecPipeline
    from vlmspec.testing import make_video_frames

    pair = tiny_pairs["llava_onevision"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    content = [
        {"type": "video", "video": make_video_frames(0, num_frames=3)},
        {"type": "video", "video": make_video_frames(1, num_frames=5)},
        {"type": "text", "text": "Compare them."},
    ]
    with pytest.raises(
        InvalidInputError, match=r"videos, of 3 and 5 frames: it takes a prompt's videos only with"
    ):
        pipe(messages=[{"role": "user", "content": content}], max_new_tokens=2)
