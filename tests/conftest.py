"""Shared fixtures: tiny real-architecture pairs, built once per test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run (a CI run must not fail on a draw the last one did not make);
# HYPOTHESIS_PROFILE=explore draws fresh ones, to look for new failing cases.
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

sys.path.insert(0, str(Path(__file__).parent))  # tests/synthetic.py helpers

# Two test processes (pytest-xdist) share CI's two cores, and the commands some tests start (caption jobs, lmms-eval,
# EDD training) inherit this environment: one OpenMP thread each, or a child's second thread fights the other test
# process for its core (OpenMP threads spin while they wait; under that contention such tests ran up to 3x slower).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The models under test are tiny: one thread per test process is fastest, and `make test` runs two processes
# (pytest-xdist) on CI's two cores.
torch.set_num_threads(1)

from vlmspec.testing import FAMILIES, build_tiny_pair, make_image, make_video_frames  # noqa: E402

PROMPTS = (
    "Describe this image.",
    "What color is the largest shape?",
    "How many objects are there? Answer briefly.",
    "Write a short story about what you see.",
    "List three things in the picture.",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` (ten seconds or more of a subprocess or a long run) run first: longest first lets the two
    xdist workers finish together instead of one starting a long test near the end (a module-scoped fixture such a
    test shares may then be built on both workers)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    """Where the tiny pairs live: $VLMSPEC_TEST_CACHE (reused across runs) or a fresh temp folder that all
    pytest-xdist workers of the session share (pytest-xdist's documented pattern), so each pair is built once."""
    env = os.environ.get("VLMSPEC_TEST_CACHE")
    if env:
        return Path(env)
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "tiny"


@pytest.fixture(scope="session")
def tiny_pairs(tiny_root):
    return {family: build_tiny_pair(family, root=tiny_root) for family in FAMILIES}


def input_kinds():
    """(name, image, video) for one image, two images, a video and text only."""
    return [
        ("image", make_image(0), None),
        ("two_images", [make_image(1), make_image(2)], None),
        ("video", None, make_video_frames(0)),
        ("text", None, None),
    ]


def check_a_conversation_with_pictures_equals_generate(pipe, pictures=None, reused=True) -> None:
    """A ``sage`` chat of three turns (a picture, another picture, text; ``pictures``: the two, two 56-pixel
    squares by default): each reply is ``generate()``'s on the whole conversation so far, and the later turns
    prefill on the earlier ones' caches (``reused``; else every turn prefills afresh)."""
    from vlmspec import get_policy

    pipe.policy = get_policy("sage")
    chat = pipe.chat(max_new_tokens=32)
    first, second = pictures or (make_image(1), make_image(2))
    turns = (
        ("Describe this image.", first),
        ("And this one?", second),
        ("Which is larger?", None),
    )
    previous = 0  # the last turn's prompt: its pictures are reused with it
    for turn, (text, image) in enumerate(turns):
        out = chat.send(text, images=image)
        inputs = pipe.prepare_messages(chat.messages[:-1])
        assert out.token_ids == pipe.reference_generate(inputs, 32), turn
        reuse = turn and reused
        assert out.stats.cached_prompt_tokens >= previous if reuse else out.stats.cached_prompt_tokens == 0, (
            turn
        )
        previous = inputs["input_ids"].shape[1]


def check_a_padded_batch_splits_into_its_prompts(pipe, prompts, same_media, nested_images=False) -> dict:
    """One processor batch of ``prompts`` (``(content, pictures, video or None)`` each, as one user turn), padded by
    the processor: each row of ``split_rows`` has its prompt's own ids and media (``same_media(row, alone, b)``
    compares the media with the prompt's processed alone), and ``pipe.generate`` on the batch gives each prompt's
    ``generate()`` reply. ``nested_images``: the processor takes one list of pictures per prompt. Returns the batch."""
    texts = [
        pipe.processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        for content, _, _ in prompts
    ]
    pictures = [p for _, p, _ in prompts] if nested_images else [i for _, p, _ in prompts for i in p]
    videos = [v for _, _, v in prompts if v is not None]
    media = {
        "images": pictures if any(p for _, p, _ in prompts) else None,
        **({"videos": videos} if videos else {}),
    }
    batch = pipe.processor(text=texts, padding=True, return_tensors="pt", **media)
    rows = pipe.target_adapter.split_rows(dict(batch))
    width = batch["input_ids"].shape[1]
    replies = pipe.generate(**batch, max_new_tokens=24)
    for b, (row, text, (_, own, video)) in enumerate(zip(rows, texts, prompts, strict=True)):
        alone = pipe.processor(
            text=[text],
            images=([own] if nested_images else own) if own else None,
            videos=[video] if video is not None else None,
            return_tensors="pt",
        )
        assert torch.equal(row["input_ids"], alone["input_ids"]), b
        same_media(row, alone, b)
        expected = pipe.reference_generate(dict(alone), 24)
        assert replies[b, width : width + len(expected)].tolist() == expected, b
    return batch


def language_model_inputs(model, inputs) -> torch.Tensor:
    """``[1, L, D]``: the ``inputs_embeds`` the VLM ``model``'s own forward hands its language model for the prompt
    ``inputs`` (what an adapter's ``embed_prompt`` must build)."""
    return language_model_kwargs(model, inputs)["inputs_embeds"]


def language_model_kwargs(model, inputs) -> dict:
    """Every keyword input the VLM ``model``'s own forward hands its language model for the prompt ``inputs``."""
    seen: list[dict] = []
    handle = model.model.language_model.register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(kw), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return seen[0]


def check_the_second_token_follows_the_target(pipe, draws: int, image=None) -> None:
    """Sampling at temperature 1.5, top-k 4: the second token (the first one a speculative step emits) over
    ``draws`` seeds follows the target's own two-token distribution, sum over the first token t1 of
    p(t1) p(t2 | t1) with generate()'s warping (a chi-square test), and is never a token the target cannot emit.
    ``image``: the prompt's picture (none: a text prompt, cheaper per draw)."""
    from scipy.stats import chisquare

    prompt = "Describe this image." if image is not None else "Tell me a short story about a dog."
    kw = dict(max_new_tokens=2, do_sample=True, temperature=1.5, top_k=4, top_p=1.0)
    second = torch.tensor([pipe(image, prompt, seed=s, **kw).token_ids[1] for s in range(draws)])
    inputs = pipe.prepare_inputs(image, prompt)
    with torch.no_grad():
        first = _warped(pipe.target(**inputs).logits[0, -1])
        expected = torch.zeros_like(first)
        for t1 in first.nonzero().flatten().tolist():
            ids = torch.cat([inputs["input_ids"], torch.tensor([[t1]])], dim=1)
            extended = {**inputs, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if "mm_token_type_ids" in inputs:
                extended["mm_token_type_ids"] = torch.cat(
                    [inputs["mm_token_type_ids"], torch.zeros(1, 1, dtype=torch.long)], dim=1
                )
            expected += first[t1] * _warped(pipe.target(**extended).logits[0, -1])
    support = expected.nonzero().flatten()
    counts = torch.bincount(second, minlength=expected.shape[0])
    assert counts[expected == 0].sum() == 0  # never a token the target cannot emit
    expected_counts = expected[support].double() / expected[support].double().sum() * draws
    assert chisquare(counts[support].double().numpy(), expected_counts.numpy()).pvalue > 1e-3


def _warped(logits: torch.Tensor) -> torch.Tensor:
    """generate()'s warping at temperature 1.5, top-k 4."""
    scaled = logits.float() / 1.5
    kth = scaled.topk(4).values[-1]
    return torch.softmax(scaled.masked_fill(scaled < kth, float("-inf")), dim=-1)
