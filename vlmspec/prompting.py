"""How a pipeline turns a request into the target's processor inputs: a picture, pictures or a video and a prompt
(:meth:`PromptBuilder.prepare_inputs`), or a conversation (:meth:`PromptBuilder.prepare_messages`), through the
processor's chat template and the processor, run with the request's processor settings
(:mod:`vlmspec.processor_settings`). A video given to a model that reads pictures only reaches it as its frames'
pictures (:func:`~vlmspec.conversations.frames_as_pictures`), the pictures' settings applying to them. The draft
reads the same inputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .conversations import encode_chat, frames_as_pictures, normalize_messages
from .errors import InputTypeError, InvalidInputError
from .inputs import ImageInput, VideoInput, load_images, load_video, on_device
from .processor_settings import ProcessorSettingsAttribute, check_processor_kwargs


class PromptBuilder:
    """The prompt building of :class:`~vlmspec.VLMSpecPipeline` (a mixin: it reads the pipeline's ``processor`` and
    its target's adapter)."""

    mm_processor_kwargs = ProcessorSettingsAttribute()
    processor: Any
    target_adapter: Any

    def prepare_inputs(
        self,
        image: ImageInput | Sequence[ImageInput] | None,
        prompt: str,
        video: VideoInput | None = None,
        num_frames: int = 8,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Processor inputs (batch 1) for a chat turn with the images/video and the prompt (the processor's settings:
        :attr:`mm_processor_kwargs` under the call's).

        The same inputs are what ``target.generate(**inputs)`` takes, which is how the tests compare outputs.
        """
        if not isinstance(prompt, str):
            raise InputTypeError(f"prompt must be a string, got {type(prompt).__name__}")
        images = load_images(image)
        videos = [load_video(video, num_frames=num_frames)] if video is not None else []
        content: list[dict[str, Any]] = [{"type": "image"} for _ in images]
        content += [{"type": "video"} for _ in videos]
        content.append({"type": "text", "text": prompt})
        return self._encode(
            [{"role": "user", "content": content}], images, videos, settings=mm_processor_kwargs
        )

    def prepare_messages(
        self,
        messages: Sequence[dict],
        num_frames: int = 8,
        tools: Sequence[dict] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Processor inputs (batch 1) for a conversation in transformers' chat format (see
        :func:`vlmspec.conversations.normalize_messages`): system, user and assistant turns, images and videos in any
        turn. The same inputs as ``processor.apply_chat_template(messages, tokenize=True, return_dict=True,
        add_generation_prompt=True, tools=tools, **chat_template_kwargs)`` gives for the same media."""
        chat, images, videos = normalize_messages(messages, num_frames=num_frames)
        return self._encode(chat, images, videos, tools, chat_template_kwargs, mm_processor_kwargs)

    def check_mm_processor_kwargs(
        self, settings: Any, name: str = "mm_processor_kwargs", media: Sequence[str] = ("images", "videos")
    ) -> dict[str, Any]:
        """``settings`` checked against this pipeline's processor and its target's family (named ``name`` in the
        errors; ``media``: the kinds of media they are for; :func:`vlmspec.processor_settings.check_processor_kwargs`)."""
        fixed = type(self.target_adapter).fixed_processor_settings
        return check_processor_kwargs(self.processor, settings, name, fixed, media)

    def _encode(self, chat: list, images: list, videos: list, tools=None, kwargs=None, settings=None) -> dict:
        if videos and getattr(self.processor, "video_processor", None) is None:  # a model of pictures only
            chat, images, videos = *frames_as_pictures(chat, images, videos), []
        media = [kind for kind, items in (("images", images), ("videos", videos)) if items] or [
            "images",
            "videos",
        ]
        if images and videos and self.target_adapter.pictures_apart_from_videos:
            raise InvalidInputError(
                f"the prompt holds {len(images)} picture(s) and {len(videos)} video(s), but "
                f"{self.target_adapter.pictures_apart_from_videos}; ask about the pictures and the videos in separate "
                "conversations, or give the video's frames as pictures"
            )
        settings = {**self.mm_processor_kwargs, **self.check_mm_processor_kwargs(settings, media=media)}
        least = self.target_adapter.min_video_frames
        inputs = encode_chat(self.processor, chat, images, videos, least, tools, kwargs, settings)
        return on_device(inputs, self.target_adapter.device)
