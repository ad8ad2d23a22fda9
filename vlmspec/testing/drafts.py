"""Drafts of other kinds for the tiny pairs, built once and cached beside them: a pair's draft's language model on
its own (:func:`build_tiny_text_draft`), and a Gemma 4 assistant for the ``gemma4`` pair's target
(:func:`build_tiny_assistant`)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from filelock import FileLock

from .pairs import _build_base_tokenizer, _build_environment, _special_token_ids, build_tiny_pair
from .weights import perturb_draft_head

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel


# ---------------------------------------------------------------------------------------------
# A language-model draft: the tiny draft's language model on its own
# ---------------------------------------------------------------------------------------------
_LANGUAGE_MODEL_TYPES = {
    "qwen2_vl_text": "qwen2",
    "qwen2_5_vl_text": "qwen2",
    "qwen2": "qwen2",
    "qwen3_vl_text": "qwen3",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3_text",
    "llama": "llama",
    "cohere2": "cohere2",
}
"""The ``model_type`` of the language model a VLM's text config describes, as a model of its own."""


def language_model_of(vlm: PreTrainedModel) -> PreTrainedModel:
    """``vlm``'s language model as a ``*ForCausalLM`` of its series (Qwen2, Qwen3, Gemma 3 text, LLaMA), with ``vlm``'s
    weights: the same text predictions for a text-only prompt. M-RoPE becomes plain rotary positions, which it is
    for text tokens (their three position ids are equal)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = vlm.config.get_text_config()
    kind = _LANGUAGE_MODEL_TYPES[text.model_type]
    values = {k: v for k, v in text.to_dict().items() if k not in ("model_type", "architectures")}
    head, table = vlm.get_output_embeddings().weight, vlm.get_input_embeddings().weight
    values["tie_word_embeddings"] = head.data_ptr() == table.data_ptr()  # the fixtures' heads are their own
    if kind != "gemma3_text":  # one rotary table, without the M-RoPE sections
        rope = values.get("rope_parameters") or {}
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **values)).eval()
    prefix = "model.text_model." if hasattr(vlm.model, "text_model") else "model.language_model."  # SmolVLM's
    state = {
        ("model." + k[len(prefix) :] if k.startswith(prefix) else k): v
        for k, v in vlm.state_dict().items()
        if k.startswith(prefix) or k.startswith("lm_head.")
    }
    model.load_state_dict(state, strict=True)
    model.generation_config = vlm.generation_config
    return model


def build_tiny_text_draft(
    family: str, root: str | Path | None = None, seed: int = 0, base_vocabulary: bool = False
) -> Path:
    """A language-model draft for the tiny ``family`` pair's target: its draft's language model on its own
    (:func:`language_model_of`), saved with the pair's tokenizer into ``<pair folder>-text`` (built once, as
    :func:`build_tiny_pair` builds). Its replies to text-only prompts are the tiny draft's.

    ``base_vocabulary``: the language model as it was before the VLM's tokenizer added the family's special tokens
    (SmolLM2's 49152 rows under SmolVLM's 49280 tokens, Vicuna's 32000 under LLaVA-1.5's 32002): its table and
    tokenizer stop after the chat tokens (``<pair folder>-text-base``)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    pair = build_tiny_pair(family, root, seed)
    suffix = "-text-base" if base_vocabulary else "-text"

    def write(staging: Path) -> None:
        model = language_model_of(AutoModelForImageTextToText.from_pretrained(pair.draft))
        tokenizer = AutoTokenizer.from_pretrained(pair.target)
        if base_vocabulary:
            tokenizer = _build_base_tokenizer(family)
            model.resize_token_embeddings(len(tokenizer))  # the rows past the chat tokens dropped
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return build_once(pair.target.parent.with_name(pair.target.parent.name + suffix), write)


def build_once(folder: Path, write: Any) -> Path:
    """``folder``, written by ``write(staging folder)`` unless it holds a ``config.json`` already: once across
    processes (a lock), into a staging folder renamed into place when complete."""
    if (folder / "config.json").is_file():
        return folder
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        if not (folder / "config.json").is_file():
            staging = folder.with_name(f".{folder.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            with _build_environment():
                write(staging)
            staging.rename(folder)
    return folder


_BLOCK_GAIN = 0.2
"""The RMS a tiny assistant's attention and MLP blocks add to its residual stream (the token's embedding: 1)."""


def build_tiny_assistant(root: str | Path | None = None, seed: int = 0) -> Path:
    """A Gemma 4 assistant (``gemma4_assistant``) for the tiny ``gemma4`` pair's target, saved into
    ``<pair folder>-assistant`` (built once, as :func:`build_tiny_pair` builds): as wide as the target, one local and
    one global layer reading the keys of the target's last local and global layers.

    Its weights make it draft much of what the target says, the way the target's weights are shaped
    (:func:`~vlmspec.testing.weights.shape_weights`: the target mostly predicts a fixed successor of the current
    token): the input projection passes the token's embedding on (the state's half is dropped), the layers add a
    little of what they attend to (:data:`_BLOCK_GAIN`), and the head is the target's, perturbed as a tiny draft's is
    (:func:`~vlmspec.testing.weights.perturb_draft_head`), so that it agrees with the target often, not always."""
    pair = build_tiny_pair("gemma4", root, seed)

    def write(staging: Path) -> None:
        import torch
        from transformers import (
            AutoModelForImageTextToText,
            AutoTokenizer,
            Gemma4AssistantConfig,
            Gemma4AssistantForCausalLM,
        )

        target = AutoModelForImageTextToText.from_pretrained(pair.target).eval()
        text = target.config.get_text_config()
        values = {k: v for k, v in text.to_dict().items() if k not in ("per_layer_config", "architectures")}
        glob = text.per_layer_config[text.layer_types.index("full_attention")]
        values |= {
            "num_hidden_layers": 2,
            "layer_types": ["sliding_attention", "full_attention"],
            "num_kv_shared_layers": 0,  # the assistant's config makes every layer reuse the target's keys
            "global_head_dim": glob.head_dim,
            "num_global_key_value_heads": glob.num_key_value_heads,
            "hidden_size_per_layer_input": 0,
            "vocab_size_per_layer_input": 0,
            "final_logit_softcapping": None,
            "tie_word_embeddings": True,
        }
        config = Gemma4AssistantConfig(text_config=values, backbone_hidden_size=text.hidden_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 4)
            model = Gemma4AssistantForCausalLM(config).eval()
        width = text.hidden_size
        with torch.no_grad():
            model.pre_projection.weight.zero_()
            model.pre_projection.weight[:, :width] = torch.eye(width)
            model.post_projection.weight.copy_(torch.eye(width))
            model.lm_head.weight.copy_(target.get_output_embeddings().weight)
            for layer in model.model.layers:  # each block's (normed) output a small addition
                layer.post_attention_layernorm.weight.fill_(_BLOCK_GAIN)
                layer.post_feedforward_layernorm.weight.fill_(_BLOCK_GAIN)
        tokenizer = AutoTokenizer.from_pretrained(pair.target)
        perturb_draft_head(model, _special_token_ids(tokenizer, "gemma4"), seed)
        model.generation_config = target.generation_config
        model.generation_config.num_assistant_tokens = (
            4  # transformers' generate(assistant_model=...) reads it
        )
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return build_once(pair.target.parent.with_name(pair.target.parent.name + "-assistant"), write)
