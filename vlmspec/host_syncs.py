"""Count the host syncs a piece of code makes: the calls that would stall a GPU until its queue drains.

On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``), producing a
tensor whose shape depends on its values (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``) or
copying to the CPU waits for every queued kernel. A decoding step needs a few (the accepted tokens must reach the
host; a tree's shape depends on the draft's probabilities); every other one costs a pipeline stall per step.

:class:`HostSyncCounter` is a ``TorchFunctionMode`` that counts those calls by name while it is active, on any
device (on the CPU nothing stalls, but the same code on a GPU would), so a test can bound them per step::

    with HostSyncCounter() as syncs:
        pipe(image, prompt, max_new_tokens=32)
    syncs.total, syncs.counts  # e.g. 97, {"tolist": 12, "nonzero": 40, ...}
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

SYNCING_METHODS: frozenset[str] = frozenset(
    {
        "item",
        "tolist",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "numpy",
        "cpu",
        "equal",
        "allclose",
    }
)
"""Functions/methods that read values on the host or make value-dependent shapes."""


class HostSyncCounter(TorchFunctionMode):
    """Counts host-syncing torch calls made inside the ``with`` block (see the module docstring).

    Attributes:
        counts: calls per function name (boolean-mask indexing counts as ``"__getitem__[mask]"``).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCING_METHODS:
            self.counts[name] += 1
        elif name in ("__getitem__", "__setitem__") and _has_mask(args[1] if len(args) > 1 else None):
            self.counts[f"{name}[mask]"] += 1
        return func(*args, **(kwargs or {}))


def _has_mask(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(torch.is_tensor(i) and i.dtype == torch.bool for i in items)
