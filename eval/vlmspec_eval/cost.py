"""Cost accounting: the forward-cost probe, ideal (overhead-free) speed-up, time per phase, and ``--budget auto``.

**Cost probe.** The library's harness (:mod:`vlmspec.probe`, the same that sizes the pipeline's trees and gives
PCT its ratio) inside ``pipe.kernels()``, after a realistic prefix (the prompt of a task input, prefilled once),
for every ``N`` in :data:`PROBE_SIZES`. The result is a :class:`vlmspec.costs.ForwardCosts` (envelope,
interpolation and the node budget are defined there); the bench installs it as ``pipe.costs``, so every policy's
automatic budget comes from it.

**Roofline.** Next to the measured ``c_t(N)`` the probe prints the target's physical limit on this machine:
``roof(N) = max(weight bytes / bandwidth, N * FLOPs per token / peak)``, where the weight bytes are the language
model's (embedding lookups aside: the decoder layers, final norm and LM head, all read once per forward), the FLOPs
per token ``2 *`` those weights plus the attention over the prefix (``4 * layers * prefix * heads * head_dim``),
and bandwidth and peak are measured here (:func:`measure_machine`: the best of a few large copies and of a few
square matmuls in the model's dtype). ``c_t(N) / roof(N)`` is how far the forward is from the hardware's limit.

**Ideal speed-up** (zero engine overhead, decode phase only, prefills excluded): every model forward a run made
after its prefills is priced at the probe's cost for its token count, so a step costs the draft forwards it made
(``sum c_d(n_i)``) plus the target verification ``c_t(N + 1)`` (``N`` nodes plus the root); AR pays ``c_t(1)``
per token. Over the run's target decode forwards::

    ideal_speedup = tokens_per_step * steps * c_t(1) / sum(probe cost of every decode forward)

which is 1 for ``ar``. The measured speed-up falls short of it by the engine overhead, the prefills and the
draft's own prefill.

**Time per phase** (SAGE Table 6) from the engine's timers and the forward hooks: target prefill, draft prefill,
draft forwards, tree building (drafting time outside draft forwards: the policy's logic), verification forward,
accept + cache update (verification time outside the target forward), other (the rest of the wall time).
**Overhead share** = (tree building + accept/update + other) / total: wall time outside model forwards and
prefills. :func:`probe_overhead_share` estimates the same from the probe instead of the timers.

**Budget auto** is :meth:`ForwardCosts.node_budget` (see :mod:`vlmspec.costs` for how and why).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vlmspec.costs import ForwardCosts
from vlmspec.models.base import config_value, layer_config
from vlmspec.probe import probe_costs, sync

from .bench_cli import PROBE_SIZES
from .methods import ForwardCall, RunRecord

PHASES: tuple[str, ...] = (
    "target_prefill", "draft_prefill", "draft_forward", "tree_build", "verify_forward", "accept_update", "other",
)  # fmt: skip
OVERHEAD_PHASES: tuple[str, ...] = ("tree_build", "accept_update", "other")


@dataclass(frozen=True)
class CostProbe(ForwardCosts):
    """:class:`ForwardCosts` after a task's prompt, with the task and the target's roofline on this machine.

    Attributes:
        task: task of the input whose prompt was the prefix.
        roofline: the target's roofline on this machine (see :class:`Roofline`), or ``None``.
    """

    task: str = ""
    roofline: Roofline | None = None

    def call_cost(self, call: ForwardCall) -> float:
        return self.target_cost(call.tokens) if call.role == "target" else self.draft_cost(call.tokens)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        target, draft = self.target_curve, self.draft_curve
        out["target_curve_s"] = target
        out["draft_curve_s"] = draft
        out["target_ratio"] = [t / target[0] for t in target]
        out["draft_ratio"] = [d / draft[0] for d in draft] if draft else None
        out["roofline_s"] = [self.roofline.seconds(n) for n in self.sizes] if self.roofline else None
        return out


@dataclass
class Roofline:
    """The target's physical limit per forward on this machine.

    Attributes:
        weight_bytes: bytes of the weights one decode forward reads (decoder layers, final norm, LM head).
        flops_per_token: ``2 * weights + 4 * layers * prefix * heads * head_dim``.
        bandwidth: measured memory bandwidth, bytes/s.
        peak_flops: measured matmul throughput in the model's dtype, FLOP/s.
    """

    weight_bytes: int
    flops_per_token: float
    bandwidth: float
    peak_flops: float

    def seconds(self, tokens: int) -> float:
        """``max(weight_bytes / bandwidth, tokens * flops_per_token / peak_flops)``."""
        return max(self.weight_bytes / self.bandwidth, tokens * self.flops_per_token / self.peak_flops)


def _best_seconds(fn: Any, device: torch.device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


@torch.inference_mode()
def measure_machine(device: torch.device, dtype: torch.dtype, repeats: int = 5) -> tuple[float, float]:
    """``(bandwidth bytes/s, peak FLOP/s)``: the best of ``repeats`` 256 MiB copies and square matmuls.

    The matmul side is 4096 on a GPU and 1024 on a CPU (a few hundred milliseconds either way).
    """
    numel = 64 * 2**20  # 256 MiB of float32, or 128 MiB of bf16
    a = torch.ones(numel, device=device, dtype=dtype)
    b = torch.empty_like(a)
    copy_s = _best_seconds(lambda: b.copy_(a), device, repeats)
    side = 4096 if device.type == "cuda" else 1024
    x = torch.ones(side, side, device=device, dtype=dtype)
    matmul_s = _best_seconds(lambda: x @ x, device, repeats)
    return 2 * a.numel() * a.element_size() / copy_s, 2 * side**3 / matmul_s


def target_roofline(model: torch.nn.Module, prefix_tokens: int, repeats: int = 5) -> Roofline:
    """The :class:`Roofline` of ``model`` (a VLM) after a ``prefix_tokens`` prompt, measured on its device."""
    text = model.config.get_text_config()
    decoder = [
        p for n, p in model.named_parameters()
        if ("language_model" in n or "lm_head" in n) and "embed_tokens" not in n
    ]  # fmt: skip
    weights = sum(p.numel() for p in decoder)
    widths = [config_value(layer_config(text, i), "head_dim") for i in range(text.num_hidden_layers)]
    width = text.hidden_size // text.num_attention_heads  # where a config names no head_dim
    attention = 4 * prefix_tokens * text.num_attention_heads * sum(w or width for w in widths)
    bandwidth, peak = measure_machine(decoder[0].device, decoder[0].dtype, repeats)
    return Roofline(
        weight_bytes=sum(p.numel() * p.element_size() for p in decoder),
        flops_per_token=2.0 * weights + attention,
        bandwidth=bandwidth,
        peak_flops=peak,
    )


def run_cost_probe(
    pipe: Any,
    inputs: dict[str, torch.Tensor],
    task: str,
    sizes: Sequence[int] = PROBE_SIZES,
    runs: int = 5,
    roofline: Roofline | None = None,
) -> CostProbe:
    """Probe the pipeline's target and (unpruned) draft after the prompt ``inputs``, in the engine's kernels;
    the target's roofline is measured unless given (a second probe of the same target reuses the first's)."""
    with pipe.kernels():
        costs = probe_costs(pipe.target, pipe.draft, inputs, sizes, runs)
    if roofline is None:
        roofline = target_roofline(pipe.target, costs.prefix_tokens)
    return CostProbe(**{**asdict(costs), "task": task, "roofline": roofline})


# ---- per-run accounting --------------------------------------------------------------------------------------
def decode_calls(record: RunRecord) -> list[ForwardCall]:
    """The run's model forwards after the prefills (cache not empty)."""
    return [c for c in record.calls if not c.prefill]


