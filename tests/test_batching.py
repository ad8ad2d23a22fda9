"""Batched decoding (``pipe.batch``): each request's output is what it gets alone, whatever the batch.

Greedy: every family x every lossless policy, a batch of mixed requests (one image, two images, a video, text;
different prompt lengths and reply lengths) equals each request's own greedy ``generate()`` at batch 1; on the
trained testbed pairs, whose captions end with EOS, with requests leaving the batch early and queued ones taking
their rows. Sampling: the same seed gives the same reply at batch 1 and batch 3.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
import weakref
from functools import partial

import pytest
import torch
from conftest import PROMPTS, input_kinds

from vlmspec import RequestFeed, VLMSpecPipeline, get_policy, testbed
from vlmspec.batching import Batcher
from vlmspec.testbed.world import sample
from vlmspec.testing import FAMILIES

POLICIES = ("ar", "chain", "static", "sage", "sage_paper", "eagle2", "pct", "wetap", "c2t")


def mixed_requests(without: tuple[str, ...] = ()) -> list[dict]:
    """Eight requests: every input kind (but those ``without``: two fewer each), prompts of different lengths,
    replies of 12 to 40 tokens."""
    requests = []
    kinds = [(kind, image, video) for kind, image, video in input_kinds() if kind not in without]
    for i, (_kind, image, video) in enumerate(kinds * 2):
        requests.append(
            {
                "image": image,
                "video": video,
                "prompt": PROMPTS[i % len(PROMPTS)],
                "max_new_tokens": 12 + 4 * i,
            }
        )
    return requests


def reference(pipe: VLMSpecPipeline, request: dict) -> list[int]:
    inputs = pipe.prepare_inputs(request["image"], request["prompt"], request["video"])
    return pipe.reference_generate(inputs, request["max_new_tokens"])


def check_replies_equal_generate(
    pipe: VLMSpecPipeline, policy: str, cases: list[tuple[str, dict, list[int]]]
) -> None:
    """Under ``policy``, each ``(label, call keywords, generate()'s reply)`` case's reply is ``generate()``'s, and the
    draft's proposals were accepted somewhere (none with ``ar``)."""
    pipe.policy = get_policy(policy)
    accepted = 0
    for label, call, expected in cases:
        out = pipe(**call)
        assert out.token_ids == expected, f"{policy}/{label}"
        accepted += out.stats.accepted_tokens
    assert (accepted == 0) == (policy == "ar")


def check_a_pruned_draft_keeps_the_replies(
    pipe: VLMSpecPipeline, cases: list[tuple[str, dict, list[int]]]
) -> None:
    """Under ``sage``, with the draft seeing half of the visual tokens (its prefill built by vlmspec from the model's
    own features), each ``(label, call keywords, generate()'s reply)`` case with a picture or video replies as
    ``generate()`` does."""
    pipe.policy = get_policy("sage")
    for label, call, expected in cases:
        if call.get("image") is None and call.get("video") is None:
            continue
        out = pipe(**call, prune_ratio=0.5)
        assert out.token_ids == expected, f"pruned/{label}"
        assert out.stats.draft_visual_tokens == out.stats.target_visual_tokens // 2, label


def check_a_sampled_reply_is_the_same_alone_and_at_batch_3(target, draft) -> None:
    """With ``sage``'s tree sizes and prices set (automatic ones are refitted per batch size, and another tree draws
    other random numbers: a different sample of the same distribution), five mixed requests sampled with their own
    seeds reply alike alone and three at a time, and differently from each other."""
    pipe = VLMSpecPipeline.from_pretrained(
        target, draft, policy="sage", n_max=12, d_max=5, d_min=3, node_cost=0.02, level_cost=0.05,
        torch_dtype=torch.float32,
    )  # fmt: skip
    requests = [
        dict(r, do_sample=True, seed=10 + i, temperature=0.9) for i, r in enumerate(mixed_requests()[:5])
    ]
    alone = [pipe(**r).token_ids for r in requests]
    assert [out.token_ids for out in pipe.batch(requests, batch_size=3)] == alone
    assert len({tuple(t) for t in alone}) == len(alone)


_BATCH_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per target model, ``generate()``'s reply to each request :func:`check_batch_equals_generate` was given (by its
inputs and length): the policies checked one after the other on a module's pipe compare with the same replies."""


