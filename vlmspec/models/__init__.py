"""Per-family adapters. ``adapter_for(model)`` picks one from ``model.config.model_type`` (an EDD draft gets the
:class:`~vlmspec.models.edd.EDDAdapter` of its target's family)."""

from __future__ import annotations

import torch

from ..errors import InvalidInputError
from .base import DecodeState, Prefill, PromptLayout, VLMAdapter
from .edd import EDDAdapter, EDDDraft
from .gemma3 import Gemma3Adapter
from .internvl import InternVLAdapter
from .llava import LlavaOnevisionAdapter
from .qwen import QwenVLAdapter

_ADAPTERS: dict[str, type[VLMAdapter]] = {
    model_type: cls
    for cls in (QwenVLAdapter, LlavaOnevisionAdapter, InternVLAdapter, Gemma3Adapter)
    for model_type in cls.model_types
}

SUPPORTED_MODEL_TYPES = tuple(sorted(_ADAPTERS))

_NATIVE_VERSIONS = {
    "internvl_chat": "OpenGVLab's InternVL checkpoints that run their own code (model_type 'internvl_chat') have "
    "transformers-native versions: load the '-hf' one (OpenGVLab/InternVL3-8B-hf, OpenGVLab/InternVL3_5-8B-HF)",
}


def adapter_for(model: torch.nn.Module) -> VLMAdapter:
    """The adapter for a loaded VLM.

    Raises:
        ValueError: the model's ``model_type`` is not a supported family.
    """
    if isinstance(model, EDDDraft):
        return EDDAdapter(model, _ADAPTERS[model.edd_config.target_model_type])
    model_type = getattr(model.config, "model_type", None)
    check_model_type(model_type)
    return _ADAPTERS[model_type](model)


def check_model_type(model_type: str | None, model: str = "") -> None:
    """Refuse a ``model_type`` no adapter takes (``model``: which model and where from, for the message).

    Raises:
        InvalidInputError: naming the model type, the supported ones and, where one exists, the checkpoint to use.
    """
    if model_type in _ADAPTERS:
        return
    native = _NATIVE_VERSIONS.get(model_type)
    raise InvalidInputError(
        f"{model + ': ' if model else ''}model_type {model_type!r} is not supported by vlmspec; supported families: "
        f"{', '.join(SUPPORTED_MODEL_TYPES)}" + (f". {native}" if native else "")
    )


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "DecodeState",
    "EDDAdapter",
    "EDDDraft",
    "Prefill",
    "PromptLayout",
    "VLMAdapter",
    "adapter_for",
    "check_model_type",
]
