"""What a forward costs on this machine, and the tree budgets that follow from it (pure maths, no models).

:class:`ForwardCosts` holds the measured seconds of one target forward and one draft forward for ``N`` new tokens
(``N`` in ``sizes``, after a prompt; :mod:`vlmspec.probe` measures them). Everything that adapts to the hardware
reads them: the node budget and depth of every tree policy, PCT's ``s_d / s_t`` and the bench's ideal speed-up.

**Costs used.** A forward never gets cheaper with more tokens, so the costs used are the measured medians'
non-decreasing envelope (the cost at ``N`` is the smallest median at any size ``>= N``: upward noise spikes on a
shared machine go), interpolated linearly between probed sizes and extrapolated past the largest.

**Node budget** (:meth:`ForwardCosts.node_budget`): the largest ``B`` such that every probed verification of up
to ``B + 1`` tokens (the nodes plus the root) costs at most ``factor`` (default 2) one-token forwards. Why: a step
verifying ``B`` nodes costs ``r(B) = c_t(B + 1) / c_t(1)`` AR steps and emits ``tau + 1`` tokens, so it can only
pay when ``tau + 1 > r(B)`` plus the draft's share. Acceptance grows sub-linearly with the node count (extra nodes
go to ever less likely branches: EAGLE-2, Sequoia) while the cost grows linearly once the hardware is compute
bound, so the useful budget ends where the verification cost leaves its flat, memory-bound region. ``factor = 2``
says "a verification may cost at most two AR steps", which a draft with ``tau >= 1`` already repays, with room for
the draft's forwards. On a GPU the curve is flat to ~64 nodes and more; on a CPU it picks the smaller trees the
hardware affords (capped at :data:`MAX_NODE_BUDGET`, past which no policy here gains acceptance).

**Depth** (:meth:`ForwardCosts.depth_budget`): each level of a tree is one draft forward, so depth is paid in draft
time while it can only add accepted tokens as deep as the draft stays right. With a per-token acceptance ``a``
(default 0.8, the calibrated pairs' measured per-token rate along accepted paths is 0.75-0.8), a path of depth
``d`` yields ``E(d) = (1 - a^(d+1)) / (1 - a)`` tokens per step on average (the bonus token included), and a step
costs ``d * c_d(w) + c_t(B + 1)`` (``w = ceil(B / d)`` tokens per level). The depth is the ``d <= B`` that
maximises tokens per second, ``E(d) / cost(d)``: about 10 when the draft costs 1/24 of the target (the calibrated
pairs on a CPU), 2-3 when it costs half of it (the uncalibrated testbed pair), and deep trees on GPUs with small
drafts.

**Expected speed-up** (:meth:`ForwardCosts.expected_speedup`): the same expected tokens per second over plain
decoding's. Below 1 the draft costs too much of the target for any acceptance near the default to repay it (a
separate draft on a GPU in eager mode costs about one target forward); pipelines warn then
(:meth:`vlmspec.policies.TreePolicy.warn_if_slow`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .errors import InputTypeError, InvalidInputError

DEFAULT_BUDGET_FACTOR = 2.0
DEFAULT_ACCEPTANCE = 0.8
BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
"""The batch sizes :meth:`ForwardCosts.batch_size` chooses from."""
BATCH_RATE_SHARE = 0.9
"""A job's default batch size is the smallest reaching this share of the best expected throughput."""
MAX_NODE_BUDGET = 64
"""The most nodes an automatic budget gives (the papers' largest trees: SAGE's and WETAP's 64)."""


def check_budget_factor(factor: object, name: str = "budget factor") -> float:
    """``factor`` as a budget factor (the most a verification may cost, in one-token target forwards), refused
    unless it is a finite number >= 1 (NaN or infinity would size every tree at the largest budget).

    Raises:
        InputTypeError: not a number (``"2"``).
        InvalidInputError: NaN, infinite or below 1.
    """
    if not isinstance(factor, numbers.Real) or isinstance(factor, bool):
        raise InputTypeError(f"{name}={factor!r} is invalid: expected a number, got {type(factor).__name__}")
    if not math.isfinite(factor) or factor < 1:
        raise InvalidInputError(
            f"{name}={factor!r} is invalid: use a finite number >= 1 (a verification never costs less than one "
            "forward)"
        )
    return float(factor)


