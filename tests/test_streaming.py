"""Streaming (vlmspec.streaming): transformers' streamers on pipe(...), and pipe.stream(...)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import AutoTokenizer, TextIteratorStreamer

from vlmspec import VLMSpecPipeline, get_policy
from vlmspec.testing import make_image

CALLS = {
    "sage greedy": ("sage", {}),
    "chain sampling": ("chain", {"do_sample": True, "seed": 3, "temperature": 1.2}),
}


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)


@pytest.mark.parametrize("case", list(CALLS))
def test_text_iterator_streamer_yields_exactly_the_final_text(pipe, case):
    policy, kwargs = CALLS[case]
    pipe.policy = get_policy(policy)
    streamer = TextIteratorStreamer(pipe.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result = {}
    worker = threading.Thread(
        target=lambda: result.update(
            out=pipe(make_image(0), "Describe this image.", max_new_tokens=40, streamer=streamer, **kwargs)
        )  # fmt: skip
    )
    worker.start()
    pieces = list(streamer)
    worker.join()
    out = result["out"]
    assert "".join(pieces) == out.text and out.text
    assert out.stats.accepted_tokens > 0  # steps emitted several tokens at once


class _Recorder:
    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended = True


def test_a_streamer_gets_the_prompt_then_each_steps_tokens_together(pipe):
    pipe.policy = get_policy("chain", gamma=4)
    recorder = _Recorder()
    image, prompt = make_image(1), "Describe this image."
    out = pipe(image, prompt, max_new_tokens=40, streamer=recorder)
    assert recorder.puts[0] == pipe.prepare_inputs(image, prompt)["input_ids"][0].tolist()
    steps = recorder.puts[1:]
    assert sum(steps, []) == out.token_ids and recorder.ended  # never a token taken back
    assert len(steps) == out.stats.steps + 1 and max(len(s) for s in steps) > 1


@pytest.mark.parametrize("case", list(CALLS))
def test_pipe_stream_yields_pieces_that_join_to_the_reply(pipe, case):
    policy, kwargs = CALLS[case]
    pipe.policy = get_policy(policy)
    pieces = list(pipe.stream(make_image(2), "Describe this image.", max_new_tokens=40, **kwargs))
    out = pipe(make_image(2), "Describe this image.", max_new_tokens=40, **kwargs)
    assert "".join(p.text for p in pieces) == out.text
    assert sum((p.token_ids for p in pieces), []) == out.token_ids
    assert pieces[-1].stats is not None and all(p.stats is None for p in pieces[:-1])
    assert pieces[-1].stats.new_tokens == len(out.token_ids)


def test_pipe_stream_takes_a_conversation_like_pipe(pipe):
    pipe.policy = get_policy("chain", gamma=3)
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": make_image(3)}, {"type": "text", "text": "Hi"}],
        }
    ]
    pieces = list(pipe.stream(messages=messages, max_new_tokens=12))
    out = pipe(messages=messages, max_new_tokens=12)
    assert (
        "".join(p.text for p in pieces) == out.text
        and sum((p.token_ids for p in pieces), []) == out.token_ids
    )


def test_pipe_stream_raises_what_the_call_raised(pipe):
    with pytest.raises(ValueError, match="max_new_tokens"):
        list(pipe.stream(make_image(0), "Describe this image.", max_new_tokens=0))


def test_stopping_a_stream_early_ends_its_generation(pipe):
    forwards = []
    hook = pipe.target.register_forward_hook(lambda *args: forwards.append(1))
    try:
        full = list(pipe.stream(make_image(0), "Describe this image.", max_new_tokens=40))
        steps = len(forwards)
        forwards.clear()
        stream = pipe.stream(make_image(0), "Describe this image.", max_new_tokens=40)
        next(stream)
        stream.close()  # as a `break` out of the loop does
        stopped = len(forwards)
    finally:
        hook.remove()
    assert full[-1].stats.steps >= 4 and stopped <= 3 < steps
    assert not [t for t in threading.enumerate() if t.name == "vlmspec-stream"]


class _ByteTokenizer:
    """Token ids are UTF-8 bytes: a character of several bytes spans several tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_character_split_over_steps_is_held_back_until_whole():
    from vlmspec.streaming import TextPieces

    pieces = TextPieces(_ByteTokenizer())
    e_acute = list("é".encode())
    assert pieces.push([ord("a"), e_acute[0]]) == ""  # "a" and half of "é": held back
    assert pieces.push(e_acute[1:]) == "aé"
    assert pieces.finish("aé!") == "!"
    pieces.sent = "abc"
    assert pieces.finish("abx") == "abx"  # a final text that does not extend what was sent: all of it


