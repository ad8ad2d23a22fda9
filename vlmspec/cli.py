"""``vlmspec`` command line. ``vlmspec demo`` captions the bundled example image and prints speed statistics."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

EXAMPLE_IMAGE = "example.png"


def _example_image() -> Path:
    return Path(str(resources.files("vlmspec") / "assets" / EXAMPLE_IMAGE))


def trace_summary(trace: list[dict]) -> str:
    """A short summary of a SAGE trace: alpha, depth and width ranges, acceptance."""
    if not trace or "alpha" not in trace[0]:
        return ""
    alphas = [t["alpha"] for t in trace]
    depths = [t["depth"] for t in trace]
    widths = [t["width"] for t in trace]
    sizes = [t["tree_size"] for t in trace]
    return (
        f"SAGE trace over {len(trace)} steps: alpha {min(alphas):.2f}..{max(alphas):.2f} "
        f"(mean {sum(alphas) / len(alphas):.2f}), depth {min(depths)}..{max(depths)}, "
        f"width {min(widths)}..{max(widths)}, tree size {min(sizes)}..{max(sizes)}, "
        f"max depth now {trace[-1]['max_depth']}"
    )


def demo(args: argparse.Namespace) -> int:
    import torch

    from .pipeline import VLMSpecPipeline

    if args.target is None:
        from .testing import build_tiny_pair

        print(
            f"No checkpoint named: using the embedded default pair, a tiny randomly initialised {args.family} "
            "target/draft built locally (its caption is noise until the trained testbed pair exists; the speed "
            "statistics are real).",
            flush=True,
        )
        pair = build_tiny_pair(args.family)
        target, draft = pair.target, pair.draft
    else:
        target, draft = args.target, args.draft
    options = json.loads(args.policy_options) if args.policy_options else {}
    pipe = VLMSpecPipeline.from_pretrained(
        target, draft, policy=args.policy, torch_dtype=torch.float32, **options
    )
    image = None if args.video else (args.image or _example_image())
    pipe(image, args.prompt, video=args.video, max_new_tokens=4)  # warm-up: torch's one-off first-call costs
    out = pipe(image, args.prompt, video=args.video, max_new_tokens=args.max_new_tokens)
    print(f"caption: {out.text}")
    print(f"stats:   {out.stats.summary()}")
    summary = trace_summary(out.stats.trace)
    if summary:
        print(summary)
    if args.compare_ar:
        pipe.policy = "ar"
        ar = pipe(image, args.prompt, video=args.video, max_new_tokens=args.max_new_tokens)
        same = "identical" if ar.token_ids == out.token_ids else "DIFFERENT"
        print(f"ar:      {ar.stats.summary()}")
        print(
            f"output vs ar: {same}; speed-up {out.stats.tokens_per_second / ar.stats.tokens_per_second:.2f}x"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo", help="caption the bundled example image (or your image/video) with speed stats"
    )
    d.add_argument("--target", help="target model (hub id or folder); default: the embedded tiny pair")
    d.add_argument("--draft", help="draft model (hub id or folder)")
    d.add_argument("--family", default="qwen2_vl", help="family of the embedded tiny pair (default qwen2_vl)")
    d.add_argument("--policy", default="sage", help="tree policy (default sage)")
    d.add_argument("--policy-options", help="JSON of policy options, e.g. '{\"n_max\": 32}'")
    d.add_argument("--image", help="image path (default: the bundled example)")
    d.add_argument("--video", help="video path (instead of an image)")
    d.add_argument("--prompt", default="Describe this image.")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--compare-ar", action="store_true", help="also run plain decoding and compare")
    d.set_defaults(func=demo)

    b = sub.add_parser(
        "bench", help="benchmark methods side by side (tau, tokens/s, speed-up, identical to AR)"
    )
    from vlmspec_eval.bench import add_arguments, run_args

    add_arguments(b)
    b.set_defaults(func=run_args)

    from . import caption_cli

    c = sub.add_parser("caption", help="caption a folder/glob/manifest of videos into a resumable JSONL")
    caption_cli.add_arguments(c)
    c.set_defaults(func=caption_cli.run_args)

    # `vlmspec c2t ...` is handed whole to the C2T tool's own parser (see `main`); listed here for --help.
    sub.add_parser("c2t", help="collect labelled token trees / train the C2T classifier (vlmspec c2t --help)")
    return parser


def _c2t_main(argv: list[str]) -> int:
    from .c2t_tools import main as c2t_main

    return c2t_main(argv, prog="vlmspec c2t")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["c2t"]:
        return _c2t_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
