"""Turning testbed examples into model inputs: chat-formatted prompts, visual inputs and reply labels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .world import Example

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import ProcessorMixin

__all__ = ["IGNORE", "chat_prompt", "encode", "reply_mask"]

IGNORE = -100
"""Label of positions that carry no loss (prompt, visual tokens, padding)."""


def chat_prompt(processor: ProcessorMixin, example: Example) -> str:
    """The chat-formatted prompt of ``example`` (user turn with its image/video, then the assistant header)."""
    media = {"type": "video"} if example.video is not None else {"type": "image"}
    content = [media, {"type": "text", "text": example.prompt}]
    return processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def _video_metadata(frames: int) -> Any:
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(total_num_frames=frames, fps=4.0, frames_indices=list(range(frames)))


def encode(processor: ProcessorMixin, examples: Sequence[Example], with_reply: bool = True) -> dict[str, Any]:
    """Processes a batch of examples of one modality (all images or all videos).

    Args:
        processor: The pair's processor.
        examples: Examples that all have an ``image`` or all have a ``video``.
        with_reply: Append each reference reply and ``<|im_end|>`` (training); otherwise the inputs end with
            the assistant header (generation).

    Returns:
        The processor's tensors (``input_ids`` ``[B, L]`` left-padded, ``attention_mask`` ``[B, L]``, pixel
        tensors, grids, ...) plus ``labels`` ``[B, L]`` when ``with_reply`` (reply tokens and the closing
        ``<|im_end|>``; :data:`IGNORE` elsewhere).

    Raises:
        ValueError: If the batch mixes images and videos or is empty.
    """
    if not examples:
        raise ValueError("encode() needs at least one example.")
    videos = [e.video is not None for e in examples]
    if any(videos) != all(videos):
        raise ValueError("encode() needs a batch of one modality: all image examples or all video examples.")
    tokenizer = processor.tokenizer
    texts = [
        chat_prompt(processor, e) + (e.reference + tokenizer.eos_token if with_reply else "")
        for e in examples
    ]
    kwargs: dict[str, Any] = {"text": texts, "return_tensors": "pt", "padding": True}
    if all(videos):
        kwargs["videos"] = [e.video for e in examples]
        kwargs["video_metadata"] = [_video_metadata(len(e.video)) for e in examples]
    else:
        kwargs["images"] = [e.image for e in examples]
    batch = dict(processor(**kwargs))
    if with_reply:
        start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
        batch["labels"] = reply_mask(batch["input_ids"], batch["attention_mask"], start_id)
    return batch


def reply_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor, start_id: int) -> torch.Tensor:
    """Labels that keep only the assistant reply: tokens after the last ``<|im_start|> assistant \\n``.

    Args:
        input_ids: ``[B, L]`` token ids.
        attention_mask: ``[B, L]`` 1 for real tokens.
        start_id: Id of ``<|im_start|>``.

    Returns:
        ``[B, L]`` long labels: ``input_ids`` on reply tokens, :data:`IGNORE` elsewhere.
    """
    import torch

    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    last_start = torch.where(input_ids == start_id, positions, -1).max(dim=1, keepdim=True).values  # [B, 1]
    keep = (positions >= last_start + 3) & attention_mask.bool()  # skip "<|im_start|>", "assistant", "\n"
    return torch.where(keep, input_ids, torch.full_like(input_ids, IGNORE))
