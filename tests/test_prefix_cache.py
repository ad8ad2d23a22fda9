"""Prefix caching across requests (pipe.prefix_cache): a request that starts as an earlier one did prefills only the
rest, and every reply is still the target's own greedy generate()."""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
from typing import Any

import pytest
import torch

from vlmspec import PrefixCache, VLMSpecPipeline, testbed
from vlmspec.batching import DRAFT_FIRST, TARGET
from vlmspec.errors import InvalidInputError
from vlmspec.serving import SpecServer
from vlmspec.testbed.world import sample
from vlmspec.testing import FAMILIES, make_image, make_video_frames

MAX_NEW = 24


def _pipe(tiny_pairs, family: str, **options) -> VLMSpecPipeline:
    """The trained testbed pair where there is one (replies in words, margins that make ties rare), else the tiny
    random pair."""
    if family in testbed.FAMILIES:
        return VLMSpecPipeline.from_pretrained(f"testbed-base:{family}", **options)
    pair = tiny_pairs[family]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, torch_dtype=torch.float32, **options)


def _requests() -> list[dict]:
    """Pairs of requests sharing an image, a video, two images; an image with other pixels; text only."""
    a, b, frames = make_image(0), make_image(3), make_video_frames(0)
    return [
        {"image": a, "prompt": "Describe this image."},
        {"image": a, "prompt": "What color is the largest shape?"},
        {"video": frames, "prompt": "What happens?"},
        {"video": frames, "prompt": "What happens at the end?"},
        {"image": b, "prompt": "Describe this image."},
        {"image": [a, b], "prompt": "Compare them."},
        {"image": [a, b], "prompt": "Which is brighter?"},
        {"prompt": "Hello."},
    ]


def _references(pipe: VLMSpecPipeline, requests: list[dict]) -> list[list[int]]:
    return [
        pipe.reference_generate(pipe.prepare_inputs(r.get("image"), r["prompt"], r.get("video")), MAX_NEW)
        for r in requests
    ]


def _visual(pipe: VLMSpecPipeline, request: dict) -> torch.Tensor:
    """``[L]`` bool: the visual placeholders of the request's prompt."""
    ids = pipe.prepare_inputs(request.get("image"), request["prompt"], request.get("video"))["input_ids"][0]
    return torch.isin(ids, torch.tensor(pipe.target_adapter.visual_token_ids()))


