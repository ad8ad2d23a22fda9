"""Compare SAGE configurations (and PCT, AR) on the calibrated testbed pair: ``python -m vlmspec_eval.sage_sweep``.

The figures behind ``sage``'s defaults (``docs/sage.md``). Each variant decodes the same captions (2 image and 2
video captions of the testbed, 128 tokens, greedy, in one process); the speed-up is over transformers' own
``generate()`` on the same inputs, measured first. Every variant's output is checked against it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from vlmspec import VLMSpecPipeline
from vlmspec.named_pairs import DEFAULT_PAIR
from vlmspec.policies import get_policy

from .tasks import load_inputs

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ar": ("ar", {}),
    "static": ("static", {}),
    "eagle2": ("eagle2", {}),
    "pct": ("pct", {}),
    "sage_paper": ("sage_paper", {}),
    "sage, Eq. 10-12 growth (vlmspec's ranges)": ("sage", {"growth": "paper"}),
    "sage, Eq. 10-12 growth, this step's root confidence": (
        "sage",
        {"growth": "paper", "confidence": "root"},
    ),
    "sage, cost growth, n32": ("sage", {"n_max": 32}),
    "sage (default: cost growth)": ("sage", {}),
}
"""Variant name -> (policy, options). Options left out (node budgets, depths) are fitted to the machine, as in a
pipeline: every variant runs at the same automatic budget unless it names its own."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=DEFAULT_PAIR, help=f"pair name (default {DEFAULT_PAIR})")
    parser.add_argument("--n", type=int, default=2, help="captions per task (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = VLMSpecPipeline.from_pretrained(args.pair)
    examples = load_inputs(["image_caption", "video_caption"], args.n, seed=200, source="testbed")
    prepared = [(ex, pipe.prepare_inputs(ex.image, ex.prompt, ex.video)) for ex in examples]
    start = time.perf_counter()
    references = [pipe.reference_generate(inputs, args.max_new_tokens) for _, inputs in prepared]
    baseline = time.perf_counter() - start
    costs = pipe.hardware_costs()
    print(
        f"pair {args.pair}; {len(examples)} captions of {args.max_new_tokens} tokens; generate() {baseline:.1f} s; "
        f"automatic node budget {costs.node_budget(pipe.budget_factor)}, "
        f"depth {costs.depth_budget(costs.node_budget(pipe.budget_factor))}"
    )
    print(
        "| variant | speed-up over generate() | tau | nodes/step | identical |\n| --- | --- | --- | --- | --- |"
    )
    for name, (policy, options) in VARIANTS.items():
        pipe.policy = get_policy(policy, **options)
        seconds, taus, nodes, identical = 0.0, [], [], True
        for (ex, _), reference in zip(prepared, references, strict=True):
            out = pipe(ex.image, ex.prompt, video=ex.video, max_new_tokens=args.max_new_tokens)
            seconds += out.stats.total_seconds
            taus.append(out.stats.mean_accepted)
            nodes.append(sum(out.stats.tree_sizes) / max(len(out.stats.tree_sizes), 1))
            identical &= out.token_ids == reference
        mean = sum(taus) / len(taus)
        print(
            f"| {name} | {baseline / seconds:.2f}x | {mean:.2f} | {sum(nodes) / len(nodes):.1f} | {identical} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
