"""Padded batches of processor outputs for the pipe.generate tests."""

from __future__ import annotations

from typing import Any


def image_and_text_prompts(processor: Any, prompt: str) -> list[str]:
    """Two chat-templated prompts of different lengths: ``prompt`` about one image, then a text-only "Hi"."""
    contents = ([{"type": "image"}, {"type": "text", "text": prompt}], [{"type": "text", "text": "Hi"}])
    return [
        processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        for content in contents
    ]