def _digest(name: str, value: object) -> tuple[str, str]:
    """``name`` and a hash of its tensor's bytes (of other values, their ``repr``)."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return name, hashlib.sha1(data).hexdigest() + str(tuple(value.shape))
    return name, repr(value)


def check_batch_equals_generate(pipe: VLMSpecPipeline, requests: list[dict], label: str) -> None:
    """``pipe.batch`` at batch 6: each reply is that request's own ``generate()``, token for token."""
    outputs = pipe.batch(requests, batch_size=6)
    known = _BATCH_REFERENCES.setdefault(pipe.target, {})
    for i, (request, out) in enumerate(zip(requests, outputs, strict=True)):
        inputs = pipe.prepare_inputs(request["image"], request["prompt"], request["video"])
        key = (request["max_new_tokens"], *(_digest(name, value) for name, value in sorted(inputs.items())))
        if key not in known:
            known[key] = pipe.reference_generate(inputs, request["max_new_tokens"])
        assert out.token_ids == known[key], f"{label}: request {i}"


@pytest.fixture(scope="module", params=FAMILIES)
def family_case(request, tiny_pairs):
    pair = tiny_pairs[request.param]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    requests = mixed_requests()
    return request.param, pipe, requests, [reference(pipe, r) for r in requests]


@pytest.mark.parametrize("policy", POLICIES)
def test_batch_equals_generate(family_case, policy):
    family, pipe, requests, expected = family_case
    pipe.policy = get_policy(policy)
    outputs = pipe.batch(requests, batch_size=6)
    accepted = 0
    for i, (out, want) in enumerate(zip(outputs, expected, strict=True)):
        assert out.token_ids == want, f"{family}/{policy}: request {i} ({requests[i]['prompt']!r})"
        accepted += out.stats.accepted_tokens
    assert (accepted == 0) == (policy == "ar")  # the drafts were exercised at batch > 1


@pytest.mark.parametrize("family", testbed.FAMILIES)
def test_testbed_batch_with_early_eos_equals_generate(family):
    """Trained pairs: captions end with EOS at different lengths, so rows leave while others go on, and with
    batch size 3 for 7 requests the queued ones join mid-run (continuous batching)."""
    pipe = VLMSpecPipeline.from_pretrained(f"testbed-base:{family}", policy="sage")
    requests = []
    for i in range(7):
        example = sample(("image_caption", "image_qa", "video_caption")[i % 3], 300 + i)
        requests.append(
            {"image": example.image, "video": example.video, "prompt": example.prompt, "max_new_tokens": 96}
        )
    requests.append({"image": None, "video": None, "prompt": "Describe the scene.", "max_new_tokens": 24})
    expected = [reference(pipe, r) for r in requests]
    eos = set(pipe.target.generation_config.eos_token_id or [])
    assert (
        sum(want[-1] in eos and len(want) < 96 for want in expected) >= 4
    )  # most end early, at different steps
    assert len({len(want) for want in expected}) >= 4
    for policy in ("sage", "eagle2"):
        pipe.policy = get_policy(policy)
        outputs = pipe.batch(requests, batch_size=3)
        assert [out.token_ids for out in outputs] == expected, policy


def test_sampling_same_seed_same_reply_at_any_batch_size(tiny_pairs):
    """With the tree's budget, depth and (sage's) node and level prices set (automatic ones are refitted per batch
    size, and another tree draws other random numbers: a different sample of the same distribution), the same seed
    gives the same reply."""
    pair = tiny_pairs["qwen2_vl"]
    check_a_sampled_reply_is_the_same_alone_and_at_batch_3(pair.target, pair.draft)


