"""The cost probe: one harness timing the target's and the draft's forwards for ``N`` new tokens on this machine.

It serves every consumer of forward costs: the pipeline's hardware-aware tree budgets (measured when a pipeline
is built, cached on disk per machine + model shapes + dtype + kernels), PCT's ``s_d / s_t`` and the bench.

**How.** Each model gets a prefix in its KV cache: a real prompt (``inputs``: the bench's task input, prefilled
once) or ``context`` random text tokens (the pipeline's build-time probe: no processor or picture needed; a
forward's cost depends on the prefix's length, not on what it says). Then ``N`` new tokens go through the models'
own decoding path (:meth:`VLMAdapter.forward`) under a tree mask (a 4-ary tree: the mask's shape barely matters,
``N`` does), for every ``N`` in ``sizes``, and the cache is cut back after each call. Sizes and models are
interleaved within each round (target ``N``, draft ``N``, next size, ...) so that a load change on a shared
machine hits them alike; each cost is the median of ``runs`` rounds after ``warmup`` untimed ones. CUDA is
synchronised around each timed call. Run it in the context the models generate in (``pipe.kernels()``).

**Disturbed rounds.** Something else loading the machine (another job, a build, a test run) slows the forwards of
the rounds it overlaps, and a median over a few rounds can still land in it: one session's cached probe read
``c_t(1)`` at 10x its real cost and sized every later tree from that. Interference only ever slows a forward
down, so the fastest reading of each model and size is the reference: a round whose forwards ran, as a median,
more than :data:`DISTURBED_LOAD` times their fastest readings was disturbed and is left out
(:func:`calm_rounds`). The probe runs more rounds, up to :data:`MAX_ROUNDS_FACTOR` times ``runs``, until ``runs``
calm ones are in hand; if the machine stays busy it returns the calm rounds it has (the least disturbed one when
none is), marked unsettled (``ForwardCosts.settled``), and :func:`cached_costs` uses that reading without caching
it on disk, with a warning: the pipelines this process builds later for the same models reuse it (probing a busy
machine again would cost as much and read as noisily), and the next process measures again. A machine loaded evenly
through the whole probe is not detected (every round looks alike); its ratios ``c(N)/c(1)``, which the budgets use, suffer least from an even load.

**Cache.** :func:`cached_costs` keys the result by what decides it: the device (CPU model and thread count, or
GPU name), torch's version, each model's dtype, quantization and language-model shape (layers, widths, heads,
vocabulary), the kernels in use and the probe settings. The file is JSON under ``$VLMSPEC_CACHE/costs`` (default
``~/.cache/vlmspec/costs``); delete it to measure again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .cache import new_cache, truncate
from .costs import ForwardCosts
from .errors import InvalidInputError
from .inputs import on_device
from .models import DecodeState, VLMAdapter, adapter_for
from .models.base import config_value
from .quantization import quantization_description
from .tree import TokenTree, tree_attention_bias

BUILD_SIZES: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Token counts the pipeline probes when it is built (trees of up to 63 nodes)."""
BUILD_CONTEXT = 128
"""Random text tokens in the cache before the build-time probe's forwards (a short captioning prompt's length)."""
BUILD_RUNS = 3
DISTURBED_LOAD = 1.25
"""A round whose forwards took, as a median, more than this times their fastest readings was disturbed."""
MAX_ROUNDS_FACTOR = 3
"""The most timed rounds the probe runs to find ``runs`` calm ones: this times ``runs``."""
_PROBE_ARITY = 4
_SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


