"""What the adapters' forwards and the pruning probe share: one lock per model (the probe switches a model's
attention and hooks its layers for one side pass, and no other forward of that model may run meanwhile), and the
probe's accumulator of attention paid to the visual tokens."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

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
