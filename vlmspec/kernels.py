"""The kernels decoding runs on: CPU matrix products for a few rows, and GPU attention without per-shape plans.

A tree of ``N`` nodes is verified by one target forward over ``N + 1`` tokens, so every linear layer multiplies an
``[N + 1, K]`` activation by its ``[K, M]`` weight. On the CPU, torch's default (MKL's ``sgemm``) handles one row
as a memory-bound vector product but a few rows far below the machine's limit: measured on a 2-core AMD EPYC
(AVX2), one 1024 x 2816 fp32 ``F.linear`` took 0.34 ms for one row and 2.63 ms for four (9 GFLOP/s, about 5% of the
cores' peak), where oneDNN took 0.98 ms for four rows and 1.11 ms for eight (``docs/calibration.md``, "the small-M
GEMM wall"). That gap decides whether a tree can repay its verification at all.

:func:`onednn_linears` routes the fp32 CPU ``nn.Linear`` layers of models through oneDNN
(``torch.ops.mkldnn._linear_pointwise`` on the layer's own dense weight and dense activations: no copy, no packing,
no extra memory, no layout conversion) for the duration of a ``with`` block, for layers of at least
:data:`MIN_WEIGHT_ELEMENTS` weights and inputs of two rows or more (one row is MKL's memory-bound vector product),
then restores them. Nothing is left on
the model: outside the block (e.g. in transformers' ``generate()``, the bench's ``hf_generate`` baseline) the
layers are torch's own. The engine's ``ar`` runs inside the same block, so speed-ups over ``ar`` stay the
speculation's own.

Blocks may overlap, nested in one thread or open in several at once (two calls decoding in two threads, on one
pipeline or on two that share a model): the layers are shared, so a process-wide count of the open blocks holding
each layer reroutes it on the first block's entry and restores it on the last one's exit. Were the first block to
leave restoring them, the others would finish on torch's kernels: the same layers (the rerouted forward reads the
layer's own dense weight, nothing is prepacked), but slower than the costs their trees were sized by, and a cost
probe running then would store torch's timings as oneDNN's (:func:`vlmspec.probe.cached_costs`). While any block
is open, every caller of those layers runs oneDNN, a ``generate()`` in another thread included.

Exactness: oneDNN sums in another order than MKL, so logits differ in the last bits (a few 1e-6 relative), as they
already differ between a one-row and a many-row product of either library; greedy output stays the target's
wherever no two logits tie to that precision (``tests/test_kernels.py`` checks it against ``generate()`` on a
calibrated pair, whose 1024-wide target is rerouted; the tiny test fixtures are below the size threshold).

GPU models, other dtypes, quantized weights (torchao's tensor subclasses, which report the dtype they stand for)
and torch builds without oneDNN are left as they are.

**Attention on a GPU** (:func:`without_cudnn_attention`). Every decoding forward passes an additive mask (a tree's,
or one token's), and on Hopper GPUs torch's ``scaled_dot_product_attention`` then picks cuDNN's backend, which
builds an execution plan for each new combination of query and key lengths. Speculative decoding makes a new one at
nearly every forward: the keys grow by each step's accepted tokens, and a tree's levels and verifications vary in
size. Measured on an H200 (``docs/gpu.md``, 2026-11-30): the same EDD-drafted caption ran about 3x slower the first
time than when repeated over the same shapes (a chain's draft level 30 ms against 2 ms); the cost probe, which
repeats its shapes, saw the fast figure and sized the trees by it. MLX measured the same with its own cuDNN plans,
about 22 ms per plan in a verify loop, and routes small masked blocks around cuDNN. So inside a decoding block
SDPA's cuDNN backend is off (memory-efficient attention takes masked calls: no plan, the same maths), for the whole
process while any block is open, like the layers above, and restored when the last one closes. The choice is
unmeasured end to end on a GPU so far: ``VLMSpecPipeline.cudnn_attention = True`` (or ``VLMSPEC_CUDNN_ATTENTION=1``)
keeps torch's own choice, for the comparison. On the CPU the switch does nothing.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator

import torch

from .errors import InvalidInputError

_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
"""Dense in, dense out. ``torch._C._nn.mkldnn_linear``, used before, needs its input converted to oneDNN's layout
and its output back: the same products bit for bit, but the two conversions cost 20 us per call on few rows and
0.75 ms on 128 rows of a 1024 x 2816 layer (1.57 ms against 2.33 ms), measured on this project's 2-core CPU."""
MIN_WEIGHT_ELEMENTS = 1 << 20
"""Smaller layers keep torch's kernel: oneDNN's fixed cost per call (about 40 us here) outweighs its gain on a
weight below ~4 MB (the testbed draft's forward went from 1.6 ms to 5.7 ms with every layer rerouted)."""
_HOLDERS: dict[torch.nn.Linear, int] = {}
"""The layers rerouted now, each with the number of open blocks holding it (removed at 0: nothing kept after)."""
ENV_CUDNN_ATTENTION = "VLMSPEC_CUDNN_ATTENTION"
_CUDNN_OFF: list[bool] = []
"""One entry per open :func:`without_cudnn_attention` block: the cuDNN setting before the first one opened."""
_HOLDERS_GUARD = threading.RLock()
"""Reentrant: the garbage collector may close an abandoned ``pipe.batch_iter`` generator, releasing its block, in
the middle of another block's entry or exit in the same thread."""