class BudgetFactor:
    """The descriptor of ``VLMSpecPipeline.budget_factor``: :func:`check_budget_factor` when it is set, so that a
    bad value is refused where it is assigned, not when a policy is next fitted."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.attribute = f"pipe.{name}", f"_{name}"

    def __get__(self, pipe: Any, owner: type | None = None) -> Any:
        return self if pipe is None else getattr(pipe, self.attribute, DEFAULT_BUDGET_FACTOR)

    def __set__(self, pipe: Any, value: object) -> None:
        setattr(pipe, self.attribute, check_budget_factor(value, self.name))


@dataclass(frozen=True)
class ForwardCosts:
    """Median seconds of one forward for ``N`` new tokens after a prompt, per model.

    Attributes:
        sizes: token counts probed, ascending, starting at 1 (a tree of ``N`` nodes verifies ``N + 1`` tokens).
        target_s: target seconds per forward, per size.
        draft_s: draft seconds per forward, per size (``None`` without a draft).
        prefix_tokens: tokens in the cache the forwards attended to.
        runs: timed rounds per size (the median is taken).
        machine: what was measured (device, dtype, models' shapes, kernels), as the cache key saw it.
        settled: whether the probe found ``runs`` rounds that nothing else on the machine disturbed
            (:func:`vlmspec.probe.calm_rounds`); an unsettled reading is used but never cached.
    """

    sizes: tuple[int, ...]
    target_s: tuple[float, ...]
    draft_s: tuple[float, ...] | None
    prefix_tokens: int
    runs: int
    machine: str = ""
    settled: bool = True

    def __post_init__(self) -> None:
        if not self.sizes or self.sizes[0] != 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise InvalidInputError(
                f"ForwardCosts.sizes={self.sizes} is invalid: ascending unique sizes starting at 1"
            )
        for name in ("target_s", "draft_s"):
            values = getattr(self, name)
            if values is not None and (len(values) != len(self.sizes) or min(values) <= 0):
                raise InvalidInputError(
                    f"ForwardCosts.{name} is invalid: one positive time per size, got {values}"
                )

    # ---- costs ------------------------------------------------------------------------------------------------
    @property
    def target_curve(self) -> list[float]:
        """The target costs used: the non-decreasing envelope of ``target_s``."""
        return monotone_envelope(self.target_s)

    @property
    def draft_curve(self) -> list[float] | None:
        return monotone_envelope(self.draft_s) if self.draft_s else None

    def target_cost(self, tokens: float) -> float:
        """``c_t(tokens)`` in seconds."""
        return interpolate(self.sizes, self.target_curve, tokens)

    def draft_cost(self, tokens: float) -> float:
        """``c_d(tokens)`` in seconds (0 without a draft)."""
        curve = self.draft_curve
        return interpolate(self.sizes, curve, tokens) if curve else 0.0

    @property
    def cost_ratio(self) -> float:
        """``s_d / s_t``: a one-token draft forward over a one-token target forward (PCT's ratio)."""
        return self.draft_cost(1) / self.target_cost(1)

    # ---- budgets ----------------------------------------------------------------------------------------------
    def node_budget(self, factor: float = DEFAULT_BUDGET_FACTOR, rows: int = 1) -> int:
        """The largest node budget whose verification (and every smaller probed one) costs ``<= factor * c_t(1)``.

        At least 1 and at most :data:`MAX_NODE_BUDGET`; see the module docstring for why. With ``rows`` requests
        verified together (batched decoding), the budget is per request and the rule is the batch's: ``rows``
        trees of ``B + 1`` tokens may cost at most ``factor`` batched AR steps, ``c_t(rows * (B + 1)) <= factor *
        c_t(rows)`` (a forward costs what its token count costs, whichever requests the tokens come from).
        """
        check_budget_factor(factor)
        if rows < 1:
            raise InvalidInputError(f"rows={rows} is invalid: a batch holds at least one request")
        base, budget = self.target_cost(rows), 1
        # Batch of one: the probed sizes themselves; a batch: every budget, its cost interpolated.
        tokens = self.sizes if rows == 1 else [rows * (n + 1) for n in range(1, MAX_NODE_BUDGET + 1)]
        for n in tokens:
            if n < 2 * rows:
                continue
            if self.target_cost(n) > factor * base:
                break
            budget = n // rows - 1
        return max(1, min(budget, MAX_NODE_BUDGET))

    def depth_budget(self, nodes: int, acceptance: float = DEFAULT_ACCEPTANCE, rows: int = 1) -> int:
        """The tree depth (``1..nodes``) with the most expected tokens per second; see the module docstring.

        ``rows`` requests decoding together share every forward: ``rows`` times the tokens per level and per
        verification.
        """
        if not 0 < acceptance < 1:
            raise InvalidInputError(f"acceptance={acceptance} is invalid: a per-token probability in (0, 1)")
        if nodes < 1:
            raise InvalidInputError(f"nodes={nodes} is invalid: use at least 1")
        return max(range(1, nodes + 1), key=lambda depth: self.step_rate(nodes, depth, acceptance, rows))

    def step_rate(
        self, nodes: int, depth: int, acceptance: float = DEFAULT_ACCEPTANCE, rows: int = 1
    ) -> float:
        """Expected tokens per second of ``rows`` requests, each with a tree of ``nodes`` nodes ``depth`` deep:
        ``rows * E(depth)`` tokens per step, a step costing ``depth`` draft forwards of ``rows * ceil(nodes /
        depth)`` tokens and one verification of ``rows * (nodes + 1)``. ``nodes = 0``: plain decoding."""
        if nodes == 0:
            return rows / self.target_cost(rows)
        tokens = (1 - acceptance ** (depth + 1)) / (1 - acceptance)
        draft = depth * self.draft_cost(rows * math.ceil(nodes / depth))
        return rows * tokens / (draft + self.target_cost(rows * (nodes + 1)))

    def expected_speedup(
        self, nodes: int, depth: int, acceptance: float = DEFAULT_ACCEPTANCE, rows: int = 1
    ) -> float:
        """:meth:`step_rate` of a tree of ``nodes`` nodes ``depth`` deep over plain decoding's: below 1, speculation
        is expected to be slower than plain decoding on this machine (the draft costs too much of the target)."""
        return self.step_rate(nodes, depth, acceptance, rows) / self.step_rate(0, 0, acceptance, rows)

    def tree_costs(self, nodes: int, rows: int = 1) -> tuple[float, float]:
        """What one more tree node and one more tree level cost a request, in plain decoding steps.

        Returns ``(node, level)``: ``node = (c_t(nodes + 1) - c_t(1)) / (nodes * c_t(1))``, the verification's mean
        cost per node over a budget of ``nodes``, in one request's plain steps; ``level = c_d(rows) / c_t(rows)``,
        one draft forward of the batch (one token a request, whatever a level's width) against one plain decoding
        step of it. The node is priced on one request's curve whatever ``rows``: a
        batched verification pads every request's tree to the batch's largest (:mod:`vlmspec.batching`), so a node
        costs nothing until its tree is the largest, and the batch's node budget (:meth:`node_budget` with
        ``rows``) already bounds that one. (Priced on the batch's own curve, 0.14 of a batched step at 8 requests
        on the calibrated CPU pair, ``sage`` kept so few nodes that it accepted 2.3 tokens a step where it accepts
        2.8 priced as here.) SAGE's growth by cost (:mod:`vlmspec.policies.sage`) keeps a node only where its
        chance of acceptance repays ``node`` and weighs every level's draft forward by ``level``.
        """
        if nodes < 1:
            raise InvalidInputError(f"nodes={nodes} is invalid: use at least 1")
        one = self.target_cost(1)
        node = (self.target_cost(nodes + 1) - one) / (nodes * one)
        return node, self.draft_cost(rows) / self.target_cost(rows)

    def batch_size(
        self,
        factor: float = DEFAULT_BUDGET_FACTOR,
        speculative: bool = True,
        choices: Sequence[int] = BATCH_SIZES,
        acceptance: float = DEFAULT_ACCEPTANCE,
    ) -> int:
        """The batch size a throughput job should use: the smallest of ``choices`` whose expected tokens per second
        (:meth:`step_rate` with that batch's own node budget and depth) reaches :data:`BATCH_RATE_SHARE` of the
        best one's. Past that point a larger batch buys little throughput for more latency and memory; where the
        forwards are flat (a GPU) throughput keeps rising with the batch, on a CPU it flattens once the batch's
        verifications are compute bound."""

        def rate(rows: int) -> float:
            if not speculative:
                return self.step_rate(0, 0, acceptance, rows)
            nodes = self.node_budget(factor, rows)
            return self.step_rate(nodes, self.depth_budget(nodes, acceptance, rows), acceptance, rows)

        rates = {rows: rate(rows) for rows in choices}
        best = max(rates.values())
        return min(rows for rows, r in rates.items() if r >= BATCH_RATE_SHARE * best)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ForwardCosts:
        draft = values.get("draft_s")
        return cls(
            sizes=tuple(int(n) for n in values["sizes"]),
            target_s=tuple(float(s) for s in values["target_s"]),
            draft_s=tuple(float(s) for s in draft) if draft is not None else None,
            prefix_tokens=int(values["prefix_tokens"]),
            runs=int(values["runs"]),
            machine=str(values.get("machine", "")),
            settled=bool(values.get("settled", True)),
        )


def monotone_envelope(values: Sequence[float]) -> list[float]:
    """``out[i] = min(values[i:])``: the largest non-decreasing curve under ``values``."""
    out = list(values)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


def interpolate(sizes: Sequence[int], values: Sequence[float], n: float) -> float:
    """Piecewise-linear ``values(n)``; linear extrapolation past the last size, clamped at the first."""
    if len(sizes) == 1 or n <= sizes[0]:
        return float(values[0])
    if n <= sizes[-1]:
        return float(np.interp(n, sizes, values))
    slope = (values[-1] - values[-2]) / (sizes[-1] - sizes[-2])
    return float(values[-1] + slope * (n - sizes[-1]))