def _text_before_media(pipe: VLMSpecPipeline, request: dict) -> int:
    """How many prompt tokens come before the request's first image or video."""
    return int(_visual(pipe, request).nonzero()[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_requests_sharing_a_prefix_prefill_only_the_rest_and_equal_generate(tiny_pairs, family):
    pipe = _pipe(tiny_pairs, family, policy="sage")
    requests = _requests()
    references = _references(pipe, requests)
    pipe.prefix_cache = PrefixCache()
    outs = [pipe(max_new_tokens=MAX_NEW, **r) for r in requests]
    assert [o.token_ids for o in outs] == references
    cached = [o.stats.cached_prompt_tokens for o in outs]
    for second in (1, 3, 6):  # the same media as the request before: at least all its visual tokens reused
        assert cached[second] > int(_visual(pipe, requests[second]).sum()), (second, cached)
    assert cached[0] == 0  # nothing before it
    # Other pixels behind the same placeholder tokens (image b), or other media than any earlier request's (the
    # video, whose template text may part earlier, Qwen3-VL's timestamps): only the text before them is reused.
    assert cached[4] == _text_before_media(pipe, requests[4]), cached
    assert 0 < cached[2] <= _text_before_media(pipe, requests[2]), cached
    assert len(pipe.prefix_cache) > 0 and pipe.prefix_cache.nbytes > 0


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_a_batch_reuses_what_earlier_rows_left_and_equals_generate(tiny_pairs, family):
    """A second pass over the same requests at batch 3: every prompt with media takes them from the first pass."""
    pipe = _pipe(tiny_pairs, family, policy="sage")
    requests = _requests()
    references = _references(pipe, requests)
    pipe.prefix_cache = PrefixCache()
    outs = pipe.batch([dict(r, max_new_tokens=MAX_NEW) for r in requests * 2], batch_size=3)
    assert [o.token_ids for o in outs] == references * 2
    second_pass = [o.stats.cached_prompt_tokens for o in outs[len(requests) :]]
    visual = [int(_visual(pipe, r).sum()) for r in requests]
    assert all(c > v for c, v in zip(second_pass[:-1], visual[:-1], strict=True)), (second_pass, visual)


@pytest.mark.parametrize(
    "pair, options",
    [("qwen3_vl", {"policy": "eagle2", "prune_ratio": 0.5}), ("edd", {"policy": "eagle2"})],
    ids=["pruned draft", "edd draft"],
)
def test_drafts_that_prune_or_read_the_target_keep_drafting_from_reused_caches(tiny_pairs, pair, options):
    if pair == "edd":
        pipe = VLMSpecPipeline.from_pretrained("testbed-base:qwen2_vl", "edd", **options)
        first, second = sample("image_caption", 403), sample("image_caption", 404)
        requests = [
            {"image": first.image, "prompt": first.prompt},
            {"image": first.image, "prompt": second.prompt},
        ]
    else:
        pipe = _pipe(tiny_pairs, pair, **options)
        frames = make_video_frames(0)
        requests = [{"video": frames, "prompt": "What happens?"}, {"video": frames, "prompt": "And then?"}]
    references = _references(pipe, requests)
    pipe.prefix_cache = PrefixCache()
    outs = [pipe(max_new_tokens=MAX_NEW, **r) for r in requests]
    assert [o.token_ids for o in outs] == references
    assert outs[1].stats.cached_prompt_tokens > 0
    assert outs[1].stats.accepted_tokens > 0  # the draft drafted from its reused cache
    held = pipe.prefix_cache._entries[-1].held
    assert set(held) == {DRAFT_FIRST, TARGET}  # both models' caches kept
    second = outs[1].stats
    if pair == "edd":  # the draft extended its reused cache: it holds more than the positions the target ran
        assert held[DRAFT_FIRST].state.length > second.prompt_tokens - second.cached_prompt_tokens + MAX_NEW
    else:  # the pruned draft kept its earlier choice of the video's tokens: as many as a fresh call keeps
        pipe.prefix_cache = None
        assert (
            second.draft_visual_tokens
            == pipe(max_new_tokens=MAX_NEW, **requests[1]).stats.draft_visual_tokens
        )


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_onevision"])
def test_another_system_prompt_before_the_same_image_reuses_only_the_common_text(tiny_pairs, family):
    """The shared prefix stops before the entry's image: the image runs again through the vision tower."""
    pipe = _pipe(tiny_pairs, family, policy="sage")
    image = make_image(0)
    conversations = [
        [{"role": "system", "content": [{"type": "text", "text": system}]},
         {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe."}]}]
        for system in ("You describe pictures.", "You count the shapes in pictures.")
    ]  # fmt: skip
    references = [pipe.reference_generate(pipe.prepare_messages(m), MAX_NEW) for m in conversations]
    pipe.prefix_cache = PrefixCache()
    outs = [pipe(messages=m, max_new_tokens=MAX_NEW) for m in conversations]
    assert [o.token_ids for o in outs] == references
    ids = pipe.prepare_messages(conversations[1])["input_ids"][0]
    first_visual = int(torch.isin(ids, torch.tensor(pipe.target_adapter.visual_token_ids())).nonzero()[0])
    assert 0 < outs[1].stats.cached_prompt_tokens < first_visual


def test_a_conversation_sent_whole_each_turn_keeps_one_entry_that_grows(tiny_pairs):
    """An OpenAI-style client re-sends the history: each turn reuses the last one's prompt and reply, and the new
    entry replaces the one it extends."""
    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage")
    pipe.prefix_cache = PrefixCache()
    example = sample("image_caption", 7)
    messages = [{"role": "user", "content": [{"type": "image", "image": example.image},
                                             {"type": "text", "text": example.prompt}]}]  # fmt: skip
    cached = []
    for question in ("Which shape is the largest?", "Say it again."):
        out = pipe(messages=messages, max_new_tokens=MAX_NEW)
        assert out.token_ids == pipe.reference_generate(pipe.prepare_messages(messages), MAX_NEW)
        cached.append(out.stats.cached_prompt_tokens)
        messages += [{"role": "assistant", "content": [{"type": "text", "text": out.text}]},
                     {"role": "user", "content": [{"type": "text", "text": question}]}]  # fmt: skip
        assert len(pipe.prefix_cache) == 1
    out = pipe(messages=messages, max_new_tokens=MAX_NEW)
    assert out.token_ids == pipe.reference_generate(pipe.prepare_messages(messages), MAX_NEW)
    assert cached[0] == 0 and 0 < cached[1] < out.stats.cached_prompt_tokens


def test_bounds_evict_the_least_recently_used(tiny_pairs):
    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage")
    a, b, c = make_image(0), make_image(3), make_image(5)
    pipe.prefix_cache = store = PrefixCache(max_entries=3)
    describe = {"prompt": "Describe this image.", "max_new_tokens": 8}
    pipe(a, **describe)
    pipe(b, **describe)
    pipe(a, "What color is it?", max_new_tokens=8)  # reuses a's entry (now the most recent) and adds its own
    pipe(c, **describe)  # one too many: b's entry, the least recently used, goes
    assert len(store) == 3
    out = pipe(a, **describe)
    assert out.stats.cached_prompt_tokens == out.stats.prompt_tokens - 1  # a's first entry was kept
    text = _text_before_media(pipe, {"image": a, "prompt": "Describe this image."})
    assert pipe(b, **describe).stats.cached_prompt_tokens == text  # only the text before the image
    pipe.prefix_cache = PrefixCache(max_bytes=0)
    for _ in range(2):
        out = pipe(a, **describe)
        assert out.stats.cached_prompt_tokens == 0 and len(pipe.prefix_cache) == 0
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


def test_an_entry_counts_its_caches_and_media_and_the_bytes_bound_holds(tiny_pairs):
    """An entry's size is its caches' and media's; a new entry pushes out as many old ones as it must, and one
    bigger than the bound is not kept at all (it would push out every other one, then itself)."""
    from vlmspec.cache import cache_nbytes

    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage")
    a, b = make_image(0), make_image(3)
    pipe.prefix_cache = store = PrefixCache()
    pipe(a, "Describe this image.", max_new_tokens=8)
    (entry,) = store._entries
    media = pipe.target_adapter.media_rows(pipe.prepare_inputs(a, "Describe this image."))
    caches = sum(cache_nbytes(held.state.cache) for held in entry.held.values())
    assert entry.nbytes == store.nbytes == caches + sum(t.numel() * t.element_size() for t in media.values())
    assert set(entry.held) == {DRAFT_FIRST, TARGET} and caches > 0
    one = entry.nbytes
    pipe.prefix_cache = store = PrefixCache(max_bytes=int(2.5 * one))
    pipe(a, "Describe this image.", max_new_tokens=8)
    pipe(b, "Describe this image.", max_new_tokens=8)
    pipe([a, b], "Compare them.", max_new_tokens=8)  # about twice one entry: both older ones go
    assert len(store) == 1 and store.nbytes <= store.max_bytes
    pipe(make_video_frames(0), "What happens?", max_new_tokens=8)  # bigger than the bound
    assert len(store) == 1 and store._entries[0].nbytes == store.nbytes <= store.max_bytes


def test_a_seeded_sampled_request_draws_what_it_draws_without_the_cache():
    pipe = VLMSpecPipeline.from_pretrained("testbed-mini:qwen2_vl", policy="sage")
    example = sample("image_caption", 9)
    request = {"image": example.image, "prompt": example.prompt, "max_new_tokens": 32}
    options = {"do_sample": True, "seed": 3, "temperature": 0.8}
    fresh = pipe(**request, **options)
    pipe.prefix_cache = PrefixCache()
    pipe(**request)
    again = pipe(**request, **options)
    assert again.stats.cached_prompt_tokens > 0 and again.token_ids == fresh.token_ids


@pytest.mark.parametrize("bound", [{"max_bytes": -1}, {"max_entries": 1.5}, {"max_bytes": True}])
def test_bad_bounds_are_refused_by_name(bound):
    ((name, value),) = bound.items()
    with pytest.raises(InvalidInputError, match=rf"PrefixCache\({name}={value!r}\).*integer >= 0"):
        PrefixCache(**bound)


def test_a_prompt_whose_media_cannot_be_counted_is_not_cached(tiny_pairs):
    """LLaVA-OneVision inputs built without ``batch_num_images`` cannot say how many images a prompt holds."""
    pipe = _pipe(tiny_pairs, "llava_onevision", policy="ar")
    inputs = pipe.prepare_inputs(make_image(0), "Describe this image.")
    inputs.pop("batch_num_images")
    assert PrefixCache().turn(inputs, pipe.target_adapter) is None


def _png_uri(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _call(address: tuple[str, int], method: str, path: str, body: dict | None = None) -> Any:
    """One request to the server: its JSON reply, or the text of ``/metrics``."""
    connection = http.client.HTTPConnection(*address, timeout=120)
    connection.request(method, path, None if body is None else json.dumps(body))
    data = connection.getresponse().read().decode()
    return data if path == "/metrics" else json.loads(data)


def test_a_server_conversation_reports_the_cached_prompt_and_equals_the_pipeline(tiny_pairs):
    """An OpenAI client re-sends the history: the second turn's usage says how much of it the server's prefix
    cache gave, /metrics counts it, and the reply is the pipeline's own reply to the whole history."""
    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage")
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_uri(make_image(0))}},
                                             {"type": "text", "text": "Describe this image."}]}]  # fmt: skip
    history = [{"role": "user", "content": [{"type": "image", "image": make_image(0)},
                                            {"type": "text", "text": "Describe this image."}]}]  # fmt: skip
    pipe.prefix_cache = PrefixCache()
    with SpecServer(pipe, port=0, batch_size=2, max_tokens=MAX_NEW) as server:
        address = server._http.server_address[:2]
        replies = []
        for question in ("Which shape is the largest?", None):
            replies.append(_call(address, "POST", "/v1/chat/completions", {"messages": messages}))
            text = replies[-1]["choices"][0]["message"]["content"]
            expected = pipe.reference_generate(pipe.prepare_messages(history), MAX_NEW)
            assert text == pipe.tokenizer.decode(expected, skip_special_tokens=True)
            if question is not None:
                messages = [
                    *messages,
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": question},
                ]
                history = [*history, {"role": "assistant", "content": [{"type": "text", "text": text}]},
                           {"role": "user", "content": [{"type": "text", "text": question}]}]  # fmt: skip
        metrics = _call(address, "GET", "/metrics")
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert cached[0] == 0 and 0 < cached[1] < replies[1]["usage"]["prompt_tokens"]
    assert f"vlmspec_cached_prompt_tokens_total {cached[1]}" in metrics
    store = pipe.prefix_cache  # the second turn's entry replaced the first's
    assert f"vlmspec_prefix_cache_entries {len(store)}\n" in metrics and len(store) == 1
    assert f"vlmspec_prefix_cache_bytes {store.nbytes}\n" in metrics and store.nbytes > 0