def onednn_available() -> bool:
    """Whether this torch build can run fp32 linear layers through oneDNN."""
    return _ONEDNN_LINEAR is not None and torch.backends.mkldnn.is_available()


def _onednn_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.numel() == x.shape[-1]:  # one row: MKL's vector product is already memory-bound
        return torch.nn.functional.linear(x, layer.weight, layer.bias)
    return _ONEDNN_LINEAR(x, layer.weight, layer.bias, "none", [], "")  # [..., K] -> [..., M]


def _eligible(layer: torch.nn.Module) -> bool:
    return (
        type(layer) is torch.nn.Linear
        and type(layer.weight.data) is torch.Tensor  # dense: not a quantized tensor subclass (torchao's)
        and layer.weight.device.type == "cpu"
        and layer.weight.dtype == torch.float32
        and layer.weight.numel() >= MIN_WEIGHT_ELEMENTS
    )


@contextlib.contextmanager
def onednn_linears(*models: torch.nn.Module | None) -> Iterator[int]:
    """Run the fp32 CPU ``nn.Linear`` layers of ``models`` through oneDNN inside the block.

    Args:
        models: modules (``None`` entries are skipped).

    Yields:
        The number of layers that run through oneDNN inside the block, whether this block or another open one
        rerouted them (0 when oneDNN is unavailable or no layer is a large enough fp32 CPU ``nn.Linear``).
    """
    layers = _hold(models) if onednn_available() else []
    try:
        yield len(layers)
    finally:
        _release(layers)


def _hold(models: Iterable[torch.nn.Module | None]) -> list[torch.nn.Linear]:
    """Count one more block holding each eligible layer of ``models``, rerouting the layers no block held yet.

    A layer whose ``forward`` something else replaced (an instance attribute no block set) is left alone.
    """
    with _HOLDERS_GUARD:
        found = (m for model in models if model is not None for m in model.modules() if _eligible(m))
        layers = [m for m in dict.fromkeys(found) if m in _HOLDERS or "forward" not in vars(m)]
        for layer in layers:
            if layer not in _HOLDERS:
                layer.forward = lambda x, layer=layer: _onednn_forward(layer, x)
            _HOLDERS[layer] = _HOLDERS.get(layer, 0) + 1
        return layers


def _release(layers: list[torch.nn.Linear]) -> None:
    """Count one block fewer holding each of ``layers``; the last one out restores torch's forward."""
    with _HOLDERS_GUARD:
        for layer in layers:
            _HOLDERS[layer] -= 1
            if _HOLDERS[layer] == 0:
                del _HOLDERS[layer]
                vars(layer).pop("forward", None)


@contextlib.contextmanager
def without_cudnn_attention() -> Iterator[None]:
    """SDPA without cuDNN's backend inside the block (module docstring), whatever other blocks are open."""
    with _HOLDERS_GUARD:
        _CUDNN_OFF.append(_CUDNN_OFF[0] if _CUDNN_OFF else torch.backends.cuda.cudnn_sdp_enabled())
        torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        with _HOLDERS_GUARD:
            before = _CUDNN_OFF.pop()
            if not _CUDNN_OFF:
                torch.backends.cuda.enable_cudnn_sdp(before)


def cudnn_attention_default() -> bool:
    """``VLMSPEC_CUDNN_ATTENTION``: ``1`` keeps SDPA's cuDNN backend while decoding, ``0`` or unset turns it off.

    Raises:
        InvalidInputError: another value.
    """
    value = os.environ.get(ENV_CUDNN_ATTENTION, "0")
    if value not in ("0", "1"):
        raise InvalidInputError(
            f"{ENV_CUDNN_ATTENTION}={value!r}: use 1 (torch's cuDNN attention) or 0 (off)"
        )
    return value == "1"


@contextlib.contextmanager
def decoding_kernels(*models: torch.nn.Module | None, onednn: bool, cudnn_attention: bool) -> Iterator[int]:
    """The block models decode in: :func:`onednn_linears` when ``onednn``, :func:`without_cudnn_attention` unless
    ``cudnn_attention``. Yields :func:`onednn_linears`' count (0 without it)."""
    with contextlib.ExitStack() as stack:
        if not cudnn_attention:
            stack.enter_context(without_cudnn_attention())
        yield stack.enter_context(onednn_linears(*models)) if onednn else 0


__all__ = [
    "ENV_CUDNN_ATTENTION",
    "MIN_WEIGHT_ELEMENTS",
    "cudnn_attention_default",
    "decoding_kernels",
    "onednn_available",
    "onednn_linears",
    "without_cudnn_attention",
]
