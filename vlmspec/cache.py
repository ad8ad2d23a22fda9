"""KV-cache surgery. The only module that touches transformers' cache internals.

vlmspec decodes under ``torch.inference_mode`` (the engine, the adapters' forwards), so a cache's tensors are
inference tensors; :func:`keep_tail`, which writes into them in place, runs under it too, whoever calls it.

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
from transformers.cache_utils import (
    Cache,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)

from .recurrent_cache import Checkpoint, RecurrentRows, TreeLinks, copied, tree_links


def cache_kwarg(module: torch.nn.Module, cache: Cache | None) -> dict[str, Any]:
    """The keyword a model's ``forward`` takes its cache by: ``cache`` (transformers >= 5.24, which deprecates
    ``past_key_values`` and drops it in 5.40) or ``past_key_values`` (earlier 5.x)."""
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty dynamic KV cache for ``model`` (text config decides the layer layout), every layer holding every
    entry: a model with sliding-window layers (Gemma 3's local layers) gets full layers too, since tree surgery
    moves entries in place, which a rolling window buffer would not allow; its adapter hides the keys outside the
    window with the attention mask instead."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    cache = DynamicCache(config=config)
    if "sliding_attention" not in (getattr(config, "layer_types", None) or ()):
        return cache
    if not has_recurrent_layers(cache):
        return DynamicCache()  # every layer a full one, made as the entries come
    # a hybrid model's recurrent layers are made from its config (LFM3's); its sliding-window layers full ones
    cache.layers = [
        DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in cache.layers
    ]
    return cache


def cache_length(cache: Cache) -> int:
    """Number of tokens held by the cache (all layers hold the same count)."""
    return cache.get_seq_length()


def _dynamic_layers(cache: Cache) -> list[DynamicLayer]:
    return _checked(list(getattr(cache, "layers", [])))


def _checked(layers: list[Any]) -> list[DynamicLayer]:
    for layer in layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"vlmspec can only compact full-attention dynamic caches, got a {type(layer).__name__} layer; "
                "sliding-window/static/quantized caches are not supported for tree verification, and a model with "
                "recurrent layers decodes on a KVStore row (decodable)"
            )
    return layers


def _layers_by_kind(
    cache: DynamicCache,
) -> tuple[list[tuple[int, DynamicLayer]], list[tuple[int, LinearAttentionLayer]]]:
    """A prefill cache's attention layers and its recurrent layers (Qwen3.5's Gated DeltaNet), with their indices."""
    recurrent = [
        (i, layer) for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionLayer)
    ]
    attention = [
        (i, layer) for i, layer in enumerate(cache.layers) if not isinstance(layer, LinearAttentionLayer)
    ]
    _checked([layer for _, layer in attention])
    return attention, recurrent


def has_recurrent_layers(cache: Cache) -> bool:
    """Whether ``cache`` holds recurrent layers' states (a hybrid model's: Qwen3.5)."""
    if isinstance(cache, RowCache | BatchCache):
        return cache.store.recurrent is not None
    return any(isinstance(layer, LinearAttentionLayer) for layer in getattr(cache, "layers", []))


def decodable(cache: Cache) -> Cache:
    """``cache`` as decoding forwards run on it: a prefill cache with recurrent layers moves into a store row of
    its own (their tree forwards and cut-backs live there, :mod:`vlmspec.recurrent_cache`); any other as it is."""
    if isinstance(cache, DynamicCache) and has_recurrent_layers(cache):
        return KVStore(1).add_row(cache)
    return cache


@torch.inference_mode()
def keep_tail(cache: Cache, start: int, keep: torch.Tensor) -> None:
    """Keep the first ``start`` entries plus the entries at ``keep``; drop everything else.

    Args:
        cache: a ``DynamicCache`` holding at least ``max(keep) + 1`` tokens.
        start: number of leading entries kept as they are.
        keep: ``[k]`` long, absolute cache indices ``>= start`` in ascending order; they become entries
            ``start .. start+k-1``.
    """
    if isinstance(cache, RowCache):
        cache.store.keep_row(cache.row, start, keep)
        return
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


def copy_cache(cache: Cache, length: int | None = None) -> DynamicCache:
    """A ``DynamicCache`` of its own holding ``cache``'s first ``length`` entries (all by default): a batch row's
    copied out of its :class:`KVStore`, a dynamic cache's cloned. A hybrid model's (recurrent layers) is copied
    whole only: its recurrent states cannot be cut back (:func:`can_cut_back`)."""
    if has_recurrent_layers(cache):
        return _copy_hybrid(decodable(cache), length)
    copy = DynamicCache()
    if isinstance(cache, RowCache):
        entries = (layer_entries(cache, index) for index in cache.store.layers)
        layers = [(keys[:, :, :length], values[:, :, :length]) for keys, values in entries]
    else:
        layers = [(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in _initialized(cache)]
    for index, (keys, values) in enumerate(layers):
        copy.update(keys.clone(), values.clone(), index)
    return copy


def _copy_hybrid(cache: RowCache, length: int | None) -> DynamicCache:
    """:func:`copy_cache` of a hybrid model's row: its attention layers' entries, its recurrent layers' committed
    states as transformers' layers hold them (a prefill's cache, which a store row or ``extend`` takes)."""
    store, row = cache.store, cache.row
    if length not in (None, store.lengths[row]):
        raise ValueError(
            f"a hybrid model's cache of {store.lengths[row]} entries cannot be cut back to {length}"
        )
    recurrent = iter(store.recurrent.committed(row))
    copy = DynamicCache()
    copy.layers = [next(recurrent) if slot is None else DynamicLayer() for slot in store.slots]
    for index in store.layers:
        keys, values = layer_entries(cache, index)
        copy.layers[index].update(keys.clone(), values.clone())
    return copy


def checkpoint(cache: Cache) -> Checkpoint | None:
    """A hybrid model's recurrent states now (:class:`~vlmspec.recurrent_cache.Checkpoint`); ``None`` for any other
    cache (it can be cut back anywhere)."""
    if not has_recurrent_layers(cache):
        return None
    if isinstance(cache, RowCache):
        return Checkpoint(cache_length(cache), cache.store.recurrent.committed(cache.row))
    layers = [copied(layer) for layer in cache.layers if isinstance(layer, LinearAttentionLayer)]
    return Checkpoint(cache_length(cache), layers)


def restore(cache: Cache, saved: Checkpoint) -> DynamicCache:
    """A hybrid model's cache cut back to a :func:`checkpoint` taken on it: its first ``saved.length`` entries, the
    recurrent states then; a copy (``cache`` is left as it is)."""
    copy = copy_cache(cache)
    layers = iter(saved.layers)
    for index, layer in enumerate(copy.layers):
        if isinstance(layer, LinearAttentionLayer):  # a copy: the checkpoint may be restored again
            copy.layers[index] = copied(next(layers))
        else:
            layer.keys, layer.values = layer.keys[:, :, : saved.length], layer.values[:, :, : saved.length]
    return copy


def can_cut_back(cache: Cache, length: int) -> bool:
    """Whether ``cache`` can keep its first ``length`` entries alone: any cache but a hybrid model's (its recurrent
    states hold the whole sequence), which keeps what it has only."""
    return length >= cache_length(cache) or not has_recurrent_layers(cache)


def layer_entries(cache: Cache, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[1, H, L, D]`` of layer ``index`` of one request's cache (a dynamic cache, or a batch row:
    its own ``L`` entries), as views: a reader that must not change them (a Gemma 4 assistant reading the target's
    keys) gets them without a copy."""
    if isinstance(cache, RowCache):
        store, row = cache.store, cache.row
        keys, values = store.layer(index)
        end = store.lengths[row]
        return keys[row : row + 1, :, :end], values[row : row + 1, :, :end]
    layer = _dynamic_layers(cache)[index]
    return layer.keys, layer.values