def test_a_server_s_sampled_choices_prefill_their_prompt_once(tiny_pairs):
    """``n`` sampled choices decode together: the later draws take the prompt from the first's batch row, and each
    is still the draw ``pipe(..., seed=seed + i)`` makes alone (the tree's sizes and prices set, so that batch 1 and
    batch 3 grow the same trees: automatic ones are fitted per batch size)."""
    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage", n_max=12, d_max=6, node_cost=0.02, level_cost=0.3)
    content = [{"type": "image_url", "image_url": {"url": _png_uri(make_image(0))}},
               {"type": "text", "text": "Describe this image."}]  # fmt: skip
    body = {"messages": [{"role": "user", "content": content}], "n": 3, "temperature": 0.9, "seed": 5}
    pipe.prefix_cache = PrefixCache()
    with SpecServer(pipe, port=0, batch_size=3, max_tokens=MAX_NEW) as server:
        address = server._http.server_address[:2]
        reply = _call(address, "POST", "/v1/chat/completions", body)
        metrics = _call(address, "GET", "/metrics")
    pipe.prefix_cache = None
    request = {"image": make_image(0), "prompt": "Describe this image.", "max_new_tokens": MAX_NEW}
    draws = [pipe(**request, do_sample=True, temperature=0.9, seed=5 + i).text for i in range(3)]
    assert [c["message"]["content"] for c in reply["choices"]] == draws
    cached = int(re.search(r"^vlmspec_cached_prompt_tokens_total (\d+)$", metrics, re.M).group(1))
    assert cached >= 2 * int(_visual(pipe, request).sum())  # two draws took the picture from the first