def test_a_bad_request_fails_alone(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    good = mixed_requests()[:3]
    bad = {"image": None, "video": None, "prompt": "hi", "do_sample": True, "temperature": "hot"}
    outputs = pipe.batch([good[0], bad, *good[1:]], batch_size=2, return_exceptions=True)
    assert isinstance(outputs[1], Exception)
    assert [out.token_ids for out in (outputs[0], *outputs[2:])] == [reference(pipe, r) for r in good]
    with pytest.raises((TypeError, ValueError), match="request 1"):
        pipe.batch([good[0], bad], batch_size=2)


def test_batch_size_is_checked():
    with pytest.raises(ValueError, match=r"batch_size=0 is invalid: use an integer >= 1"):
        Batcher(0)


def test_an_error_inside_a_request_reaches_the_caller_and_the_batch_goes_on():
    batcher = Batcher(2)

    def fails():
        raise RuntimeError("boom")

    results = {index: (output, error) for index, output, error in batcher.map([lambda: 1, fails, lambda: 3])}
    assert results[0] == (1, None) and results[2] == (3, None)
    assert isinstance(results[1][1], RuntimeError)


def test_pruned_drafts_and_edd_drafts_at_batch_size_3_equal_generate(tiny_pairs):
    """The draft's own prefills run per request inside the batch: a pruned draft (visual scores from the target's
    prefill) and an EDD draft (soft prompt from the target's hidden states, pending rows every step)."""
    pair = tiny_pairs["qwen2_vl"]
    pruned = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="sage", prune_ratio=0.5, torch_dtype=torch.float32
    )
    requests = mixed_requests()[:6]
    outputs = pruned.batch(requests, batch_size=3)
    assert [o.token_ids for o in outputs] == [reference(pruned, r) for r in requests]
    assert any(o.stats.draft_visual_tokens < o.stats.target_visual_tokens for o in outputs)

    edd = VLMSpecPipeline.from_pretrained("testbed-base:qwen2_vl", "edd", policy="eagle2")
    examples = [
        sample(task, 40 + i) for i, task in enumerate(["image_caption", "video_caption", "image_qa"] * 2)
    ]
    requests = [
        {"image": e.image, "video": e.video, "prompt": e.prompt, "max_new_tokens": 40} for e in examples
    ]
    outputs = edd.batch(requests, batch_size=3)
    assert [o.token_ids for o in outputs] == [reference(edd, r) for r in requests]
    assert sum(o.stats.accepted_tokens for o in outputs) > 0


def test_a_batch_stopped_early_ends_every_request(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    results = pipe.batch_iter(mixed_requests(), batch_size=3)
    index, first = next(results)
    assert first.token_ids
    results.close()  # the caller stops (an error of its own, Ctrl-C): the requests still running must end
    threads = [t for t in threading.enumerate() if t.name.startswith("vlmspec-request-")]
    for thread in threads:
        thread.join(timeout=10)
    assert not [t.name for t in threads if t.is_alive()]
    assert pipe(**mixed_requests()[index]).token_ids == first.token_ids  # the pipeline is still usable


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt in the main thread), as in a terminal: the Ctrl-C tests below
    send SIGINT to their own process, and a library an earlier test of the same worker ran may have left SIGINT
    ignored or handled its own way (once seen in a full run: the batch finished, no KeyboardInterrupt)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_while_a_request_computes_waits_for_its_thread(python_sigint):
    """Ctrl-C lands in the main thread while a request's thread computes: the batch must not return (and the
    interpreter exit) with that thread still inside torch, which aborts the process (SIGABRT, found by QA)."""
    finished: list[int] = []

    def job(index: int) -> int:
        if index == 0:
            os.kill(os.getpid(), signal.SIGINT)  # the main thread waits for this request's turn
        time.sleep(0.2)  # still computing when the interrupt arrives
        finished.append(index)
        return index

    batcher = Batcher(max_rows=3)
    with pytest.raises(KeyboardInterrupt):
        list(batcher.map([partial(job, i) for i in range(4)]))
    assert finished == [0]  # it ran to its end; the requests never started did not run
    assert not [t.name for t in threading.enumerate() if t.name.startswith("vlmspec-request-")]