def attention_prefix(cache: DynamicCache, index: int, length: int) -> DynamicCache:
    """A cache of its own holding attention layer ``index``'s first ``length`` entries of ``cache`` (views) and
    nothing else: that layer's keys before a position, for one layer run again over them (Qwen3.5's visual scores)."""
    layer = cache.layers[index]
    prefix = DynamicCache()
    prefix.update(layer.keys[:, :, :length], layer.values[:, :, :length], index)
    return prefix


def row_caches(cache: DynamicCache, lengths: list[int]) -> list[DynamicCache]:
    """A batch cache's rows as caches of their own (batch 1): row ``b``'s first ``lengths[b]`` entries, copied
    (a right-padded batch prefill's rows, each before its padding)."""
    layers = _initialized(cache)
    rows = []
    for row, length in enumerate(lengths):
        own = DynamicCache()
        for index, layer in enumerate(layers):
            own.update(layer.keys[row : row + 1, :, :length], layer.values[row : row + 1, :, :length], index)
        rows.append(own)
    return rows


def standalone(cache: Cache) -> DynamicCache:
    """``cache`` as a cache of its own, for a request that is done with it: a batch row's entries copied out of its
    store (the row goes to another request), a dynamic cache as it is."""
    return copy_cache(cache) if isinstance(cache, RowCache) else cache