MULTILINGUAL = "Héllo wörld, naïve café: 猫が好きです。 Ωμέγα 🐱🐶 ok.  Two spaces\nand ¿qué? Ünïcödé ✓ "


def _long_reply(tokenizer, seed: int) -> list[int]:
    """A reply of about 3,000 tokens: multi-byte characters split over tokens, special tokens among them."""
    rng = random.Random(seed)
    ids = tokenizer.encode(MULTILINGUAL * 30, add_special_tokens=False)
    for _ in range(60):
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(tokenizer.all_special_ids))
    return ids


def _stream_in_steps(pieces, ids: list[int], seed: int) -> list[str]:
    """Push ``ids`` a verification step at a time (1 to 5 tokens), as a streamed reply comes."""
    rng = random.Random(seed)
    out, start = [], 0
    while start < len(ids):
        step = rng.randint(1, 5)
        out.append(pieces.push(ids[start : start + step]))
        start += step
    return out


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_incremental_pieces_join_to_the_decoded_whole_of_a_long_reply(tiny_pairs, family):
    from vlmspec.streaming import TextPieces

    tokenizer = AutoTokenizer.from_pretrained(tiny_pairs[family].target)
    ids = _long_reply(tokenizer, seed=0)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    pieces = TextPieces(tokenizer)
    streamed = _stream_in_steps(pieces, ids, seed=1)
    assert "".join(streamed) + pieces.finish(whole) == whole and "\ufffd" not in whole
    assert not any("\ufffd" in piece for piece in streamed)  # never a partial character
    assert "".join(streamed) == whole  # nothing was left to the end: each piece came with its tokens
    assert sum(1 for piece in streamed if piece) > len(streamed) // 2
    rng = random.Random(2)  # ids of any kind: bytes that are no character at all decode as the whole does
    noise = [rng.randrange(len(tokenizer)) for _ in range(1500)]
    pieces = TextPieces(tokenizer)
    streamed = _stream_in_steps(pieces, noise, seed=3)
    whole = tokenizer.decode(noise, skip_special_tokens=True)
    assert "".join(streamed) + pieces.finish(whole) == whole and whole.startswith("".join(streamed))


class _CountingTokenizer:
    """A tokenizer that counts the ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded = 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)


def test_streaming_a_reply_decodes_each_token_a_bounded_number_of_times(tiny_pairs):
    """Decoding the whole reply at every step costs quadratic time in its length; a push decodes a step or
    two."""
    from vlmspec.streaming import TextPieces

    tokenizer = AutoTokenizer.from_pretrained(tiny_pairs["qwen2_vl"].target)
    ids = _long_reply(tokenizer, seed=4)
    counted = {}
    for length in (len(ids) // 4, len(ids)):
        counting = _CountingTokenizer(tokenizer)
        _stream_in_steps(TextPieces(counting), ids[:length], seed=5)
        counted[length] = counting.decoded
        assert counting.decoded <= 8 * length  # a token is decoded a few times, not once per later step
    short, long = sorted(counted)
    assert counted[long] / counted[short] < 1.5 * long / short  # linear in the reply's length
