"""Bad input gets a clear error naming it, or means what the user meant (issue: bad input never costs a user)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from synthetic import peaked, synthetic_tree

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.inputs import load_images, load_video
from vlmspec.policies import EAGLE2Config, SAGEConfig, SAGEPolicy, available_policies, policy_class
from vlmspec.pruning import PruningConfig
from vlmspec.testing import make_image


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
    policy = SAGEPolicy(SAGEConfig(top_k=500, w_max=6))
    draft, _ = synthetic_tree(peaked(16, 0.6))  # a 16-token vocabulary
    tree = policy.build_tree(draft)
    assert tree.num_nodes > 0 and 0.0 <= policy.trace()["alpha"] <= 1.0


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
    with pytest.raises(TypeError, match="image must be a PIL image, a file path or a list of them, got int"):
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