def in_use(cache: Cache) -> bool:
    """Whether ``cache`` still holds its request's entries: a batch row its request has not given up yet (a
    dynamic cache always does)."""
    return not isinstance(cache, RowCache) or cache.row >= 0


def cache_nbytes(cache: Cache) -> int:
    """Memory ``cache``'s keys and values take (a batch row's: what a copy of it would), in bytes."""
    if isinstance(cache, RowCache):
        store = cache.store
        return sum(kv[:, :, 0, :, 0].nbytes for kv in store.groups) * store.lengths[cache.row]
    return sum(t.nbytes for layer in _initialized(cache) for t in (layer.keys, layer.values))


def _initialized(cache: Cache) -> list[DynamicLayer]:
    """The layers of a dynamic cache that hold entries (a layer holds none before its first forward)."""
    return [layer for layer in _dynamic_layers(cache) if layer.is_initialized]


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


class KVStore:
    """Preallocated keys/values of up to ``max_rows`` requests of one model, written in place.

    All layers' keys and values are one ``[2, layers, max_rows, H, capacity, D]`` tensor, so that a row's
    bookkeeping (keeping an accepted path, moving a row) is one gather and one copy for the whole model, not one
    per layer (on a GPU each is a kernel launch); a model whose layers differ in heads or head width (Gemma 4's
    global layers) gets one such tensor per kind of layer (:attr:`groups`). Row ``b`` holds its own ``lengths[b]``
    entries at ``0 .. lengths[b]-1``, with no holes: the rows of a batch are at different lengths (prompts of
    different sizes, different accepted paths every step), and each keeps its own. A forward over the live rows
    writes each row's new entries at that row's own offset (one scatter per layer, no concatenation of the whole
    cache) and attends over ``[:rows, :, :max(lengths) + n]`` under a per-row mask that hides everything past each
    row's own entries; what lies there (padding of shorter requests, entries given up by a verification) is never
    read. Live rows are kept at ``0 .. rows-1``: when a request leaves, the last row moves into its place, so a
    forward never gathers rows. A hybrid model's recurrent layers (Qwen3.5) keep no keys: their states are rows of
    :attr:`recurrent` (:class:`~vlmspec.recurrent_cache.RecurrentRows`), moved and kept with the keys.

    Args:
        max_rows: the most requests held at once (the batch size).
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        # per kind of layer (H, D): [2, layers, max_rows, H, capacity, D]
        self.groups: list[torch.Tensor] = []
        # per layer: its group and its index there (None: a recurrent layer)
        self.slots: list[tuple[int, int] | None] = []
        self.shapes: list[tuple[int, int]] = []  # per attention layer: (H, D)
        self.last_layer = -1  # the last attention layer: a forward's entries count once it has written
        self.recurrent: RecurrentRows | None = None  # a hybrid model's recurrent layers (Qwen3.5)
        self.lengths: list[int] = []  # entries of each live row
        self.views: list[RowCache] = []  # the cache handle of each live row

    @property
    def rows(self) -> int:
        """Live rows (requests) in the store."""
        return len(self.lengths)

    @property
    def layers(self) -> list[int]:
        """The attention layers' indices (the model's)."""
        return [index for index, slot in enumerate(self.slots) if slot is not None]

    @property
    def capacity(self) -> int:
        return self.groups[0].shape[4] if self.groups else 0

    @property
    def device(self) -> torch.device:
        return self.groups[0].device

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[max_rows, H, capacity, D]`` of one layer."""
        group, i = self.slots[index]
        return self.groups[group][0, i], self.groups[group][1, i]

    def add_row(self, prefill: DynamicCache) -> RowCache:
        """Copy a prefill's cache (batch 1) into a new row; returns the row's cache handle."""
        if self.rows >= self.max_rows:
            raise RuntimeError(f"KVStore: all {self.max_rows} rows are in use")
        attention, recurrent = _layers_by_kind(prefill)
        length = attention[0][1].keys.shape[2]
        # (H, D) of each attention layer
        shapes = [(layer.keys.shape[1], layer.keys.shape[3]) for _, layer in attention]
        if not self.groups:
            self._allocate(attention[0][1].keys, shapes, length, [i for i, _ in recurrent])
        elif shapes != self.shapes:
            raise ValueError(
                f"KVStore: a prefill cache of layers (heads, width) {shapes} does not fit this store"
            )
        self.reserve(length)
        row = self.rows
        for index, layer in attention:  # the row's entries, copied layer by layer (no stacking)
            keys, values = self.layer(index)
            keys[row, :, :length] = layer.keys[0]
            values[row, :, :length] = layer.values[0]
        if self.recurrent is not None:
            self.recurrent.add_row([layer for _, layer in recurrent], length)
        view = RowCache(self, row)
        self.lengths.append(length)
        self.views.append(view)
        return view

    def _allocate(
        self, like: torch.Tensor, shapes: list[tuple[int, int]], length: int, recurrent: list[int]
    ) -> None:
        """The groups of a store for attention layers of ``shapes`` (``like``: a tensor of their dtype and device)
        and the model's ``recurrent`` layers (their indices)."""
        kinds = list(dict.fromkeys(shapes))
        self.shapes = shapes
        slots = iter([(kinds.index(shape), shapes[:i].count(shape)) for i, shape in enumerate(shapes)])
        self.slots = [
            None if index in recurrent else next(slots) for index in range(len(shapes) + len(recurrent))
        ]
        self.last_layer = max(self.layers)
        self.recurrent = RecurrentRows(self.max_rows, recurrent) if recurrent else None
        self.groups = [
            like.new_zeros(2, shapes.count((heads, dim)), self.max_rows, heads, length + _SPARE, dim)
            for heads, dim in kinds
        ]

    def remove_row(self, view: RowCache) -> None:
        """Free a request's row; the last live row moves into its place."""
        row, last = view.row, self.rows - 1
        if row != last:
            length = self.lengths[last]
            for kv in self.groups:
                kv[:, :, row, :, :length] = kv[:, :, last, :, :length]
            self.lengths[row] = length
            self.views[row] = self.views[last]
            self.views[row].row = row
        if self.recurrent is not None:
            self.recurrent.remove_row(row)
        self.lengths.pop()
        self.views.pop()
        view.row = -1

    def reserve(self, size: int) -> None:
        """Make room for ``size`` entries per row (capacity doubles, so growing is rare)."""
        if size <= self.capacity:
            return
        capacity = max(size + _SPARE, 2 * self.capacity)
        for group, old in enumerate(self.groups):
            grown = old.new_zeros(*old.shape[:4], capacity, old.shape[5])
            grown[:, :, :, :, : old.shape[4]] = old
            self.groups[group] = grown

    def keep_row(self, row: int, start: int, keep: torch.Tensor) -> None:
        """:func:`keep_tail` for one row: entries ``keep`` (ascending, ``>= start``) move to ``start ..``."""
        k = keep.shape[0]
        for kv in self.groups:
            kv[:, :, row, :, start : start + k] = kv[:, :, row].index_select(3, keep)
        if self.recurrent is not None:
            self.recurrent.keep_row(row, start, keep)
        self.lengths[row] = start + k


