"""Conversations that keep their caches (pipe.chat): every turn equals generate() on the full history, and a turn
prefills only what the earlier turns did not."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vlmspec import VLMSpecPipeline, testbed
from vlmspec.batching import TARGET
from vlmspec.models import adapter_for
from vlmspec.testbed.world import sample
from vlmspec.testing import FAMILIES, make_image, make_video_frames, write_video

MAX_NEW = 24


def _reference(pipe: VLMSpecPipeline, messages: list[dict], max_new_tokens: int = MAX_NEW) -> list[int]:
    """The target's own greedy generate() on the whole history (pipe.prepare_messages is transformers' own
    apply_chat_template path, test_messages.py)."""
    return pipe.reference_generate(pipe.prepare_messages(messages), max_new_tokens)


def _count_calls(module: torch.nn.Module, calls: list[int], positions: bool = False) -> Any:
    """Append to ``calls`` at each forward of ``module``: 1, or with ``positions`` the input positions it ran."""

    def hook(module: torch.nn.Module, args: Any, kwargs: dict, out: Any) -> None:
        calls.append(kwargs["inputs_embeds"].shape[1] if positions else 1)

    return module.register_forward_hook(hook, with_kwargs=True)


def _held_in_cache(chat: Any, held: list[int]) -> int:
    """How many of ``held`` the target's cache holds: all but the reply's last token, which is there only when the
    target verified it as a draft node (a stop condition cut that step short), not when it was the bonus token."""
    entries = chat._prefixes._entries
    return min(len(held), entries[0].held[TARGET].state.length) if held else 0


def _reusable(pipe: VLMSpecPipeline, held: list[int], prompt: list[int], cached: int) -> int:
    """How much of ``prompt`` the cache holding ``held`` (its first ``cached`` ids) gives: the shared prefix, but
    only the text before ``held``'s first image when it stops before an image of ``held`` ends (LLaVA-OneVision
    renders an image with fewer tokens once a second one joins it)."""
    shared = next((i for i, (a, b) in enumerate(zip(held, prompt, strict=False)) if a != b), len(held))
    visual = set(adapter_for(pipe.target).visual_token_ids())
    if sum(i in visual for i in prompt[:shared]) < sum(i in visual for i in held):
        shared = min(shared, next(i for i, token in enumerate(held) if token in visual))
    return max(min(shared, cached), 0)


def _text_before_media(pipe: VLMSpecPipeline, messages: list[dict], **options: Any) -> int:
    """How many prompt tokens of ``messages`` come before their first image or video."""
    ids = pipe.prepare_messages(messages, **options)["input_ids"][0]
    visual = torch.tensor(adapter_for(pipe.target).visual_token_ids())
    return int(torch.isin(ids, visual).nonzero()[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_three_turns_equal_generate_on_the_history_and_prefill_only_new_tokens(tiny_pairs, family):
    """Images in the first and third turns. The trained testbed pairs reply in words;
    the tiny random pairs of the other families reply in bytes that need not survive detokenising, so less of
    their replies is reused (what is reused is what the new prompt's ids share with the cache's, checked here)."""
    if family in testbed.FAMILIES:
        pipe = VLMSpecPipeline.from_pretrained(f"testbed-base:{family}", policy="sage")
    else:
        pair = tiny_pairs[family]
        pipe = VLMSpecPipeline.from_pretrained(
            pair.target, pair.draft, policy="sage", torch_dtype=torch.float32
        )
    core = pipe.target.model
    vision, ran = [], []
    _count_calls(getattr(core, "visual", None) or core.vision_tower, vision)
    _count_calls(core.language_model, ran, positions=True)
    first, third = sample("image_caption", 401), sample("image_qa", 402)
    turns = ((first.prompt, first.image), ("Which shape is the largest?", None), (third.prompt, third.image))
    chat = pipe.chat(system="You describe pictures.", max_new_tokens=48)
    held: list[int] = []  # the ids of the turns before: prompt and reply
    for turn, (text, image) in enumerate(turns):
        vision.clear()
        ran.clear()
        cached = _held_in_cache(chat, held)
        out = chat.send(text, images=image)
        prompt = pipe.prepare_messages(chat.messages[:-1])["input_ids"][0].tolist()
        assert out.stats.cached_prompt_tokens == _reusable(pipe, held, prompt, cached)
        assert ran[0] == len(prompt) - out.stats.cached_prompt_tokens  # the prefill ran the rest only
        assert bool(vision) == (image is not None)  # the vision tower saw this turn's image only
        assert out.token_ids == _reference(pipe, chat.messages[:-1], 48), f"turn {turn + 1}"
        assert chat.messages[-1] == {"role": "assistant", "content": [{"type": "text", "text": out.text}]}
        if family == "qwen2_vl" and turn > 0:  # its template renders a reply as the tokens generated
            assert out.stats.cached_prompt_tokens == cached
        held = prompt + out.token_ids


def test_an_edited_history_reuses_only_what_comes_before_the_edit(tiny_pairs):
    pair = tiny_pairs["qwen2_5_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    chat = pipe.chat(max_new_tokens=MAX_NEW)
    chat.send("What is in the picture?", images=make_image(0))
    chat.send("Say more.")
    # Replace the first image by another of the same size: same token ids, other pixels.
    chat.messages[0]["content"][0] = {"type": "image", "image": make_image(3)}
    out = chat.send("And now?")
    assert out.stats.cached_prompt_tokens == _text_before_media(pipe, chat.messages[:-1])
    assert out.token_ids == _reference(pipe, chat.messages[:-1])
    # Editing a reply's text keeps the prefix before it.
    chat.messages[-1]["content"][0]["text"] = "Shapes."
    out = chat.send("Really?")
    assert 0 < out.stats.cached_prompt_tokens < out.stats.prompt_tokens
    assert out.token_ids == _reference(pipe, chat.messages[:-1])


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
@pytest.mark.parametrize("edit", ["image pixels in place", "video window in place", "num_frames"])
def test_media_sampled_otherwise_with_the_same_tokens_reuse_only_the_text_before_them(
    tiny_pairs, family, edit, tmp_path
):
    """Edits the token ids cannot see: the same objects with other pixels, or other frames of the same video."""
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    frames = make_video_frames(0, num_frames=4) + make_video_frames(5, num_frames=4)  # 8 frames, 4 s at 2 fps
    video = frames if edit != "num_frames" else str(write_video(tmp_path / "clip.mp4", frames, fps=2))
    image = make_image(0)
    chat = pipe.chat(max_new_tokens=MAX_NEW)
    chat.messages.append({"role": "user", "content": [
        {"type": "image", "image": image}, {"type": "video", "video": video, "video_start": 0.0, "video_end": 1.5},
        {"type": "text", "text": "Describe."}]})  # fmt: skip
    chat.messages.append({"role": "assistant", "content": [{"type": "text", "text": "Shapes."}]})
    turn_frames = {"num_frames": 4} if edit == "num_frames" else {}
    chat.send("What is in them?", **turn_frames)
    control = chat.send("Really?", **turn_frames)
    if edit == "image pixels in place":
        image.paste(make_image(3))
    elif edit == "video window in place":
        chat.messages[0]["content"][1].update(video_start=2.0, video_end=3.5)
    else:
        turn_frames = {"num_frames": 2}
    out = chat.send("And now?", **turn_frames)
    assert control.stats.cached_prompt_tokens > 0  # reuse before the edit
    assert out.stats.cached_prompt_tokens == _text_before_media(pipe, chat.messages[:-1], **turn_frames)
    assert out.token_ids == pipe(messages=chat.messages[:-1], max_new_tokens=MAX_NEW, **turn_frames).token_ids


@pytest.mark.parametrize("policy", ["eagle2", "ar"])
def test_a_video_conversation_with_a_pruned_draft(tiny_pairs, policy):
    pair = tiny_pairs["qwen3_vl"]
    pipe = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy=policy, prune_ratio=0.5, torch_dtype=torch.float32
    )
    chat = pipe.chat(max_new_tokens=MAX_NEW)
    frames = make_video_frames(0)
    outs = [
        chat.send("What happens?", video=frames),
        chat.send("Then?"),
        chat.send("And here?", images=make_image(2)),
    ]
    references = []
    messages = chat.messages
    for i in range(3):
        references.append(_reference(pipe, messages[: 2 * i + 1]))
    assert [o.token_ids for o in outs] == references
    assert outs[1].stats.cached_prompt_tokens > 0 and outs[2].stats.cached_prompt_tokens > 0


def test_a_failing_turn_leaves_the_history_as_it_was(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    chat = pipe.chat(max_new_tokens=8)
    chat.send("Hello.")
    before = list(chat.messages)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        chat.send("Look.", images="/nonexistent.png")
    assert chat.messages == before
    out = chat.send("Hello again.")
    assert out.token_ids == _reference(pipe, chat.messages[:-1], 8)
    with pytest.raises(TypeError, match="chat.send"):
        chat.send("Hi.", prompt="other")


def test_an_edd_draft_conversation(tiny_pairs):
    """An EDD draft reads the target's hidden states: each turn it gets those of the positions the target ran."""
    pipe = VLMSpecPipeline.from_pretrained("testbed-base:qwen2_vl", "edd", policy="eagle2")
    chat = pipe.chat(max_new_tokens=32)
    first, second = sample("image_caption", 403), sample("image_caption", 404)
    outs = [chat.send(first.prompt, images=first.image), chat.send(second.prompt, images=second.image)]
    assert [o.token_ids for o in outs] == [_reference(pipe, chat.messages[:i], 32) for i in (1, 3)]
    assert outs[1].stats.cached_prompt_tokens > outs[0].stats.prompt_tokens
    assert outs[1].stats.accepted_tokens > 0  # the draft kept drafting from its carried-over cache


