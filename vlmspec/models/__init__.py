"""Per-family adapters. ``adapter_for(model)`` picks one from ``model.config.model_type`` (an EDD draft gets the
:class:`~vlmspec.models.edd.EDDAdapter` of its target's family)."""

from __future__ import annotations

import torch

from ..errors import InvalidInputError
from .aya_vision import AyaVisionAdapter
from .base import DecodeState, Prefill, PromptLayout, VLMAdapter
from .edd import EDDAdapter, EDDDraft
from .fast_vlm import FastVlmAdapter
from .gemma3 import Gemma3Adapter
from .gemma4 import Gemma4Adapter
from .gemma4_assistant import ASSISTANT_TYPES, Gemma4AssistantAdapter
from .glm import GlmVAdapter
from .internvl import InternVLAdapter
from .janus import DeepseekVLAdapter, DeepseekVLHybridAdapter, JanusAdapter
from .lfm2_vl import Lfm2VlAdapter
from .lfm3_vl import Lfm3VlAdapter
from .llava import LlavaAdapter, LlavaNextAdapter, LlavaNextVideoAdapter, LlavaOnevisionAdapter
from .minicpmv import MiniCPMV4_6Adapter, MiniCPMV4_7Adapter
from .mistral3 import Mistral3Adapter
from .ovis2 import Ovis2Adapter
from .perception_lm import PerceptionLMAdapter
from .qwen import QwenVLAdapter
from .qwen3_5 import Qwen3_5Adapter
from .smolvlm import Idefics3Adapter, SmolVLMAdapter
from .text import TEXT_DRAFT_TYPES, TextDraftAdapter
from .video_llama3 import VideoLlama3Adapter

_ADAPTERS: dict[str, type[VLMAdapter]] = {
    model_type: cls
    for cls in (
        QwenVLAdapter,
        Qwen3_5Adapter,
        LlavaOnevisionAdapter,
        LlavaAdapter,
        LlavaNextAdapter,
        LlavaNextVideoAdapter,
        InternVLAdapter,
        Gemma3Adapter,
        Gemma4Adapter,
        SmolVLMAdapter,
        Idefics3Adapter,
        Mistral3Adapter,
        GlmVAdapter,
        AyaVisionAdapter,
        Ovis2Adapter,
        PerceptionLMAdapter,
        JanusAdapter,
        DeepseekVLAdapter,
        DeepseekVLHybridAdapter,
        Lfm2VlAdapter,
        Lfm3VlAdapter,
        MiniCPMV4_6Adapter,
        MiniCPMV4_7Adapter,
        VideoLlama3Adapter,
        FastVlmAdapter,
    )
    for model_type in cls.model_types
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_ADAPTERS))

_NATIVE_VERSIONS = {  # model types vlmspec refuses, why and what to load instead
    "llava_llama": "the original LLaVA-1.5 checkpoints (model_type 'llava_llama', liuhaotian/llava-v1.5-7b) run their "
    "own code; load the transformers-native version (llava-hf/llava-1.5-7b-hf)",
    "videollama3_qwen2": "DAMO-NLP-SG's VideoLLaMA3 checkpoints run their own code (model_type 'videollama3_qwen2'); "
    "load a transformers-native conversion (lkhl/VideoLLaMA3-2B-Image-HF)",
    "internvl_chat": "OpenGVLab's InternVL checkpoints that run their own code (model_type 'internvl_chat') have "
    "transformers-native versions: load the '-hf' one (OpenGVLab/InternVL3-8B-hf, OpenGVLab/InternVL3_5-8B-HF)",
    "qwen4_exp": "its language model reads hashed n-grams of the tokens before each one and mixes several residual "
    "streams besides its recurrent layers, which vlmspec does not verify a tree through; transformers' generate() "
    "runs it",
}


def adapter_for(model: torch.nn.Module, target: VLMAdapter | None = None) -> VLMAdapter:
    """The adapter for a loaded VLM, or for a draft of ``target`` (the target's adapter): an EDD draft, or a
    language model (:class:`~vlmspec.models.text.TextDraftAdapter`).

    Raises:
        ValueError: the model's ``model_type`` is not a supported family, or it is a language model and no
            ``target`` is given (a language model only drafts).
    """
    if isinstance(model, EDDDraft):
        return EDDAdapter(model, _ADAPTERS[model.edd_config.target_model_type])
    model_type = getattr(model.config, "model_type", None)
    if model_type in (*TEXT_DRAFT_TYPES, *ASSISTANT_TYPES):
        if target is None:
            raise InvalidInputError(
                f"a {model_type!r} model reads no pictures: it can only draft for a VLM target (give it as the draft)"
            )
        drafter = Gemma4AssistantAdapter if model_type in ASSISTANT_TYPES else TextDraftAdapter
        return drafter(model, target)
    check_model_type(model_type)
    return _ADAPTERS[model_type](model)


def check_model_type(model_type: str | None, model: str = "", draft: bool = False) -> None:
    """Refuse a ``model_type`` no adapter takes (``model``: which model and where from, for the message; ``draft``:
    the model is a draft, which may also be a language model of :data:`TEXT_DRAFT_TYPES`).

    Raises:
        InvalidInputError: naming the model type, the supported ones and, where one exists, the checkpoint to use.
    """
    if model_type in _ADAPTERS or (draft and model_type in (*TEXT_DRAFT_TYPES, *ASSISTANT_TYPES)):
        return
    if model_type in TEXT_DRAFT_TYPES:
        raise InvalidInputError(
            f"{model + ': ' if model else ''}model_type {model_type!r} is a language model, which reads no pictures: "
            f"it can be the draft of a VLM target, not the target; supported targets: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    native = _NATIVE_VERSIONS.get(model_type)
    raise InvalidInputError(
        f"{model + ': ' if model else ''}model_type {model_type!r} is not supported by vlmspec; supported families: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}" + (f". {native}" if native else "")
    )


__all__ = [
    "ASSISTANT_TYPES",
    "SUPPORTED_MODEL_TYPES",
    "TEXT_DRAFT_TYPES",
    "DecodeState",
    "EDDAdapter",
    "EDDDraft",
    "Prefill",
    "PromptLayout",
    "TextDraftAdapter",
    "VLMAdapter",
    "adapter_for",
    "check_model_type",
]