_SPARE = 256  # entries allocated past a row's need, so that decoding rarely grows the store


class RowCache(Cache):
    """One request's view of a :class:`KVStore`: the cache a batch-1 forward of that request runs on.

    ``update`` writes the new entries at the row's own offset and returns the row's entries; the row's length
    grows once the last layer has written (as a ``DynamicCache``'s length grows with its first layer's).
    """

    def __init__(self, store: KVStore, row: int) -> None:
        super().__init__(layers=[])
        self.store = store
        self.row = row

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        store, row = self.store, self.row
        start, n = store.lengths[row], key_states.shape[2]  # key_states: [1, H, n, D]
        store.reserve(start + n)
        keys, values = store.layer(layer_idx)
        keys[row, :, start : start + n] = key_states[0]
        values[row, :, start : start + n] = value_states[0]
        if layer_idx == store.last_layer:
            store.lengths[row] = start + n
        return keys[row : row + 1, :, : start + n], values[row : row + 1, :, : start + n]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.store.lengths[self.row]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def crop(self, max_length: int) -> None:
        """Drop the last ``-max_length`` entries (transformers 5.x's negative count, as :func:`truncate` uses)."""
        store, row = self.store, self.row
        length = store.lengths[row] + min(max_length, 0)
        if store.recurrent is None:
            store.lengths[row] = length
        else:  # the state after the last entry kept becomes the recurrent layers' committed one
            store.keep_row(row, length, torch.zeros(0, dtype=torch.long, device=store.device))

    def tree_links(self, bias: torch.Tensor) -> TreeLinks:
        """The recurrent layers' :class:`~vlmspec.recurrent_cache.TreeLinks` of a forward under ``bias``."""
        store = self.store
        return tree_links(store.recurrent, [self.row], [store.lengths[self.row]], [bias.shape[2]], bias)