class _Prefixed:
    """One model with a prefix in its cache, ready to time ``N``-token tree forwards on top of it."""

    def __init__(self, adapter: VLMAdapter, inputs: dict[str, torch.Tensor] | None, context: int) -> None:
        self.adapter, device = adapter, adapter.device
        if adapter.mtp_draft:
            # a level of nodes reading the target's keys of the prompt's length, or `context`
            self.state = adapter.probe_state(
                int(inputs["input_ids"].shape[1]) if inputs is not None else context
            )
            self.past, self.position = 0, self.state.target.length
            self.text = _random_text(adapter.target, context + 1)
            return
        if inputs is not None and adapter.reads_target_layer is not None:
            # An EDD draft's prefix is the target's hidden states, one row per prompt token: time it on a prefix of
            # the prompt's length (what its forwards cost depends on that length, not on the rows' values).
            context, inputs = int(inputs["input_ids"].shape[1]), None
        if inputs is not None:
            inputs = on_device(inputs, device)
            self.state = adapter.prefill(inputs).state
            ids = inputs["input_ids"][0]
            text = ids[~adapter.prompt_layout(inputs).visual.to(ids.device)]
            self.position = int(ids.shape[0])
        else:
            text = _random_text(adapter, context + 1)
            rope_delta = torch.zeros((), dtype=torch.long, device=device)
            self.state = DecodeState(cache=new_cache(adapter.model), rope_delta=rope_delta, visual_tokens=0)
            causal = torch.ones(context, context, dtype=torch.bool, device=device).tril()
            bias = tree_attention_bias(causal, 0, adapter.dtype)
            adapter.forward(self.state, text[:context], torch.arange(context, device=device), bias)
            self.position = context
        self.past = self.state.length
        self.text = text

    def __call__(self, n: int) -> float:
        """Seconds of one ``n``-token tree forward on top of the prefix (the cache is cut back after it)."""
        tree = probe_tree(self.text.repeat(n // self.text.shape[0] + 1)[:n])
        bias = tree.attention_bias(self.past, self.adapter.dtype)
        positions = tree.positions(self.position)
        sync(self.adapter.device)
        start = time.perf_counter()
        self.adapter.forward(self.state, tree.tokens, positions, bias)
        sync(self.adapter.device)
        elapsed = time.perf_counter() - start
        truncate(self.state.cache, self.past)
        return elapsed


def _random_text(adapter: VLMAdapter, n: int) -> torch.Tensor:
    """``[n]`` random token ids, none of them an image or video placeholder."""
    vocab = adapter.model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0))
    for key in ("image_token_id", "video_token_id", "image_token_index", "video_token_index"):
        special = getattr(adapter.model.config, key, None)
        if special is not None:
            ids[ids == special] = 0
    return ids.to(adapter.device)


