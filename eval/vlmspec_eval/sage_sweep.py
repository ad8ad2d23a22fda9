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

from vlmspec import VLMSpecPipeline, testbed
from vlmspec.named_pairs import DEFAULT_PAIR
from vlmspec.policies import get_policy

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ar": ("ar", {}),
    "pct": ("pct", {}),
    "sage_paper": ("sage_paper", {}),
    "sage_paper theta 0.05": ("sage_paper", {"theta_scale": 0.05}),
    "sage d4-10 theta 0.05 n32": (
        "sage_paper",
        {"d_min": 4, "d_max": 10, "theta_scale": 0.05, "n_max": 32, "initial_paths": ()},
    ),
    "sage w1-4 d4-10 n24": (
        "sage_paper",
        {"w_min": 1, "w_max": 4, "d_min": 4, "d_max": 10, "n_max": 24, "initial_paths": ()},
    ),
    "sage w2-6 d4-10 n32": ("sage", {"theta_scale": 0.1}),
    "sage (default: w2-6 d4-10 theta 0.05 n32)": ("sage", {}),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default=DEFAULT_PAIR, help=f"pair name (default {DEFAULT_PAIR})")
    parser.add_argument("--n", type=int, default=2, help="captions per task (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = VLMSpecPipeline.from_pretrained(args.pair)
    examples = [
        testbed.sample(task, 200 + i) for task in ("image_caption", "video_caption") for i in range(args.n)
    ]
    prepared = [(ex, pipe.prepare_inputs(ex.image, ex.prompt, ex.video)) for ex in examples]
    start = time.perf_counter()
    references = [pipe.reference_generate(inputs, args.max_new_tokens) for _, inputs in prepared]
    baseline = time.perf_counter() - start
    print(
        f"pair {args.pair}; {len(examples)} captions of {args.max_new_tokens} tokens; generate() {baseline:.1f} s"
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
