"""Processor settings per request (vLLM's ``mm_processor_kwargs``): a request's pictures and videos laid out as it
asks (fewer pixels, fewer visual tokens), the reply still the target's own ``generate()`` on the same inputs, and
every setting the processor cannot take, or that vlmspec sets itself, refused by name."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
import yaml
from conftest import PROMPTS
from test_serving import PROMPT, user_turn

from vlmspec import InvalidInputError, VLMSpecPipeline
from vlmspec.cli import main
from vlmspec.errors import InputTypeError
from vlmspec.openai_api import APIError
from vlmspec.serving import SpecServer
from vlmspec.testing import make_image, make_video_frames

PICTURE = make_image(3, (224, 224))
SMALL = {"size": {"shortest_edge": 56 * 56, "longest_edge": 56 * 56}}  # Qwen2-VL: 4 visual tokens
MAX_NEW = 24


def picture_uri() -> str:
    buffer = io.BytesIO()
    PICTURE.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def qwen(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def test_a_request_s_settings_lay_out_its_picture_and_the_reply_is_generate_s_on_those_inputs(qwen):
    full = qwen(PICTURE, PROMPTS[0], max_new_tokens=MAX_NEW)
    small = qwen(PICTURE, PROMPTS[0], max_new_tokens=MAX_NEW, mm_processor_kwargs=SMALL)
    assert (full.stats.target_visual_tokens, small.stats.target_visual_tokens) == (
        16,
        4,
    )  # the fixture's max: 112^2
    inputs = qwen.prepare_inputs(PICTURE, PROMPTS[0], mm_processor_kwargs=SMALL)
    assert small.token_ids == qwen.reference_generate(inputs, MAX_NEW)
    messages = [
        {"role": "user", "content": [{"type": "image", "image": PICTURE}, {"type": "text", "text": "Hi"}]}
    ]
    chat = qwen(messages=messages, max_new_tokens=MAX_NEW, mm_processor_kwargs={"max_pixels": 56 * 56})
    assert chat.stats.target_visual_tokens == 4
    video = make_video_frames(2)
    clip = qwen(None, PROMPTS[1], video=video, max_new_tokens=MAX_NEW, mm_processor_kwargs=SMALL)
    inputs = qwen.prepare_inputs(None, PROMPTS[1], video, mm_processor_kwargs=SMALL)
    assert clip.token_ids == qwen.reference_generate(inputs, MAX_NEW)


def test_the_pipeline_s_settings_are_every_request_s_and_a_request_s_own_win(qwen):
    qwen.mm_processor_kwargs = SMALL
    try:
        assert qwen.prepare_inputs(PICTURE, PROMPTS[0])["image_grid_thw"].tolist() == [[1, 4, 4]]
        bigger = {"size": {"shortest_edge": 112 * 112, "longest_edge": 112 * 112}}
        out = qwen(PICTURE, PROMPTS[0], max_new_tokens=4, mm_processor_kwargs=bigger)
        assert out.stats.target_visual_tokens == 16
        outs = qwen.batch([{"image": PICTURE, "prompt": p, "max_new_tokens": 4} for p in PROMPTS[:2]], 2)
        assert [o.stats.target_visual_tokens for o in outs] == [4, 4]
    finally:
        qwen.mm_processor_kwargs = None
    assert qwen.mm_processor_kwargs == {}


def test_internvl_takes_its_own_settings(tiny_pairs):
    pair = tiny_pairs["internvl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    out = pipe(PICTURE, PROMPTS[2], max_new_tokens=MAX_NEW, mm_processor_kwargs={"max_patches": 1})
    assert out.stats.target_visual_tokens == 4  # one tile, no thumbnail
    inputs = pipe.prepare_inputs(PICTURE, PROMPTS[2], mm_processor_kwargs={"max_patches": 1})
    assert out.token_ids == pipe.reference_generate(inputs, MAX_NEW)
    with pytest.raises(
        InvalidInputError, match=r"sets max_pixels, which the target's processor does not take.*"
    ):
        pipe(PICTURE, PROMPTS[2], mm_processor_kwargs={"max_pixels": 3136})


@pytest.mark.parametrize(
    "settings, error, said",
    [
        ({"max_patches": 1}, InvalidInputError, r"sets max_patches, which the target's processor does not take for images; "
         r"it takes .*max_pixels"),
        ({"patch_size": 16}, InvalidInputError, r"sets patch_size, which the model fixes: leave it out"),
        ({"do_resize": False}, InvalidInputError, r"sets do_resize, which the model fixes"),
        ({"num_frames": 4}, InvalidInputError, r"vlmspec samples a video's frames itself \(pipe\(\.\.\., num_frames=N\)"),
        ({"device": "meta"}, InvalidInputError, r"sets device, which the call sets itself"),
        ({"return_tensors": "np"}, InvalidInputError, r"sets return_tensors, which the call sets itself"),
        ([("max_pixels", 3136)], InputTypeError, r"use a dict of the processor's settings"),
        ({"max_pixels": "many"}, InvalidInputError, r"processor failed under mm_processor_kwargs=\{'max_pixels'"),
    ],
)  # fmt: skip
def test_settings_the_processor_cannot_take_are_refused_by_name(qwen, settings, error, said):
    with pytest.raises(error, match=said):
        qwen(PICTURE, PROMPTS[0], max_new_tokens=2, mm_processor_kwargs=settings)


@pytest.mark.parametrize("family", ["llava_onevision", "internvl"])
def test_the_tile_size_of_a_family_whose_tower_fixes_it_is_refused(tiny_pairs, family):
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    for key, value in (("size", {"height": 56, "width": 56}), ("do_resize", False)):
        with pytest.raises(
            InvalidInputError, match=rf"mm_processor_kwargs sets {key}, which the model fixes"
        ):
            pipe(PICTURE, PROMPTS[0], max_new_tokens=2, mm_processor_kwargs={key: value})


def test_a_picture_the_processor_refuses_whatever_the_settings_is_named_as_the_picture_s_fault(qwen):
    strip = make_image(4, (3000, 10))  # an aspect ratio beyond Qwen's 200
    with pytest.raises(InvalidInputError, match="refused this request's images or videos") as refused:
        qwen(strip, PROMPTS[0], max_new_tokens=2, mm_processor_kwargs={"max_pixels": 401408})
    assert "mm_processor_kwargs" not in str(refused.value)


def test_the_settings_change_only_by_assignment(qwen):
    mine = {"size": {"shortest_edge": 56 * 56, "longest_edge": 56 * 56}}
    qwen.mm_processor_kwargs = mine
    try:
        mine["size"]["longest_edge"] = 10**6  # the caller's dict, edited later
        qwen.mm_processor_kwargs["patch_size"] = 16  # a copy: the check cannot be passed by
        assert qwen.mm_processor_kwargs == SMALL
    finally:
        qwen.mm_processor_kwargs = None


def test_processed_inputs_and_a_pipeline_wide_setting_are_refused_as_such(qwen):
    inputs = qwen.prepare_inputs(PICTURE, PROMPTS[0])
    with pytest.raises(InvalidInputError, match="inputs= were processed already"):
        qwen(inputs=inputs, mm_processor_kwargs=SMALL)
    with pytest.raises(
        InvalidInputError, match=r"^pipe.mm_processor_kwargs sets foo, which the target's processor"
    ):
        qwen.mm_processor_kwargs = {"foo": 1}
    assert qwen.mm_processor_kwargs == {}


def test_the_server_takes_a_request_s_settings_over_its_own(qwen):
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": PICTURE}, {"type": "text", "text": PROMPTS[0]}],
        }
    ]
    with SpecServer(qwen, "tiny", port=None, batch_size=2, max_tokens=MAX_NEW) as server:
        qwen.mm_processor_kwargs = SMALL
        try:
            for settings, tokens in ((None, 4), ({"max_pixels": 112 * 112}, 16)):
                body = {
                    "messages": user_turn(picture_uri()),
                    **({"mm_processor_kwargs": settings} if settings else {}),
                }
                reply = server.complete(server.chat_request(body))
                expected = qwen(messages=messages, max_new_tokens=MAX_NEW, mm_processor_kwargs=settings)
                assert reply["choices"][0]["message"]["content"] == expected.text
                assert (reply["usage"]["prompt_tokens"], expected.stats.target_visual_tokens) == (
                    expected.stats.prompt_tokens,
                    tokens,
                )
            bad = {"messages": user_turn(picture_uri()), "mm_processor_kwargs": {"x": 1}}
            with pytest.raises(APIError) as refused:
                server.complete(server.chat_request(bad))
        finally:
            qwen.mm_processor_kwargs = None
    assert refused.value.status == 400 and refused.value.body()["error"]["param"] == "mm_processor_kwargs"


def test_the_batch_job_s_flag_sets_every_request_s_settings_and_a_bad_one_is_named(
    tiny_pairs, tmp_path, capsys
):
    pair = tiny_pairs["qwen2_vl"]
    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions"}
    line["body"] = {"messages": user_turn(picture_uri()), "max_tokens": 4}
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps(line) + "\n")
    common = ["batch", str(requests), "--target", str(pair.target), "--draft", str(pair.draft)]
    assert (
        main([*common, "--out", str(tmp_path / "a.jsonl"), "--mm-processor-kwargs", json.dumps(SMALL)]) == 0
    )
    usage = json.loads((tmp_path / "a.jsonl").read_text())["response"]["body"]["usage"]
    assert main([*common, "--out", str(tmp_path / "b.jsonl")]) == 0
    assert (
        usage["prompt_tokens"]
        < json.loads((tmp_path / "b.jsonl").read_text())["response"]["body"]["usage"]["prompt_tokens"]
    )
    capsys.readouterr()
    assert (
        main([*common, "--out", str(tmp_path / "c.jsonl"), "--mm-processor-kwargs", '{"num_frames": 2}']) == 1
    )
    assert "error: --mm-processor-kwargs sets num_frames, but vlmspec samples" in capsys.readouterr().err


def test_the_lmms_eval_model_takes_the_settings_from_its_model_args(tiny_pairs):
    """``mm_processor_kwargs={...}`` in ``--model_args`` (a JSON object: one setting, since lmms-eval splits the
    arguments at commas; a pair config's YAML takes any), set on the pipeline and checked against its processor."""
    from vlmspec_eval.lmms import options
    from vlmspec_eval.lmms.model import VLMSpec

    pair = tiny_pairs["qwen2_vl"]
    parsed = options.parse_model_args({"target": "tiny", "mm_processor_kwargs": '{"max_pixels": 3136}'})
    assert parsed.mm_processor_kwargs == {"max_pixels": 3136}
    with pytest.raises(InvalidInputError, match=r"mm_processor_kwargs takes a JSON object, e\.g\."):
        options.parse_model_args({"target": "tiny", "mm_processor_kwargs": "max_pixels=3136"})
    args = f"target={pair.target},draft={pair.draft},warmup=false,mm_processor_kwargs="
    with pytest.raises(InvalidInputError, match=r"mm_processor_kwargs sets max_patches, which the target's"):
        VLMSpec.create_from_arg_string(args + '{"max_patches":1}', {"batch_size": 1})
    lm = VLMSpec.create_from_arg_string(args + '{"max_pixels":3136}', {"batch_size": 1})
    assert lm.pipe.mm_processor_kwargs == {"max_pixels": 3136}


def test_the_caption_job_lays_out_every_video_as_its_settings_say(tiny_pairs, tmp_path, capsys):
    import vlmspec_caption
    from test_video_captioning import _write_clips

    pair = tiny_pairs["qwen2_vl"]
    _write_clips(tmp_path / "videos", 2)
    argv = [str(tmp_path / "videos"), "--target", str(pair.target), "--draft", str(pair.draft)]
    argv += ["--max-new-tokens", "6", "--num-frames", "4", "--no-progress", "--threads", "1"]
    runs = {}
    for name, flag in (("full", []), ("small", ["--mm-processor-kwargs", json.dumps(SMALL)])):
        out = tmp_path / f"{name}.jsonl"
        assert vlmspec_caption.main([*argv, "--out", str(out), *flag]) == 0
        runs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    for full, small in zip(runs["full"], runs["small"], strict=True):
        assert (
            small["settings"]["mm_processor_kwargs"] == SMALL
            and "mm_processor_kwargs" not in full["settings"]
        )
        assert small["stats"]["target_visual_tokens"] < full["stats"]["target_visual_tokens"]
    bad = [*argv, "--out", str(tmp_path / "bad.jsonl"), "--mm-processor-kwargs", '{"patch_size": 16}']
    assert vlmspec_caption.main(bad) == 1
    assert (
        "error: command line: --mm-processor-kwargs sets patch_size, which the model fixes"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "bad.jsonl").exists()  # refused before any work
    unknown = [*argv, "--out", str(tmp_path / "unknown.jsonl"), "--mm-processor-kwargs", '{"max_patches": 1}']
    assert vlmspec_caption.main(unknown) == 1  # known to be wrong once the processor is
    assert (
        "mm_processor_kwargs sets max_patches, which the target's processor does not take"
        in capsys.readouterr().err
    )


def test_the_caption_job_runs_a_saved_pipeline_with_what_it_saved(tiny_pairs, tmp_path, capsys):
    """``vlmspec caption --target <saved pipeline>`` captions as that pipeline does: its policy and options and its
    processor settings, the same captions as the job given the same settings by flag; each line names the folder and
    the settings it brought; the job's own flags, where given, win."""
    import vlmspec_caption
    from test_video_captioning import _write_clips

    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", gamma=3, torch_dtype=torch.float32
    )
    pipe.mm_processor_kwargs = SMALL
    folder = pipe.save_pretrained(tmp_path / "saved")
    _write_clips(tmp_path / "videos", 2)
    argv = [
        str(tmp_path / "videos"),
        "--max-new-tokens",
        "6",
        "--num-frames",
        "4",
        "--no-progress",
        "--threads",
        "1",
    ]
    by_flags = ["--target", str(pair.target), "--draft", str(pair.draft), "--policy", "chain"]
    by_flags += ["--policy-options", '{"gamma": 3}', "--mm-processor-kwargs", json.dumps(SMALL)]
    runs = {}
    for name, flags in (
        ("saved", ["--target", str(folder)]),
        ("flags", by_flags),
        ("given", ["--target", str(folder), "--policy", "sage", "--mm-processor-kwargs", "{}"]),
    ):
        out = tmp_path / f"{name}.jsonl"
        assert vlmspec_caption.main([*argv, *flags, "--out", str(out)]) == 0
        runs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    for saved, flagged, given in zip(runs["saved"], runs["flags"], runs["given"], strict=True):
        assert saved["caption"] == flagged["caption"] and saved["policy"] == flagged["policy"] == "chain"
        assert saved["stats"]["target_visual_tokens"] == flagged["stats"]["target_visual_tokens"]
        assert saved["stats"]["tree_sizes"] == flagged["stats"]["tree_sizes"]  # the saved gamma: chains of 3
        assert max(saved["stats"]["tree_sizes"]) == 3, saved["stats"]["tree_sizes"]
        assert saved["settings"]["pipeline"] == str(folder)
        assert (
            saved["settings"]["mm_processor_kwargs"] == SMALL
            and saved["settings"]["policy_options"]["gamma"] == 3
        )
        assert saved["settings"]["pruning"]["min_keep"] == 64  # the saved pruning: the pipeline's default
        assert given["policy"] == "sage" and "mm_processor_kwargs" not in given["settings"]
        assert given["stats"]["target_visual_tokens"] > saved["stats"]["target_visual_tokens"]
    # the same command again: nothing left to do, and no line counts as made with other settings
    code = vlmspec_caption.main([*argv, "--target", str(folder), "--out", str(tmp_path / "saved.jsonl")])
    assert code == 0 and "other settings" not in capsys.readouterr().out