class BatchCache(Cache):
    """The live rows of a :class:`KVStore` as one batched cache, for one forward of ``n`` tokens per row.

    Args:
        store: the store.
        counts: per live row, how many of the forward's ``n`` tokens are real (the rest are padding; their entries
            land past the row's length and are never read).
    """

    def __init__(self, store: KVStore, counts: list[int]) -> None:
        super().__init__(layers=[])
        self.store = store
        self.counts = counts
        offsets = torch.tensor(store.lengths)  # [B], on the host
        # Pinned on a GPU machine: the copy then need not wait for the device's queue (no host sync).
        if store.device.type == "cuda":
            offsets = offsets.pin_memory()
        self._offsets = offsets.to(store.device, non_blocking=True)
        self._index: dict[tuple[int, int], torch.Tensor] = {}  # per (H, D): [B, H, n, D] scatter index

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        store = self.store
        rows, heads, n, dim = key_states.shape
        end = max(store.lengths) + n
        store.reserve(end)
        # Row b's n new entries go to lengths[b] .. lengths[b]+n-1: one scatter over the sequence axis (the index
        # is the same for every layer of a kind: built at the first).
        index = self._index.get((heads, dim))
        if index is None:
            slots = self._offsets[:, None] + torch.arange(n, device=self._offsets.device)  # [B, n]
            index = self._index[heads, dim] = slots[:, None, :, None].expand(rows, heads, n, dim)
        keys, values = (t[:rows] for t in store.layer(layer_idx))
        keys.scatter_(2, index, key_states)
        values.scatter_(2, index, value_states)
        if layer_idx == store.last_layer:
            store.lengths[:] = [length + c for length, c in zip(store.lengths, self.counts, strict=True)]
        return keys[:, :, :end], values[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.store.lengths)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def tree_links(self, bias: torch.Tensor) -> TreeLinks:
        """The recurrent layers' :class:`~vlmspec.recurrent_cache.TreeLinks` of a forward under ``bias``."""
        store = self.store
        return tree_links(store.recurrent, list(range(store.rows)), store.lengths, self.counts, bias)
