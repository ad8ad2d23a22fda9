"""Attention-guided scoring of the visual tokens (the draft's pruning probe), and what it shares with the
adapters' forwards: one lock per model (the probe switches a model's attention and hooks its layers for one side
pass, and no other forward of that model may run meanwhile), the probe's accumulator of attention paid to the
visual tokens, and the side pass itself (:func:`visual_scores`)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ..cache import pop_tail, push_tail, truncate
from ..tree import tree_attention_bias
from .data import DecodeState, PromptLayout

if TYPE_CHECKING:
    from .base import VLMAdapter

_MODEL_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: torch.nn.Module) -> threading.RLock:
    """The lock held around each forward of ``model`` that an adapter runs, and around the pruning probe (which
    switches the decoder to eager attention and hooks its layers for one side pass): calls from several threads on
    one pipeline take turns forward by forward, so no forward runs under another call's attention switch or hooks.
    """
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


class AttentionProbe:
    """Accumulates, per decoder layer, the attention ``[num_visual]`` paid to some key positions."""

    def __init__(self, key_idx: torch.Tensor) -> None:
        self.key_idx = key_idx
        self.total: torch.Tensor | None = None
        self.layers = 0

    def hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if weights is None:
            raise RuntimeError(
                f"{type(module).__name__} returned no attention weights under eager attention; visual scoring "
                "needs an attention layer that returns (output, weights)"
            )
        # weights: [1, H, m, keys] -> attention to the visual keys, mean over batch, heads and queries.
        paid = weights.index_select(-1, self.key_idx).float().mean(dim=(0, 1, 2))  # [num_visual]
        self.total = paid if self.total is None else self.total + paid
        self.layers += 1

    def scores(self) -> torch.Tensor:
        """``[num_visual]`` mean over the layers seen."""
        if self.total is None:
            raise RuntimeError("no attention layer ran inside the visual attention probe")
        return self.total / self.layers


def visual_scores(
    adapter: VLMAdapter,
    inputs: dict[str, torch.Tensor],
    layout: PromptLayout,
    position_ids: torch.Tensor | None,
    state: DecodeState,
) -> torch.Tensor | None:
    """Attention the text after the last visual token pays to each visual token: ``[num_visual]`` float32 (``None``
    when no text follows the last visual token).

    Re-runs that text (``m`` tokens, text only) under eager attention on top of ``adapter``'s cache ``state`` cut
    back to the visual prefix, with hooks reducing each layer's ``[1, H, m, keys]`` weights at once; the cache's own
    entries for those positions are set aside first and put back afterwards, so ``state`` ends unchanged.
    """
    device = adapter.device
    visual_idx, split = text_after_visual(layout, device)
    if split is None:
        return None
    length = layout.visual.shape[0]
    suffix = torch.arange(split, length, device=device)  # [m] text positions
    if position_ids is None:
        position_ids = torch.arange(length, device=device)[None]
    text = adapter.text_prompt(inputs["input_ids"][:, split:])  # inputs_embeds [1, m, D]
    causal = torch.ones(suffix.shape[0], suffix.shape[0], dtype=torch.bool, device=device).tril()
    bias = tree_attention_bias(causal, split, adapter.dtype)  # [1, 1, m, split + m]
    tail = pop_tail(state.cache, split)
    try:
        with visual_attention_probe(adapter.model, visual_idx) as probe:
            adapter._run_language_model(text, position_ids[..., suffix], state.cache, bias)
    finally:
        truncate(state.cache, split)
        push_tail(state.cache, tail)
    return probe.scores()


def text_after_visual(layout: PromptLayout, device: torch.device) -> tuple[torch.Tensor, int | None]:
    """``[num_visual]`` the visual positions and where the text after the last of them starts (``None``: no text
    follows it, or there is no visual token: nothing to score)."""
    visual_idx = layout.visual.nonzero().flatten().to(device)
    if visual_idx.numel() == 0 or int(visual_idx[-1]) == layout.visual.shape[0] - 1:
        return visual_idx, None
    return visual_idx, int(visual_idx[-1]) + 1


@contextmanager
def visual_attention_probe(model: torch.nn.Module, visual_idx: torch.Tensor) -> Iterator[AttentionProbe]:
    """Record the attention paid to ``visual_idx`` key positions during ``model``'s forwards inside the block.

    Attention weights only exist under eager attention, so the decoder is switched to ``"eager"`` with the
    public ``set_attn_implementation`` for the block and switched back afterwards; forward hooks on every
    decoder layer's ``self_attn`` reduce each layer's weights ``[1, H, m, keys]`` to ``[num_visual]`` right
    away (only one layer's weights are alive at a time) and are removed afterwards. The model is left exactly
    as it was; :func:`model_lock` keeps other threads' forwards of the model out of the block.
    """
    decoder = model.get_decoder()
    with model_lock(model):
        yield from _probe_layers(decoder, AttentionProbe(visual_idx))


def _probe_layers(decoder: torch.nn.Module, probe: AttentionProbe) -> Iterator[AttentionProbe]:
    """The probe's block, under the lock: eager attention and the layers' hooks, undone on exit."""
    previous = decoder.config._attn_implementation
    attending = [
        layer for layer in decoder.layers if hasattr(layer, "self_attn")
    ]  # not Qwen3.5's recurrent ones
    handles = [layer.self_attn.register_forward_hook(probe.hook) for layer in attending]
    try:
        if previous != "eager":
            decoder.set_attn_implementation("eager")
        yield probe
    finally:
        if decoder.config._attn_implementation != previous:
            decoder.set_attn_implementation(previous)
        for handle in handles:
            handle.remove()