def test_demo_chat_streams_each_turn_and_reuses_the_caches(capsys, monkeypatch):
    import io
    import re

    from vlmspec.cli import main as cli_main

    common = ["demo", "--pair", "testbed-mini", "--max-new-tokens", "24", "--no-compare"]
    assert cli_main(common) == 0
    caption = re.search(r"^caption:   (.*)$", capsys.readouterr().out, re.M).group(1)
    monkeypatch.setattr(
        "sys.stdin", io.StringIO("Which shape is the largest?\nDescribe it again.\n\nignored\n")
    )
    assert cli_main([*common, "--chat"]) == 0
    out = capsys.readouterr().out
    replies = re.findall(r"^vlmspec> (.*)$", out, re.M)
    assert len(replies) == 3  # the bundled image's turn, then the two typed lines; the empty line ends it
    assert replies[0].strip() == caption.strip()  # streamed: the same text as the one-shot call
    assert "you> Which shape is the largest?" in out
    cached = [int(n) for n in re.findall(r"(\d+) cached\]", out)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]


def test_a_sampled_streamed_turn_is_the_fresh_call_s_with_the_same_seed():
    """Sampling with the caches kept draws what a fresh call on the whole history draws with the same seed, and a
    TextIteratorStreamer on a turn yields exactly its text."""
    from threading import Thread

    from transformers import TextIteratorStreamer

    pipe = VLMSpecPipeline.from_pretrained("testbed-mini:qwen2_vl", policy="sage")
    example = sample("image_caption", 9)
    options = {"do_sample": True, "seed": 3, "temperature": 0.8}
    chat = pipe.chat(max_new_tokens=32, **options)
    chat.send(example.prompt, images=example.image)
    streamer = TextIteratorStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}
    turn = Thread(
        target=lambda: result.update(out=chat.send("Which shape is the largest?", streamer=streamer))
    )
    turn.start()
    streamed = "".join(streamer)
    turn.join()
    out = result["out"]
    assert streamed == out.text and out.stats.cached_prompt_tokens > 0
    fresh = pipe(messages=chat.messages[:-1], max_new_tokens=32, **options)
    assert fresh.token_ids == out.token_ids


def test_a_turn_that_never_prefilled_keeps_the_cache_s_ids():
    """A turn that failed before its prefill: the cache holds what it held, not that turn's reply."""
    from transformers.cache_utils import DynamicCache

    from vlmspec.models import DecodeState
    from vlmspec.prefix_cache import Held, TurnCache

    cache = TurnCache(adapter=None, placeholders=(9,))
    cache.next_turn([1, 2, 3], (0, 0))
    assert cache.end_turn([4]) is None
    assert cache.ids == []
    state = DecodeState(cache=DynamicCache(), rope_delta=torch.tensor(0), visual_tokens=0)
    held = TurnCache(None, (9,), Held(state, [1, 2, 5], torch.arange(2), 2, (0, 0)))  # an earlier request's
    held.next_turn([1, 2, 3], (0, 0))
    assert held.end_turn([4]) is None and held.ids == [1, 2, 5]