def test_the_serve_command_refuses_a_bad_prefix_cache_size(capsys):
    from vlmspec.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--prefix-cache-gb", "-1", "--port", "0"])
    assert exit_.value.code != 0
    assert "--prefix-cache-gb" in capsys.readouterr().err


def test_pixels_edited_in_place_between_calls_are_another_image(tiny_pairs):
    """``pipe(inputs=...)`` with the caller's own tensors: the cache keeps a copy of the media it saw, so writing
    other pixels into the same tensor is another image (same placeholder tokens, other pixels)."""
    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage")
    pipe.prefix_cache = PrefixCache()
    inputs = pipe.prepare_inputs(make_image(0), "Describe this image.")
    other = pipe.prepare_inputs(make_image(3), "Describe this image.")
    assert torch.equal(inputs["input_ids"], other["input_ids"])
    pipe(inputs=inputs, max_new_tokens=MAX_NEW)
    inputs["pixel_values"].copy_(other["pixel_values"])
    out = pipe(inputs=inputs, max_new_tokens=MAX_NEW)
    assert out.token_ids == pipe.reference_generate(other, MAX_NEW)
    assert out.stats.cached_prompt_tokens == _text_before_media(
        pipe, {"image": make_image(3), "prompt": "Describe this image."}
    )


@pytest.mark.parametrize(
    "pair, options",
    [("qwen2_vl", {"policy": "sage"}), ("llava_onevision", {"policy": "sage"}),
     ("qwen3_vl", {"policy": "eagle2", "prune_ratio": 0.5}), ("edd", {"policy": "eagle2"})],
    ids=["qwen2_vl", "llava_onevision", "pruned draft", "edd draft"],
)  # fmt: skip
def test_requests_of_one_batch_share_a_prefix_while_they_decode(tiny_pairs, pair, options):
    """Two questions about one picture start together: the second takes the first's prompt from its batch row, and
    both replies are generate()'s. Requests of other batches (here: the next pipe() call) see only what ended."""
    if pair == "edd":
        pipe = VLMSpecPipeline.from_pretrained("testbed-base:qwen2_vl", "edd", **options)
    else:
        pipe = _pipe(tiny_pairs, pair, **options)
    media = {"video": make_video_frames(0)} if pair == "qwen3_vl" else {"image": make_image(0)}
    requests = [dict(media, prompt=p) for p in ("Describe this.", "What is the largest shape in it?")]
    references = _references(pipe, requests)
    pipe.prefix_cache = store = PrefixCache()
    outs = pipe.batch([dict(r, max_new_tokens=MAX_NEW) for r in requests], batch_size=2)
    assert [o.token_ids for o in outs] == references
    first, second = (o.stats.cached_prompt_tokens for o in outs)
    assert first == 0 and second > int(_visual(pipe, requests[1]).sum())  # its picture came from the first
    assert len(store) == 2 and not list(store._live)  # both kept once they ended; none decoding now