def test_the_lossy_dsbd_works_per_row_at_batch_size_3(tiny_pairs):
    """DSBD (opt-in, lossy beam sampling) keeps its per-request state per row: the same seeds give the same replies
    as one at a time."""
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="dsbd", torch_dtype=torch.float32)
    requests = [
        dict(r, do_sample=True, seed=i, top_k=10, top_p=0.8, max_new_tokens=16)
        for i, r in enumerate(mixed_requests()[:4])
    ]
    alone = [pipe(**r).token_ids for r in requests]
    outputs = pipe.batch(requests, batch_size=3)
    assert [o.token_ids for o in outputs] == alone
    assert not any(o.stats.lossless for o in outputs)


def test_requests_are_read_one_at_a_time_as_rows_free():
    """``batch_iter`` reads its requests lazily (a job's generator of requests may be endless)."""
    read: list[int] = []

    def endless():
        index = 0
        while True:
            read.append(index)
            yield partial(lambda i: i, index)
            index += 1

    results = Batcher(2).map(endless())
    assert next(results)[1] == 0
    results.close()
    assert len(read) <= 3  # the two rows, and the one that took the first free row


def test_a_request_put_in_a_feed_while_others_decode_joins_their_batch(tiny_pairs, monkeypatch):
    import vlmspec.batching as batching

    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)
    first, second = mixed_requests()[4:6]
    merged_rows: list[int] = []
    run_merged = batching.run_merged
    monkeypatch.setattr(
        batching, "run_merged", lambda calls: merged_rows.append(len(calls)) or run_merged(calls)
    )
    feed = RequestFeed()

    def first_arrives_then_second():  # the second request arrives while the first decodes
        feed.put(second)
        feed.close()
        return first

    feed.put(first_arrives_then_second)
    results = dict(pipe.batch_iter(feed, batch_size=2))
    assert [results[0].token_ids, results[1].token_ids] == [reference(pipe, first), reference(pipe, second)]
    assert max(merged_rows) == 2  # their forwards were merged
    with pytest.raises(ValueError, match="closed"):
        feed.put(first)


def test_a_feed_with_nothing_queued_waits_for_requests_and_ends_when_closed(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="chain", torch_dtype=torch.float32)
    feed = RequestFeed()
    results: list[tuple[int, object]] = []
    consumer = threading.Thread(target=lambda: results.extend(pipe.batch_iter(feed, batch_size=3)))
    consumer.start()
    time.sleep(0.3)  # the consumer waits on the empty feed
    assert consumer.is_alive() and not results
    request = mixed_requests()[0]
    assert feed.put(request) == 0
    feed.close()
    consumer.join(timeout=60)
    assert not consumer.is_alive()
    assert [(i, out.token_ids) for i, out in results] == [(0, reference(pipe, request))]


def test_ctrl_c_during_a_new_request_s_prefill_still_ends_it(python_sigint):
    """The request is one of the batch before it first runs: Ctrl-C while it runs to its first forward (its
    prefill) must end it there, not leave its thread waiting for a forward forever (found by review)."""
    batcher = Batcher(max_rows=2)

    def job(index: int) -> int:
        if index == 0:
            os.kill(os.getpid(), signal.SIGINT)  # lands while this request computes its prefill
            time.sleep(0.2)
            batcher.run(object(), 1, None, None, None, None)  # its first forward, which never runs
        return index

    with pytest.raises(KeyboardInterrupt):
        list(batcher.map([partial(job, i) for i in range(3)]))
    threads = [t for t in threading.enumerate() if t.name.startswith("vlmspec-request-")]
    for thread in threads:
        thread.join(timeout=10)
    assert not [t.name for t in threads if t.is_alive()]


