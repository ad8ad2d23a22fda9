"""Where SAGE's trees lose tokens, and how well its signals predict acceptance: ``python -m vlmspec_eval.sage_study``.

The analysis of issue "A SAGE that wins" (item 3), on captions of the calibrated pair (``docs/sage_study.md``).
Each policy (``sage``, ``static`` and ``eagle2`` at the same node budget) decodes the same captions greedily; a
recorder wrapped around the policy instance (no library change) keeps, per verification step, the verified tree,
the draft's distribution at every expanded node and the accepted path. The figures:

1. **Accepted length per step** (histogram), and **why a step's accepted path ended**: at the tree's maximum depth
   (the tree was too shallow), at a leaf above it (a branch was too short), or at a node with children of which
   none was the target's token (the tree was too narrow; then the rank of the target's token in the draft's
   distribution at that node tells how much wider it had to be). Tau per bucket of the root's top-1 draft
   probability shows in which steps one policy gains over another.
2. **Entropy autocorrelation**: by token lag (0..8), the Pearson correlation of ``H_t`` and ``H_{t+k}`` pooled over
   captions, ``H_t`` the entropy (nats) of the draft's and of the target's next-token distribution at each generated
   position (teacher-forced, the draft unpruned); by verification-step lag (0..4), the same over per-step values of
   a run (the root's alpha, its entropy, the accepted length).
3. **Predictors of the accepted length**: Pearson and Spearman correlation of a step's accepted length with the
   previous step's root alpha (what SAGE shapes the tree with: its lookahead), with this step's root alpha and with
   this step's root top-1 probability (both known before the tree is grown).

"Root alpha" is SAGE's confidence (``confidence`` in ``vlmspec/policies/sage.py``: 1 - top-k entropy / log k,
k = 10) of the draft's distribution at the step's root.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlmspec import VLMSpecPipeline
from vlmspec.draft import DraftTree
from vlmspec.named_pairs import DEFAULT_PAIR
from vlmspec.policies import MC_SIM_7B_63, EAGLE2Config, SAGEConfig, TreePolicy, confidence, get_policy
from vlmspec.policies.base import truncate_paths
from vlmspec.tree import TokenTree

from .analysis import lagged_autocorrelation, pearson, token_entropies
from .report import fmt, table
from .tasks import load_inputs

BUDGET = 32
"""Draft nodes per tree for every policy (sage's default ``n_max``)."""

TOKEN_LAGS: tuple[int, ...] = tuple(range(9))
STEP_LAGS: tuple[int, ...] = tuple(range(5))
ENDS: tuple[str, ...] = ("max depth", "leaf", "narrow")
"""Where an accepted path ends: the tree's deepest level, a shallower leaf, a node whose children miss the target."""

RANK_BUCKETS: tuple[tuple[int, int], ...] = ((0, 0), (1, 1), (2, 3), (4, 9), (10, 1 << 30))
CONFIDENCE_BUCKETS: tuple[float, ...] = (0.0, 0.5, 0.8, 0.95, 1.0 + 1e-9)
"""Edges of the root top-1 probability buckets."""


def policies(budget: int = BUDGET) -> dict[str, TreePolicy]:
    """The compared policies at ``budget`` draft nodes: sage with the paper's Eq. 10-12 growth (``n_max``; the
    study asks how well its lookahead alpha predicts a step, the analysis that led to ``sage``'s growth by cost),
    static (the first ``budget`` paths of the Medusa/EAGLE tree, closed under prefixes) and eagle2
    (``total_tokens``).

    Every size option is given explicitly (sage's ``d_max`` and eagle2's ``depth`` at their config defaults), so
    no machine-dependent fitting of the options one leaves out changes the trees being compared.
    """
    return {
        "sage": get_policy("sage", growth="paper", n_max=budget, d_max=SAGEConfig().d_max),
        "static": get_policy("static", paths=truncate_paths(MC_SIM_7B_63, budget)),
        "eagle2": get_policy("eagle2", total_tokens=budget, depth=EAGLE2Config().depth),
    }


@dataclass(frozen=True)
class Step:
    """One verification step, as the recorder saw it.

    Attributes:
        caption: index of the input.
        accepted: draft tokens accepted (bonus excluded).
        tree_size, tree_depth: draft nodes verified and the tree's depth.
        end: one of :data:`ENDS`.
        miss_rank: for ``end == "narrow"``, the rank (0 = top-1) of the target's token in the draft's
            distribution at the node where the path ended; else ``None``.
        root_top1, root_entropy, root_alpha: the draft's distribution at the root: top-1 probability, entropy
            (nats) and SAGE's confidence.
        trace: the policy's ``trace()`` (sage: the ``alpha`` it shaped this tree with, ``depth``, ``width``, ...).
    """

    caption: int
    accepted: int
    tree_size: int
    tree_depth: int
    end: str
    miss_rank: int | None
    root_top1: float
    root_entropy: float
    root_alpha: float
    trace: dict[str, Any]


class Recorder:
    """Wraps a policy instance's ``build_tree`` and ``accept`` to record a :class:`Step` per verification."""

    def __init__(self, policy: TreePolicy, top_k: int = 10) -> None:
        self.policy, self.top_k = policy, top_k
        self.steps: list[Step] = []
        self.caption = 0
        # draft node id -> the draft's next-token distribution [V], for the step being built
        self._expanded: dict[int, torch.Tensor] = {}
        build, accept = policy.build_tree, policy.accept
        policy.build_tree = self._wrap_build(build)  # type: ignore[method-assign]
        policy.accept = self._wrap_accept(accept)  # type: ignore[method-assign]

    def _wrap_build(self, build: Callable[[DraftTree], TokenTree]) -> Callable[[DraftTree], TokenTree]:
        def build_tree(draft: DraftTree) -> TokenTree:
            self._expanded = {}
            next_probs = draft.next_probs

            def recorded(nodes: torch.Tensor) -> torch.Tensor:
                probs = next_probs(nodes)
                self._expanded.update(zip(nodes.tolist(), probs, strict=True))
                return probs

            draft.next_probs = recorded  # type: ignore[method-assign]
            return build(draft)

        return build_tree

    def _wrap_accept(self, accept: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(tree: TokenTree, logits: torch.Tensor, sampler: Any = None) -> Any:
            acc = accept(tree, logits, sampler)
            self.steps.append(self._step(tree, acc.path, int(acc.next_token)))
            return acc

        return recorded

    def _step(self, tree: TokenTree, path: torch.Tensor, next_token: int) -> Step:
        root = self._expanded[0].float()
        end = int(path[-1])
        accepted = path.shape[0] - 1
        has_children = bool((tree.parents == end).any())
        miss_rank = None
        if has_children:
            kind = "narrow"
            source = int(tree.source_ids[end]) if tree.source_ids is not None else end
            probs = self._expanded[source]
            miss_rank = int((probs > probs[next_token]).sum())
        else:
            kind = "max depth" if accepted == tree.max_depth else "leaf"
        entropy = float(-(root * root.clamp_min(1e-30).log()).sum())
        return Step(
            caption=self.caption,
            accepted=accepted,
            tree_size=tree.num_nodes,
            tree_depth=tree.max_depth,
            end=kind,
            miss_rank=miss_rank,
            root_top1=float(root.max()),
            root_entropy=entropy,
            root_alpha=float(confidence(root, self.top_k)),
            trace=self.policy.trace(),
        )


# ---- statistics ----------------------------------------------------------------------------------------------------
def ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks (0-based) with ties given their average rank."""
    _, inverse, counts = np.unique(np.asarray(values, dtype=float), return_inverse=True, return_counts=True)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return (starts + (counts - 1) / 2.0)[inverse]


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman rank correlation (Pearson of average ranks), ``None`` as :func:`pearson` gives it."""
    if len(x) < 3:
        return None
    return pearson(ranks(x).tolist(), ranks(y).tolist())


def per_caption(steps: Sequence[Step], value: Callable[[Step], float]) -> list[list[float]]:
    """``value`` of each step, one list per caption in step order (the series the step-lag figures use)."""
    series: dict[int, list[float]] = {}
    for s in steps:
        series.setdefault(s.caption, []).append(value(s))
    return list(series.values())


def previous_alpha_pairs(steps: Sequence[Step]) -> tuple[list[float], list[float]]:
    """(previous step's root alpha, this step's accepted length) for every step but each caption's first."""
    prev, acc = [], []
    for before, now in zip(steps, steps[1:], strict=False):
        if before.caption == now.caption:
            prev.append(before.root_alpha)
            acc.append(float(now.accepted))
    return prev, acc


# ---- tables -----------------------------------------------------------------------------------------------------------
def acceptance_table(runs: dict[str, list[Step]], max_len: int = 8) -> str:
    """Per policy: steps, tau, nodes and depth per step, the share of steps accepting 0..``max_len``+ tokens,
    and the share of steps ending at the tree's maximum depth / at a shallower leaf / at a too narrow node."""
    header = ["policy", "steps", "tau", "nodes/step", "depth/step"]
    header += [str(k) for k in range(max_len)] + [f"{max_len}+"] + list(ENDS)
    rows = []
    for name, steps in runs.items():
        n = max(len(steps), 1)
        hist = [sum(s.accepted == k for s in steps) / n for k in range(max_len)]
        hist.append(sum(s.accepted >= max_len for s in steps) / n)
        ends = [sum(s.end == e for s in steps) / n for e in ENDS]
        rows.append(
            [name, str(len(steps))]
            + [
                fmt(float(np.mean([getattr(s, a) for s in steps])))
                for a in ("accepted", "tree_size", "tree_depth")
            ]
            + [fmt(v) for v in hist + ends]
        )
    return table(header, rows)


def miss_table(runs: dict[str, list[Step]]) -> str:
    """Per policy, the narrow ends: their count, the mean depth where they happened (= accepted length) and the
    share by rank of the target's token in the draft's distribution at that node (0 = the draft's top-1)."""
    header = ["policy", "narrow ends", "mean depth"] + [
        f"rank {lo}" if lo == hi else (f"rank {lo}-{hi}" if hi < 1 << 30 else f"rank {lo}+")
        for lo, hi in RANK_BUCKETS
    ]
    rows = []
    for name, steps in runs.items():
        narrow = [s for s in steps if s.miss_rank is not None]
        n = max(len(narrow), 1)
        share = [sum(lo <= (s.miss_rank or 0) <= hi for s in narrow) / n for lo, hi in RANK_BUCKETS]
        depth = float(np.mean([s.accepted for s in narrow])) if narrow else None
        rows.append([name, str(len(narrow)), fmt(depth)] + [fmt(v) for v in share])
    return table(header, rows)


def confidence_table(runs: dict[str, list[Step]]) -> str:
    """Tau (nodes per step in brackets) of each policy in steps bucketed by the root's top-1 draft probability."""
    edges = CONFIDENCE_BUCKETS
    buckets = list(zip(edges, edges[1:], strict=False))
    header = ["policy"] + [f"top-1 {lo:.2f}-{min(hi, 1.0):.2f}" for lo, hi in buckets]
    rows = []
    for name, steps in runs.items():
        cells = []
        for lo, hi in buckets:
            inside = [s for s in steps if lo <= s.root_top1 < hi]
            if inside:
                tau = np.mean([s.accepted for s in inside])
                nodes = np.mean([s.tree_size for s in inside])
                cells.append(f"{tau:.2f} ({nodes:.0f}; {len(inside)} steps)")
            else:
                cells.append("-")
        rows.append([name, *cells])
    return table(header, rows)


def token_lag_table(entropies: dict[str, list[list[float]]], lags: Sequence[int] = TOKEN_LAGS) -> str:
    """Per model (rows): mean next-token entropy over the generated tokens and its autocorrelation per token lag."""
    rows = []
    for name, series in entropies.items():
        auto = lagged_autocorrelation(series, lags)
        mean = float(np.mean([v for s in series for v in s])) if any(series) else None
        rows.append([name, fmt(mean), *[fmt(auto[k]) for k in lags]])
    return table(["entropy of", "mean (nats)", *[f"lag {k}" for k in lags]], rows)


def step_lag_table(runs: dict[str, list[Step]], lags: Sequence[int] = STEP_LAGS) -> str:
    """Autocorrelation per verification-step lag of per-step series: the root's alpha, top-1 probability and
    entropy (the draft's, each policy's own steps) and the accepted length."""
    values: dict[str, Callable[[Step], float]] = {
        "root alpha": lambda s: s.root_alpha,
        "root top-1": lambda s: s.root_top1,
        "root entropy": lambda s: s.root_entropy,
        "accepted": lambda s: float(s.accepted),
    }
    rows = []
    for name, steps in runs.items():
        for label, value in values.items():
            auto = lagged_autocorrelation(per_caption(steps, value), lags)
            rows.append([name, label, *[fmt(auto[k]) for k in lags]])
    return table(["policy", "per-step value", *[f"lag {k}" for k in lags]], rows)


def predictor_table(runs: dict[str, list[Step]]) -> str:
    """Pearson / Spearman correlation of a step's accepted length with the previous step's root alpha (SAGE's
    lookahead signal; a caption's first step has none), this step's root alpha and this step's root top-1
    probability (the same steps for all three)."""
    header = ["policy", "steps", "previous root alpha", "this root alpha", "this root top-1"]
    rows = []
    for name, steps in runs.items():
        prev, acc = previous_alpha_pairs(steps)
        later = [now for before, now in zip(steps, steps[1:], strict=False) if before.caption == now.caption]
        cells = []
        for x in (prev, [s.root_alpha for s in later], [s.root_top1 for s in later]):
            cells.append(f"{fmt(pearson(x, acc))} / {fmt(spearman(x, acc))}")
        rows.append([name, str(len(acc)), *cells])
    return table(header, rows)


# ---- running -----------------------------------------------------------------------------------------------------------
@dataclass
class Study:
    """What one run measured: per policy its steps and outputs, and the teacher-forced entropies per model."""

    runs: dict[str, list[Step]]
    outputs: dict[str, list[list[int]]]
    entropies: dict[str, list[list[float]]]
    seconds: dict[str, float]


def run_study(
    pipe: VLMSpecPipeline, examples: Sequence[Any], max_new_tokens: int, budget: int = BUDGET
) -> Study:
    """Decode ``examples`` (``.image``, ``.video``, ``.prompt``) with each of :func:`policies` and measure.

    The token-lag entropies are taken along the ``sage`` output (all policies give the same, lossless, text).
    """
    saved = pipe.policy
    runs: dict[str, list[Step]] = {}
    outputs: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for name, policy in policies(budget).items():
        recorder = Recorder(policy)
        pipe.policy = policy
        outputs[name], seconds[name] = [], 0.0
        for i, ex in enumerate(examples):
            recorder.caption = i
            out = pipe(ex.image, ex.prompt, video=ex.video, max_new_tokens=max_new_tokens)
            outputs[name].append(out.token_ids)
            seconds[name] += out.stats.total_seconds
        runs[name] = recorder.steps
    pipe.policy = saved
    entropies: dict[str, list[list[float]]] = {"draft": [], "target": []}
    for ex, tokens in zip(examples, outputs["sage"], strict=True):
        inputs = pipe.prepare_inputs(ex.image, ex.prompt, ex.video)
        entropies["draft"].append(token_entropies(pipe.draft, inputs, tokens))
        entropies["target"].append(token_entropies(pipe.target, inputs, tokens))
    return Study(runs=runs, outputs=outputs, entropies=entropies, seconds=seconds)


def report(study: Study) -> str:
    """All tables of a study, in markdown."""
    same = all(out == study.outputs["sage"] for out in study.outputs.values())
    timing = ", ".join(f"{name} {s:.1f} s" for name, s in study.seconds.items())
    return "\n\n".join(
        [
            f"Outputs identical across policies: {same}; decoding time: {timing}.",
            "Accepted length per step (share of steps) and where the accepted path ended:\n\n"
            + acceptance_table(study.runs),
            "Narrow ends, by rank of the target's token among the draft's candidates at that node:\n\n"
            + miss_table(study.runs),
            "Tau by the root's top-1 draft probability (nodes/step; steps):\n\n"
            + confidence_table(study.runs),
            "Entropy autocorrelation by token lag (teacher-forced along the generated captions):\n\n"
            + token_lag_table(study.entropies),
            "Autocorrelation by verification-step lag:\n\n" + step_lag_table(study.runs),
            "Predicting a step's accepted length (Pearson / Spearman):\n\n" + predictor_table(study.runs),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=DEFAULT_PAIR, help=f"pair name (default {DEFAULT_PAIR})")
    parser.add_argument("--n", type=int, default=6, help="captions per task (image and video; default 6)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=BUDGET, help=f"draft nodes per tree (default {BUDGET})")
    parser.add_argument("--seed", type=int, default=200, help="input i of a task uses seed + i (default 200)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = VLMSpecPipeline.from_pretrained(args.pair)
    examples = load_inputs(["image_caption", "video_caption"], args.n, seed=args.seed)
    start = time.perf_counter()
    study = run_study(pipe, examples, args.max_new_tokens, args.budget)
    print(
        f"pair {args.pair}; {len(examples)} captions of {args.max_new_tokens} tokens; budget {args.budget} nodes; "
        f"{time.perf_counter() - start:.0f} s\n"
    )
    print(report(study))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