class _Probe:
    """A streamer that, at its request's first verification step (its caches then hold its prompt in a batch row),
    asks the prefix cache for that prompt's caches as a request of its own batch and of another batch would."""

    def __init__(self, pipe: VLMSpecPipeline, inputs: dict) -> None:
        self.pipe, self.inputs, self.taken, self.puts = pipe, inputs, {}, 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts != 2:  # the prompt's ids come first, before any prefill
            return
        store = self.pipe.prefix_cache
        (decoding,) = [turn for turn in store._live if turn.prompt_entry() is not None]
        for name, batch in (("same batch", decoding.batch), ("another batch", object())):
            self.taken[name] = store.turn(self.inputs, self.pipe.target_adapter, batch).taken
        self.inputs = None

    def end(self) -> None:
        """Nothing to flush."""


def test_a_request_of_another_batch_does_not_read_rows_still_decoding(tiny_pairs):
    """Only the rows of the request's own batch are read while they decode (another batch may run in another
    thread, moving and rewriting its rows); a request that never ended (an error, Ctrl-C) is forgotten with it."""
    import gc

    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage")
    pipe.prefix_cache = store = PrefixCache()
    image = make_image(0)
    probe = _Probe(pipe, pipe.prepare_inputs(image, "What is the largest shape in it?"))
    pipe(image, "Describe this.", max_new_tokens=4, streamer=probe)
    assert set(probe.taken["same batch"]) == {DRAFT_FIRST, TARGET} and probe.taken["another batch"] == {}
    del probe
    gc.collect()
    assert not list(store._live)