def _half_the_visual_tokens(adapter, inputs: dict) -> torch.Tensor | None:
    """Prompt positions keeping the text and every other visual token (``None`` for a prompt without media)."""
    visual = adapter.prompt_layout(inputs).visual
    if not bool(visual.any()):
        return None
    every_other = (visual.long().cumsum(0) % 2 == 0) & visual
    return (~visual | every_other).nonzero().flatten()


def _assert_same_prefill(together, alone, length: int) -> None:
    torch.testing.assert_close(together.logits, alone.logits, rtol=1e-4, atol=1e-4)
    assert int(together.state.rope_delta) == int(alone.state.rope_delta)
    assert together.state.visual_tokens == alone.state.visual_tokens
    assert together.state.length == alone.state.length == length
    for mine, own in zip(together.state.cache.layers, alone.state.cache.layers, strict=True):
        torch.testing.assert_close(mine.keys, own.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mine.values, own.values, rtol=1e-4, atol=1e-4)
    if alone.visual_scores is None:
        assert together.visual_scores is None
    else:
        torch.testing.assert_close(together.visual_scores, alone.visual_scores, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_prefilled_together_are_each_prompt_s_own_prefill(tiny_pairs, family):
    """``prefill_many`` over prompts of every input kind and length (a text-only one beside Qwen3-VL's deepstack
    rows): each row's logits, cache, rotary offset, visual count and visual scores are that prompt's own
    ``prefill``'s, up to the rounding of batched kernels; so are pruned prompts' (the draft's ``keep``)."""
    pair = tiny_pairs[family]
    pipe = VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="ar", torch_dtype=torch.float32)
    prompts = [pipe.prepare_inputs(r["image"], r["prompt"], r["video"]) for r in mixed_requests()[:4]]
    target, draft = pipe.target_adapter, pipe.draft_adapter
    merged = target.prefill_many(
        prompts, score_visual=True
    )  # rows of different lengths: padding is exercised
    for inputs, together in zip(prompts, merged, strict=True):
        alone = target.prefill(inputs, score_visual=True)
        _assert_same_prefill(together, alone, inputs["input_ids"].shape[1])
    assert sum(p.visual_scores is not None for p in merged) >= 3
    keeps = [_half_the_visual_tokens(draft, inputs) for inputs in prompts]  # image, two images, video pruned
    for inputs, keep, together in zip(prompts, keeps, draft.prefill_many(prompts, keeps), strict=True):
        length = inputs["input_ids"].shape[1] if keep is None else keep.numel()
        _assert_same_prefill(together, draft.prefill(inputs, keep=keep), length)


def test_requests_joining_together_prefill_each_model_in_one_forward(tiny_pairs, monkeypatch):
    """Six requests start a batch of six: one merged prefill per model, six prompts each (the target's with
    visual scores, the draft's pruned by them); the queued ones prefill as rows free (alone, as ``generate()``
    does, or together when rows free together). Replies stay each request's own."""
    from vlmspec.models import VLMAdapter

    pair = tiny_pairs["qwen2_vl"]
    pipe = VLMSpecPipeline.from_pretrained(
        pair.target, pair.draft, policy="chain", prune_ratio=0.5, torch_dtype=torch.float32
    )
    requests = mixed_requests()
    expected = [reference(pipe, r) for r in requests]
    merged, alone = [], []
    many, one = VLMAdapter.prefill_many, VLMAdapter.prefill
    monkeypatch.setattr(
        VLMAdapter, "prefill_many", lambda self, p, *a, **k: merged.append(len(p)) or many(self, p, *a, **k)
    )
    monkeypatch.setattr(VLMAdapter, "prefill", lambda self, *a, **k: alone.append(1) or one(self, *a, **k))
    outputs = pipe.batch(requests, batch_size=6)
    assert [o.token_ids for o in outputs] == expected
    assert merged[:2] == [6, 6]  # the target's six prompts, then the draft's
    assert any(o.stats.draft_visual_tokens < o.stats.target_visual_tokens for o in outputs)  # pruned drafts
    assert sum(merged) + len(alone) == 2 * len(requests)  # every prompt prefilled once per model