def test_a_setting_only_the_image_processor_takes_is_refused_for_a_request_of_videos_only(tiny_pairs):
    """Qwen3-VL's video processor has no ``max_pixels`` (its ``size`` does it): on a video alone the setting would
    do nothing, and is refused saying so; on a picture, or a picture and a video, it applies."""
    pair = tiny_pairs["qwen3_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    video, settings = make_video_frames(2), {"max_pixels": 64 * 64}
    with pytest.raises(InvalidInputError, match=r"sets max_pixels, which the target's processor does not take for "
                       r"videos; it takes .*size"):  # fmt: skip
        pipe(None, PROMPTS[0], video=video, max_new_tokens=2, mm_processor_kwargs=settings)
    both = pipe.prepare_inputs(PICTURE, PROMPTS[0], video, mm_processor_kwargs=settings)
    assert both["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_a_saved_pipeline_keeps_its_processor_settings_and_reasoning_parser(qwen, tmp_path):
    """``save_pretrained`` keeps what shapes every request (as transformers' processor keeps its own settings);
    arguments given on loading replace the saved ones, and a bad saved one names the settings file."""
    from vlmspec import ReasoningParser
    from vlmspec.reasoning import REASONING_PARSERS

    mine = ReasoningParser("mine", "<answer>", "</answer>")
    for name, parser in (("named", "qwen3"), ("mine", mine)):
        qwen.mm_processor_kwargs, qwen.reasoning_parser = SMALL, parser
        try:
            folder = qwen.save_pretrained(tmp_path / name)
            expected = qwen(PICTURE, PROMPTS[0], max_new_tokens=MAX_NEW)
        finally:
            qwen.mm_processor_kwargs, qwen.reasoning_parser = {}, None
        loaded = VLMSpecPipeline.from_pretrained(folder)
        assert loaded.mm_processor_kwargs == SMALL
        assert loaded.reasoning_parser == REASONING_PARSERS.get(parser, parser)
        out = loaded(PICTURE, PROMPTS[0], max_new_tokens=MAX_NEW)
        assert (out.token_ids, out.stats.target_visual_tokens) == (expected.token_ids, 4)
    given = VLMSpecPipeline.from_pretrained(
        folder, mm_processor_kwargs={"max_pixels": 112 * 112}, reasoning_parser="qwen3"
    )
    assert given.mm_processor_kwargs == {"max_pixels": 112 * 112} and given.reasoning_parser.name == "qwen3"
    assert given(PICTURE, PROMPTS[0], max_new_tokens=2).stats.target_visual_tokens == 16
    # vlmspec serve and vlmspec batch keep them too (their flags, when given, win).
    requests, replies = tmp_path / "requests.jsonl", tmp_path / "replies.jsonl"
    body = {"messages": user_turn(picture_uri()), "max_tokens": 2}
    requests.write_text(
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": body})
    )
    command = ["batch", str(requests), "--target", str(folder), "--prefix-cache-gb", "0"]
    assert main([*command, "--out", str(replies)]) == 0
    usage = json.loads(replies.read_text())["response"]["body"]["usage"]
    messages = [
        {"role": "user", "content": [{"type": "image", "image": PICTURE}, {"type": "text", "text": PROMPT}]}
    ]
    assert usage["prompt_tokens"] == loaded(messages=messages, max_new_tokens=2).stats.prompt_tokens
    flagged_out = tmp_path / "flag.jsonl"
    flag = ["--mm-processor-kwargs", json.dumps({"max_pixels": 112 * 112}), "--out", str(flagged_out)]
    assert main([*command, *flag]) == 0
    flagged = json.loads(flagged_out.read_text())["response"]["body"]["usage"]
    assert (
        flagged["prompt_tokens"] == usage["prompt_tokens"] + 12
    )  # the flag's 16 visual tokens, not the saved 4
    settings = folder / "vlmspec_pipeline.yaml"
    text = settings.read_text()
    assert "mm_processor_kwargs:" in text and "end: </answer>" in text  # a parser of one's own, by its tags
    settings.write_text(text.replace("size:", "patch_size: 7\n  size:"))
    with pytest.raises(
        InvalidInputError, match=r"vlmspec_pipeline.yaml': mm_processor_kwargs sets patch_size"
    ):
        VLMSpecPipeline.from_pretrained(folder)
    settings.write_text(text.replace("end: </answer>", "end: ''"))
    with pytest.raises(InvalidInputError, match=r"vlmspec_pipeline.yaml': reasoning_parser: .*end"):
        VLMSpecPipeline.from_pretrained(folder)
    settings.write_text("policy: sage\nmm_processor_kwargs: []\n")
    with pytest.raises(
        InvalidInputError, match=r"vlmspec_pipeline.yaml': policy must be a name, .* mappings"
    ):
        VLMSpecPipeline.from_pretrained(folder)
    settings.write_text("policy: sage\n")  # saved before these settings were kept: none set
    assert VLMSpecPipeline.from_pretrained(folder).mm_processor_kwargs == {}
    assert set(
        yaml.safe_load(qwen.save_pretrained(folder).joinpath("vlmspec_pipeline.yaml").read_text())
    ) == {"policy", "policy_options", "pruning"}  # none set, none written: older versions read the file
    with pytest.raises(InvalidInputError, match=r"reasoning_parser='qwen9' is not a parser"):
        VLMSpecPipeline.from_pretrained("nowhere/none", reasoning_parser="qwen9")  # before any model loads
    qwen.mm_processor_kwargs = {"do_normalize": np.True_, "image_mean": np.array([0.5, 0.5, 0.5])}
    try:
        saved = yaml.safe_load((qwen.save_pretrained(folder) / "vlmspec_pipeline.yaml").read_text())
    finally:
        qwen.mm_processor_kwargs = {}
    assert saved["mm_processor_kwargs"] == {"do_normalize": True, "image_mean": [0.5, 0.5, 0.5]}