def test_another_pipeline_s_entries_are_never_reused(tiny_pairs):
    """One prefix cache given to two pipelines: each reuses only what its own models computed."""
    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage")
    other = VLMSpecPipeline.from_pretrained("testbed-mini:qwen2_vl", policy="sage")
    pipe.prefix_cache = other.prefix_cache = PrefixCache()
    request = {"image": make_image(0), "prompt": "Describe this image.", "max_new_tokens": MAX_NEW}
    assert pipe(**request).stats.cached_prompt_tokens == 0
    out = other(**request)
    assert out.stats.cached_prompt_tokens == 0
    assert out.token_ids == other.reference_generate(
        other.prepare_inputs(request["image"], request["prompt"]), MAX_NEW
    )
    assert pipe(**request).stats.cached_prompt_tokens > 0  # its own entry is still there


class _FailingStreamer:
    """Fails its request at its first verification step (the prompt's ids come first)."""

    def __init__(self) -> None:
        self.puts = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            raise RuntimeError("the consumer went away")

    def end(self) -> None:
        """Nothing to flush."""


def test_a_request_that_failed_mid_batch_lends_nothing_to_later_ones(tiny_pairs):
    """Its row was given up (another request may hold it now): a later request of the batch sharing its prompt
    prefills afresh rather than copying that row."""
    pipe = _pipe(tiny_pairs, "qwen2_vl", policy="sage")
    image, other = make_image(0), make_image(3)
    requests = [
        {"image": image, "prompt": "Describe this.", "streamer": _FailingStreamer()},
        {"image": other, "prompt": "Describe this."},
        {"image": image, "prompt": "What is the largest shape in it?"},
    ]
    references = _references(pipe, requests)
    pipe.prefix_cache = PrefixCache()
    outs = pipe.batch(
        [dict(r, max_new_tokens=MAX_NEW) for r in requests], batch_size=2, return_exceptions=True
    )
    assert isinstance(
        outs[0], RuntimeError
    )  # kept with its traceback: the failed request's caches still exist
    assert [o.token_ids for o in outs[1:]] == references[1:]
    assert outs[2].stats.cached_prompt_tokens == _text_before_media(
        pipe, requests[2]
    )  # the text only, from b