def probe_tree(tokens: torch.Tensor) -> TokenTree:
    """A breadth-first 4-ary tree over ``tokens`` (node ``i``'s parent is ``(i - 1) // 4``)."""
    n = tokens.shape[0]
    parents = torch.tensor([-1] + [(i - 1) // _PROBE_ARITY for i in range(1, n)], device=tokens.device)
    return TokenTree(tokens=tokens, parents=parents, draft_probs=torch.ones(n, device=tokens.device))


def check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """Sorted unique probe sizes starting at 1 (the AR cost every ratio is taken against).

    Raises:
        ValueError: a size below 1.
    """
    out = sorted({int(s) for s in sizes})
    if not out or out[0] < 1:
        raise InvalidInputError(f"probe sizes must be integers >= 1, got {list(sizes)}")
    return tuple(out if out[0] == 1 else [1, *out])


@torch.inference_mode()
def probe_costs(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    inputs: dict[str, torch.Tensor] | None = None,
    sizes: Sequence[int] = BUILD_SIZES,
    runs: int = BUILD_RUNS,
    context: int = BUILD_CONTEXT,
    warmup: int = 1,
    machine: str = "",
) -> ForwardCosts:
    """Measure :class:`ForwardCosts` of ``target`` and ``draft`` (see the module docstring).

    Args:
        target, draft: loaded VLMs (``draft`` may be ``None``).
        inputs: processor outputs of one prompt to prefill as the prefix; ``None``: ``context`` random tokens.
        sizes: token counts per forward (1 is added when missing).
        runs, warmup: timed and untimed rounds.
        context: prefix length without ``inputs``.
        machine: a description stored with the result.

    Raises:
        ValueError: sizes below 1, ``runs < 1``, ``warmup < 0`` or ``context < 1``.
    """
    sizes = check_sizes(sizes)
    if runs < 1 or warmup < 0 or context < 1:
        raise InvalidInputError(
            f"cost probe: need runs >= 1, warmup >= 0 and context >= 1; got runs={runs}, warmup={warmup}, "
            f"context={context}"
        )
    target_adapter = adapter_for(target)
    adapters = [target_adapter] + ([adapter_for(draft, target_adapter)] if draft is not None else [])
    models = [_Prefixed(adapter, inputs, context) for adapter in adapters]

    def timed_round() -> list[float]:  # [size 1: target, draft | size 2: target, draft | ...]
        return [model(n) for n in sizes for model in models]

    for _ in range(warmup):
        timed_round()
    rounds = [timed_round() for _ in range(runs)]
    while len(calm := calm_rounds(rounds)) < runs and len(rounds) < MAX_ROUNDS_FACTOR * runs:
        rounds.append(timed_round())
    used = calm or [min(rounds, key=_load(rounds))]  # none calm: the least disturbed round
    medians = [statistics.median(column) for column in zip(*used, strict=True)]  # per (size, model)
    per_model = [tuple(medians[i :: len(models)]) for i in range(len(models))]
    return ForwardCosts(
        sizes=sizes,
        target_s=per_model[0],
        draft_s=per_model[1] if draft is not None else None,
        prefix_tokens=models[0].past,
        runs=len(used),
        machine=machine,
        settled=len(calm) >= runs,
    )


def calm_rounds(rounds: Sequence[Sequence[float]], limit: float = DISTURBED_LOAD) -> list[Sequence[float]]:
    """The rounds nothing else on the machine disturbed (module docstring).

    Args:
        rounds: per round, the seconds of each timed forward, in the same order every round.
        limit: the most a calm round's forwards may take, as the median of each one's time over the fastest
            reading of the same forward in any round.
    """
    load = _load(rounds)
    return [r for r in rounds if load(r) <= limit]


def _load(rounds: Sequence[Sequence[float]]) -> Callable[[Sequence[float]], float]:
    """How much a round of ``rounds`` was slowed: the median of its forwards' times over their fastest readings."""
    fastest = [min(column) for column in zip(*rounds, strict=True)]
    return lambda r: statistics.median(t / f for t, f in zip(r, fastest, strict=True))


def measure_cost_ratio(
    target: torch.nn.Module,
    draft: torch.nn.Module,
    context: int = BUILD_CONTEXT,
    tokens: int = 1,
    warmup: int = 2,
    repeats: int = 7,
) -> float:
    """``s_d / s_t`` (PCT's cost ratio): a ``tokens``-token draft forward's time over the target's, after a
    ``context``-token prefix, the medians of ``repeats`` interleaved rounds (see :func:`probe_costs`)."""
    costs = probe_costs(target, draft, sizes=(1, tokens), runs=repeats, context=context, warmup=warmup)
    return costs.draft_cost(tokens) / costs.target_cost(tokens)


# ---- the on-disk cache ----------------------------------------------------------------------------------------
_BUSY_READINGS: dict[Path, ForwardCosts] = {}
"""Unsettled readings of this process, by the cache file a settled one would have gone to (:func:`cached_costs`)."""


def default_costs_dir() -> Path:
    """``$VLMSPEC_CACHE/costs`` or ``~/.cache/vlmspec/costs``."""
    root = os.environ.get("VLMSPEC_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "vlmspec") / "costs"


def machine_description(
    target: torch.nn.Module, draft: torch.nn.Module | None, kernels: str, settings: dict[str, Any]
) -> dict[str, Any]:
    """What decides a probe's result: device, torch, each model's dtype and shape, kernels and probe settings."""
    device = adapter_for(target).device
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{_cpu_name()} x{torch.get_num_threads()} threads"
    return {
        "device": where,
        "torch": torch.__version__,
        "models": [_model_shape(m) for m in (target, draft) if m is not None],
        "kernels": kernels,
        "settings": settings,
    }


def cached_costs(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    kernels: contextlib.AbstractContextManager[Any] | None = None,
    kernels_name: str = "default",
    folder: str | Path | None = None,
    sizes: Sequence[int] = BUILD_SIZES,
    runs: int = BUILD_RUNS,
    context: int = BUILD_CONTEXT,
) -> ForwardCosts:
    """The build-time probe of ``target`` and ``draft``, read from the cache when this machine measured it before.

    Args:
        kernels: the context the models generate in (entered for the measurement only).
        kernels_name: its name in the cache key (e.g. ``"onednn"``).
        folder: the cache folder (default :func:`default_costs_dir`).
    """
    settings = {"sizes": list(check_sizes(sizes)), "runs": runs, "context": context, "calm": DISTURBED_LOAD}
    description = machine_description(target, draft, kernels_name, settings)
    text = json.dumps(description, sort_keys=True)
    path = Path(folder) if folder is not None else default_costs_dir()
    path = path / f"{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"
    if path.is_file():
        try:
            return ForwardCosts.from_dict(json.loads(path.read_text()))
        except (ValueError, KeyError, TypeError):
            pass  # a damaged or older file: measure again and overwrite it
    if path in _BUSY_READINGS:
        return _BUSY_READINGS[path]
    with kernels if kernels is not None else contextlib.nullcontext():
        costs = probe_costs(target, draft, sizes=sizes, runs=runs, context=context, machine=text)
    if not costs.settled:
        warnings.warn(
            f"cost probe: the machine was busy while it timed the models ({costs.runs} of the {runs} rounds wanted "
            f"ran undisturbed); the tree budgets of this process's pipelines of these models use this reading, and "
            f"it is not saved, so the next process measures again",
            stacklevel=2,
        )
        _BUSY_READINGS[path] = costs
        return costs
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(costs.to_dict(), indent=1))
    scratch.replace(path)  # atomic: a concurrent reader sees the old file or the whole new one
    return costs


def _model_shape(model: torch.nn.Module) -> dict[str, Any]:
    text = model.config.get_text_config()
    shape = {key: config_value(text, key) for key in _SHAPE_KEYS}
    quantization = quantization_description(model)  # a quantized model costs another time per forward
    shape.update({"quantization": quantization} if quantization is not None else {})
    return {"type": model.config.model_type, "dtype": str(model.get_input_embeddings().weight.dtype), **shape}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a timer measures it; nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
