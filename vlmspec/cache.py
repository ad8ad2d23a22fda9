"""KV-cache surgery. The only module that touches transformers' cache internals.

After a verification step the cache holds ``start`` committed tokens followed by every tree node that was
fed to the model. Only the accepted path is kept: its entries are moved to ``start, start+1, ...`` and the
rest is dropped. Moving just the tail (an ``index_select`` over at most N tree slots, then a slice) costs
O(N) instead of O(cache length); a non-contiguous accepted path is handled the same way as a chain.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


def cache_kwarg(module: torch.nn.Module, cache: Cache | None) -> dict[str, Any]:
    """The keyword a model's ``forward`` takes its cache by: ``cache`` (transformers >= 5.24, which deprecates
    ``past_key_values`` and drops it in 5.40) or ``past_key_values`` (earlier 5.x)."""
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty dynamic KV cache for ``model`` (text config decides the layer layout)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return DynamicCache(config=config)


def cache_length(cache: Cache) -> int:
    """Number of tokens held by the cache (all layers hold the same count)."""
    return cache.get_seq_length()


def _dynamic_layers(cache: Cache) -> list[DynamicLayer]:
    layers = list(getattr(cache, "layers", []))
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"vlmspec can only compact full-attention dynamic caches, got a {type(layer).__name__} layer; "
                "sliding-window/static/quantized caches are not supported for tree verification"
            )
    return layers


def keep_tail(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep the first ``start`` entries plus the entries at ``keep``; drop everything else.

    Args:
        cache: a ``DynamicCache`` holding at least ``max(keep) + 1`` tokens.
        start: number of leading entries kept as they are.
        keep: ``[k]`` long, absolute cache indices ``>= start`` in ascending order; they become entries
            ``start .. start+k-1``.
    """
    k = keep.shape[0]
    for layer in _dynamic_layers(cache):
        if not layer.is_initialized:
            continue
        # keys/values: [B, H, S, D] -> gather the k kept tree entries, write them right after the prefix.
        moved_k = layer.keys.index_select(2, keep)
        moved_v = layer.values.index_select(2, keep)
        layer.keys[:, :, start : start + k] = moved_k
        layer.values[:, :, start : start + k] = moved_v
        layer.keys = layer.keys[:, :, : start + k]
        layer.values = layer.values[:, :, : start + k]


def truncate(cache: Cache, length: int) -> None:
    """Drop every entry at index ``>= length``."""
    extra = cache_length(cache) - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5.x: crop takes a negative count of tokens to remove


def pop_tail(cache: Cache, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Remove and return every layer's entries from index ``start`` on (``[B, H, S-start, D]`` keys/values)."""
    tail = []
    for layer in _dynamic_layers(cache):
        tail.append((layer.keys[:, :, start:].clone(), layer.values[:, :, start:].clone()))
        layer.keys = layer.keys[:, :, :start]
        layer.values = layer.values[:, :, :start]
    return tail


def push_tail(cache: Cache, tail: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Append entries taken by :func:`pop_tail` back after the current contents."""
    for layer, (keys, values) in zip(_dynamic_layers(cache), tail, strict=True):
        layer.keys = torch.cat([layer.keys, keys], dim=2)
        layer.values = torch.cat([layer.values, values], dim=2)
