"""Conversations (pipe.chat) that go back on themselves: a turn asked again, a turn interrupted inside a forward."""

from __future__ import annotations

import pytest
import torch

from vlmspec import VLMSpecPipeline
from vlmspec.testing import make_image

MAX_NEW = 12


@pytest.fixture(scope="module")
def pipe(tiny_pairs):
    pair = tiny_pairs["qwen2_vl"]
    return VLMSpecPipeline.from_pretrained(pair.target, pair.draft, policy="sage", torch_dtype=torch.float32)


def _reference(pipe: VLMSpecPipeline, messages: list[dict]) -> list[int]:
    return pipe.reference_generate(pipe.prepare_messages(messages), MAX_NEW)


def test_asking_the_same_turn_again_reuses_all_but_the_prompt_s_last_token(pipe):
    """Regenerating a reply (drop the last exchange, send the same text): the new prompt is a prefix of what the
    caches hold, so all of it is shared, yet its last token must run again to give the first token's logits."""
    chat = pipe.chat(max_new_tokens=MAX_NEW)
    first = chat.send("What is in the picture?", images=make_image(0))
    del chat.messages[-2:]
    again = chat.send("What is in the picture?", images=make_image(0))
    assert again.token_ids == first.token_ids == _reference(pipe, chat.messages[:-1])
    assert again.stats.cached_prompt_tokens == again.stats.prompt_tokens - 1


def test_a_turn_interrupted_inside_a_forward_leaves_caches_the_next_turn_can_use(pipe):
    """Ctrl-C while the target runs its layers (a notebook's interrupt): some layers' caches hold the forward's
    entries, others not. The history is as before the turn, and the next turn decodes as generate() does."""
    chat = pipe.chat(max_new_tokens=MAX_NEW)
    chat.send("What is in the picture?", images=make_image(0))
    before = list(chat.messages)
    layers = pipe.target.model.language_model.layers
    calls: list[int] = []

    def interrupt(module, args):
        calls.append(1)
        if len(calls) == 2:  # the turn's first verification (after its prefill), once the first layer wrote
            raise KeyboardInterrupt

    hook = layers[1].register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            chat.send("Say more.")
    finally:
        hook.remove()
    assert chat.messages == before
    out = chat.send("Say more.")
    assert out.token_ids == _reference(pipe, chat.messages[:-1])