def ideal_terms(record: RunRecord, probe: CostProbe | None) -> tuple[float, float] | None:
    """``(AR cost of the tokens the decode steps emitted, probe cost of the decode forwards)``; ``None`` if unknown.

    Summing both terms over inputs and dividing gives the ideal speed-up (see the module docstring).
    """
    if probe is None or record.error is not None:
        return None
    calls = decode_calls(record)
    target_steps = sum(1 for c in calls if c.role == "target")
    if target_steps == 0:
        return None
    ar_cost = record.tokens_per_step * target_steps * probe.target_cost(1)
    return ar_cost, sum(probe.call_cost(c) for c in calls)


def phase_breakdown(record: RunRecord) -> dict[str, float]:
    """Seconds per phase of :data:`PHASES` (see the module docstring); they sum to ``record.total_s``."""
    calls = decode_calls(record)
    draft_fw = sum(c.seconds for c in calls if c.role == "draft")
    verify_fw = sum(c.seconds for c in calls if c.role == "target")
    if record.phases:  # the engine's own timers
        out = {
            "target_prefill": record.phases["prefill"],
            "draft_prefill": record.phases["draft_prefill"],
            "draft_forward": draft_fw,
            "tree_build": max(record.phases["draft"] - draft_fw, 0.0),
            "verify_forward": verify_fw,
            "accept_update": max(record.phases["verify"] - verify_fw, 0.0),
        }
    else:  # transformers' generate: only the forwards are known
        prefills = [c for c in record.calls if c.prefill]
        out = {
            "target_prefill": sum(c.seconds for c in prefills if c.role == "target"),
            "draft_prefill": sum(c.seconds for c in prefills if c.role == "draft"),
            "draft_forward": draft_fw,
            "tree_build": 0.0,
            "verify_forward": verify_fw,
            "accept_update": 0.0,
        }
    out["other"] = max(record.total_s - sum(out.values()), 0.0)
    return out


def overhead_share(record: RunRecord) -> float:
    """Measured share of the wall time spent outside model forwards and prefills."""
    phases = phase_breakdown(record)
    return sum(phases[p] for p in OVERHEAD_PHASES) / max(record.total_s, 1e-9)


def probe_overhead_share(record: RunRecord, probe: CostProbe | None) -> float | None:
    """The same share estimated from the probe: 1 - (prefills + probe cost of the decode forwards) / total."""
    terms = ideal_terms(record, probe)
    if terms is None:
        return None
    phases = phase_breakdown(record)
    busy = phases["target_prefill"] + phases["draft_prefill"] + terms[1]
    return max(1.0 - busy / max(record.total_s, 1e-9), 0.0)


def choose_budget(budget: int | str | None, factor: float, probe: CostProbe) -> tuple[int | None, str]:
    """The node budget the tree policies of a bench run with (``budget``: ``"auto"`` (within ``factor`` one-token
    forwards of ``probe``), a number or ``None`` (each policy's default)) and a sentence saying where it came from."""
    if budget == "auto":
        budget = probe.node_budget(factor)
        ratio = probe.target_cost(budget + 1) / probe.target_cost(1)
        return budget, (
            f"auto: {budget} nodes, the largest tree whose verification costs <= {factor:g}x a "
            f"one-token forward on this machine (c_t({budget + 1})/c_t(1) = {ratio:.2f}); depth "
            f"{probe.depth_budget(budget)} where a policy has one (vlmspec.costs)"
        )
    if budget is None:
        return None, "policy defaults (sage n_max 32, sage_paper n_max 64, static 63 paths)"
    return int(budget), f"{int(budget)} nodes (--budget), depths fitted to the probe"
