"""``testbed build [--size base|mini] [--family <family>|all] [--root DIR] [--force]`` and
``testbed prune [--root DIR] [--dry-run]``.

Run as ``python -m vlmspec.testbed build ...``; :func:`main` takes the arguments after ``testbed`` so the
``vlmspec`` command can hand them on (``vlmspec testbed build ...``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .pairs import build, compare_with_shipped, default_root, prune
from .tokenizer import FAMILIES
from .train import SIZES


def build_parser(prog: str = "python -m vlmspec.testbed") -> argparse.ArgumentParser:
    from ..cli import ArgumentParser

    """The ``testbed`` argument parser (sub-commands ``build`` and ``prune``)."""
    parser = ArgumentParser(prog=prog, description="Build (train) the vlmspec testbed target/draft pairs.")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "build",
        help="train the testbed pair(s) into the cache unless already built there, print their quality gates "
        "and whether they match the pairs that ship with the package",
    )
    b.add_argument(
        "--size", choices=tuple(SIZES), default="base", help="base (~15-20 min per pair) or mini (~1-2 min)"
    )
    b.add_argument("--family", choices=(*FAMILIES, "all"), default="all", help="model family (default: all)")
    b.add_argument(
        "--root",
        default=None,
        help="cache folder (default: $VLMSPEC_CACHE/testbed or ~/.cache/vlmspec/testbed)",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if the pair is already built")
    p = sub.add_parser("prune", help="remove the pair folders built by other testbed versions")
    p.add_argument("--root", default=None, help="cache folder (default: as for build)")
    p.add_argument("--dry-run", action="store_true", help="list the folders without removing them")
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "python -m vlmspec.testbed") -> int:
    """Runs the ``testbed`` command; ``build`` returns 0 when every built pair passes its quality gates, else 1."""
    args = build_parser(prog).parse_args(argv)
    if args.root is not None:
        from ..cli import check_output_path

        check_output_path(args.root, "--root")
    if args.command == "prune":
        old = prune(args.root, dry_run=args.dry_run)
        for folder in old:
            print(f"{'would remove' if args.dry_run else 'removed'} {folder}", flush=True)
        if not old:
            print("no pair folders of other testbed versions", flush=True)
        return 0
    families = FAMILIES if args.family == "all" else (args.family,)
    ok = True
    for family in families:
        pair = build(size=args.size, family=family, root=args.root or default_root(), force=args.force)
        print(
            f"{family}/{args.size}: target {pair.target}\n{family}/{args.size}: draft  {pair.draft}\n"
            f"{compare_with_shipped(pair)}",
            flush=True,
        )
        ok &= bool(pair.manifest.get("gates_passed", False))
    return 0 if ok else 1
