"""C2T tooling: collect labelled token trees from real runs, train the classifier (c2t.txt Appendix B).

::

    vlmspec c2t collect --tiny qwen2_vl --out trees.safetensors          # or --target T --draft D [--examples x.jsonl]
    vlmspec c2t train --data trees.safetensors --out my_c2t.safetensors  # writes my_c2t.json next to it
    vlmspec demo --policy c2t ...  (policy option classifier=my_c2t.safetensors)

(also ``python -m vlmspec.c2t_tools collect ...``).

**Collect** (Appendix B.1). Every decoding step of a real run grows the full EAGLE-2 expansion tree (``depth``
levels, ``top_k`` nodes expanded per level with ``top_k`` children each, *no* rerank: the paper's d = 11,
top-k = 10, 1011 nodes), the target verifies all of it with the engine's greedy rule, and each draft node is
recorded with its three C2T features (joint probability, entropy of the distribution it was drawn from over the
top-1000 probabilities, depth) and its label: 1 if it lies on the accepted path, else 0. The run itself is the
engine's own loop (:func:`vlmspec.engine.speculative_generate` through the pipeline) with a recording policy, so
the caches, pruning and stopping are exactly those of decoding. The data file (safetensors) holds ``features``
``[M, 3]`` float32, ``labels`` ``[M]`` float32 and ``tree`` ``[M]`` int64 (the step each node belongs to).

**Train** (Appendix B.2). A 95:5 split by tree, negative sampling (every epoch: all training positives and a fresh
random sample of ``neg_ratio`` negatives per positive; the paper leaves the ratio open, 1:1 balances the classes),
batch 1024, Adam (learning rate 1e-3: the paper's value is lost in the extracted text; Adam's standard rate),
10 epochs, BCE. Reported on the held-out trees at threshold ``beta``: **recall** (accepted nodes the classifier
passes) and **positive rate** (fraction of all nodes it passes), the two numbers the paper selects classifiers
by. The classifier is saved as safetensors plus its JSON feature spec (metrics and training settings included).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .artifacts import read_safetensors
from .draft import DraftTree
from .errors import InvalidInputError
from .policies.base import TreePolicy
from .policies.c2t import FEATURES, C2TClassifier, distribution_entropy
from .policies.eagle2 import EAGLE2Config, eagle2_expand
from .sampling import Sampler
from .tree import TokenTree
from .verify import Acceptance

DATA_FORMAT = "vlmspec-c2t-trees"


@dataclass
class Example:
    """One prompt to decode while collecting: ``pipe(image, prompt, video=video)``."""

    prompt: str
    image: Any = None
    video: Any = None


def default_examples(prompts_per_kind: int = 5) -> list[Example]:
    """The tiny fixtures' inputs (one image, two images, a video, text only) x the test prompts."""
    from .testing import make_image, make_video_frames

    prompts = (
        "Describe this image.",
        "What color is the largest shape?",
        "How many objects are there? Answer briefly.",
        "Write a short story about what you see.",
        "List three things in the picture.",
    )[:prompts_per_kind]
    kinds = [
        (make_image(0), None),
        ([make_image(1), make_image(2)], None),
        (None, make_video_frames(0)),
        (None, None),
    ]
    return [Example(prompt=p, image=image, video=video) for image, video in kinds for p in prompts]


def load_examples(path: str | Path) -> list[Example]:
    """Examples from a JSON-lines file: ``{"prompt": ..., "image": path | [paths] | null, "video": path | null}``."""
    examples = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise InvalidInputError(
                f"{path}:{number}: not valid JSON ({error.msg}, column {error.colno}); give one JSON object "
                '{"prompt": ..., "image": ..., "video": ...} per line'
            ) from None
        if not isinstance(row, dict):
            raise InvalidInputError(
                f"{path}:{number}: a JSON {type(row).__name__}, not an object; give one JSON object "
                '{"prompt": ..., "image": ..., "video": ...} per line'
            )
        if "prompt" not in row:
            raise InvalidInputError(f"{path}:{number}: every example needs a 'prompt'")
        examples.append(Example(prompt=row["prompt"], image=row.get("image"), video=row.get("video")))
    return examples


class _TreeRecorder(TreePolicy):
    """Grows full EAGLE-2 expansion trees and records every node's features and accepted/rejected label."""

    config_class = EAGLE2Config

    def __init__(self, config: EAGLE2Config, entropy_top: int) -> None:
        super().__init__(config)
        self.entropy_top = entropy_top
        self.features: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def build_tree(self, draft: DraftTree) -> TokenTree:
        seen: list[tuple[torch.Tensor, torch.Tensor]] = []

        def observe(nodes: torch.Tensor, probs: torch.Tensor) -> None:
            seen.append((nodes, distribution_entropy(probs, self.entropy_top)))

        eagle2_expand(draft, self.config.depth, self.config.top_k, observe)
        n = draft.num_nodes + 1
        entropy = torch.zeros(n, device=draft.tokens.device)
        for nodes, values in seen:
            entropy[nodes] = values
        parents = draft.parents[1:]
        self._pending = torch.stack(
            [draft.cum_probs[1:].float(), entropy[parents], draft.depths[1:].float()], dim=-1
        ).cpu()  # [N, 3]
        return draft.tree()  # no rerank: the complete tree

    def accept(
        self, tree: TokenTree, target_logits: torch.Tensor, sampler: Sampler | None = None
    ) -> Acceptance:
        acc = super().accept(tree, target_logits, sampler)  # the engine's rule (greedy unless sampling)
        labels = torch.zeros(tree.tokens.shape[0])
        labels[acc.path.cpu()] = 1.0
        if tree.num_nodes:
            self.features.append(self._pending)
            self.labels.append(labels[1:])
        return acc


def collect(
    pipe: Any,
    examples: Iterable[Example | tuple | dict],
    out_path: str | Path,
    depth: int = 11,
    top_k: int = 10,
    max_new_tokens: int = 64,
    entropy_top: int = 1000,
    verbose: bool = False,
) -> dict[str, Any]:
    """Decode ``examples`` with ``pipe`` and save every step's full token tree with features and labels.

    Args:
        pipe: a :class:`~vlmspec.VLMSpecPipeline` with a draft model (its policy is restored afterwards).
        examples: :class:`Example` objects, ``(image, prompt, video)`` tuples or dicts with those keys.
        out_path: the safetensors file to write.
        depth, top_k: the EAGLE-2 expansion (Appendix B.1: 11 and 10).
        max_new_tokens: tokens generated per example.
        entropy_top: probabilities the entropy feature covers (1000).
        verbose: print one line per example.

    Returns:
        A summary: trees, nodes, positives, mean accepted tokens per step.
    """
    recorder = _TreeRecorder(EAGLE2Config(depth=depth, top_k=top_k, total_tokens=1), entropy_top)
    previous = pipe.policy
    pipe.policy = recorder
    steps = accepted = 0
    try:
        for i, example in enumerate(examples):
            example = _as_example(example)
            out = pipe(example.image, example.prompt, video=example.video, max_new_tokens=max_new_tokens)
            steps += out.stats.steps
            accepted += out.stats.accepted_tokens
            if verbose:
                print(
                    f"[c2t collect] example {i}: {out.stats.steps} trees, tau={out.stats.mean_accepted:.2f}"
                )
    finally:
        pipe.policy = previous
    if not recorder.features:
        raise InvalidInputError(
            "c2t collect: no token tree was recorded (no examples, or max_new_tokens too small)"
        )
    features = torch.cat(recorder.features)
    labels = torch.cat(recorder.labels)
    tree = torch.cat(
        [torch.full((f.shape[0],), i, dtype=torch.long) for i, f in enumerate(recorder.features)]
    )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "trees": len(recorder.features),
        "nodes": int(features.shape[0]),
        "positives": int(labels.sum()),
        "mean_accepted": accepted / max(steps, 1),
        "depth": depth,
        "top_k": top_k,
        "entropy_top": entropy_top,
    }
    save_file(
        {"features": features.contiguous(), "labels": labels.contiguous(), "tree": tree},
        str(out_path),
        metadata={"format": DATA_FORMAT, **{k: str(v) for k, v in summary.items()}},
    )
    return summary


def _as_example(example: Example | tuple | dict) -> Example:
    if isinstance(example, Example):
        return example
    if isinstance(example, dict):
        return Example(prompt=example["prompt"], image=example.get("image"), video=example.get("video"))
    image, prompt, *rest = example
    return Example(prompt=prompt, image=image, video=rest[0] if rest else None)


def load_trees(paths: str | Path | Sequence[str | Path]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features ``[M, 3]``, labels ``[M]`` and tree ids ``[M]`` (renumbered across files) of collected data.

    Raises:
        InputNotFoundError: a file is missing.
        InvalidInputError: a file is not a readable c2t collect file (tensors, shapes, labels outside {0, 1},
            NaN or infinite features), naming it.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    features, labels, trees, offset = [], [], [], 0
    for path in paths:
        data = read_safetensors(path, "a c2t collect file", _COLLECT_AGAIN)
        _check_trees(path, data)
        features.append(data["features"].float())
        labels.append(data["labels"].float())
        trees.append(data["tree"] + offset)
        offset += int(data["tree"].max()) + 1 if data["tree"].numel() else 0
    return torch.cat(features), torch.cat(labels), torch.cat(trees)


_COLLECT_AGAIN = "write it again with `vlmspec c2t collect`"


def _check_trees(path: str | Path, data: dict[str, torch.Tensor]) -> None:
    """Refuse collected data that :func:`collect` could not have written, naming ``path`` and the problem."""
    n_features = len(FEATURES)
    if set(data) != {"features", "labels", "tree"}:
        problem = f"its tensors are {sorted(data)}, not features, labels and tree"
    elif data["features"].dim() != 2 or data["features"].shape[1] != n_features:
        problem = f"features has shape {list(data['features'].shape)}, not [nodes, {n_features}] ({FEATURES})"
    elif (
        data["labels"].shape != data["features"].shape[:1] or data["tree"].shape != data["features"].shape[:1]
    ):
        shapes = {k: list(v.shape) for k, v in data.items()}
        problem = f"features, labels and tree cover different numbers of nodes ({shapes})"
    elif data["tree"].is_floating_point() or data["tree"].is_complex() or bool((data["tree"] < 0).any()):
        problem = "tree does not hold non-negative integer tree ids"
    elif not bool(((data["labels"] == 0) | (data["labels"] == 1)).all()):
        problem = "labels holds values other than 0 (rejected) and 1 (accepted)"
    elif not bool(torch.isfinite(data["features"].float()).all()):
        problem = "features holds NaN or infinite values"
    else:
        return
    raise InvalidInputError(f"{str(path)!r} is not a valid c2t collect file: {problem}; {_COLLECT_AGAIN}")


def _check_settings(lr: float, neg_ratio: float, val_fraction: float, beta: float, **counts: int) -> None:
    """Refuse training settings out of range, naming the argument and its command-line flag."""
    problems = [
        (name, value, need)
        for name, value, ok, need in (
            ("lr", lr, _finite(lr) and lr > 0, "a number > 0 (Adam's learning rate)"),
            (
                "neg_ratio",
                neg_ratio,
                _finite(neg_ratio) and neg_ratio > 0,
                "a number > 0 (negatives sampled per positive)",
            ),
            (
                "val_fraction",
                val_fraction,
                _finite(val_fraction) and 0 <= val_fraction < 1,
                "a number in [0, 1)",
            ),
            (
                "beta",
                beta,
                _finite(beta) and 0 <= beta < 1,
                "a number in [0, 1) (the confidence threshold, as the c2t policy's beta)",
            ),
            *((name, v, isinstance(v, int) and v >= 1, "an integer >= 1") for name, v in counts.items()),
        )
        if not ok
    ]
    if problems:
        name, value, need = problems[0]
        flag = "--" + name.replace("_", "-")
        raise InvalidInputError(f"c2t train: {name} ({flag}) {value!r} is invalid: use {need}")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@torch.inference_mode()
def evaluate(
    classifier: C2TClassifier, features: torch.Tensor, labels: torch.Tensor, beta: float
) -> dict[str, float]:
    """Recall (accepted nodes passed) and positive rate (all nodes passed) at threshold ``beta``."""
    passed = classifier(features) > beta
    positives = labels > 0.5
    recall = float((passed & positives).sum()) / max(int(positives.sum()), 1)
    return {"recall": recall, "positive_rate": float(passed.float().mean()) if passed.numel() else 0.0}


def _fit(
    model: C2TClassifier,
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    epochs: int,
    batch_size: int,
    lr: float,
    neg_ratio: float,
    gen: torch.Generator,
    verbose: bool,
) -> None:
    """Adam on the BCE of ``model``'s logits: each epoch every positive and ``neg_ratio`` as many negatives drawn
    afresh, shuffled, in batches of ``batch_size``; the model is left in eval mode."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    pos_idx = (train_y > 0.5).nonzero().flatten()
    neg_idx = (train_y <= 0.5).nonzero().flatten()
    for epoch in range(epochs):
        n_neg = min(neg_idx.numel(), math.ceil(neg_ratio * pos_idx.numel()))
        negatives = neg_idx[torch.randperm(neg_idx.numel(), generator=gen)[:n_neg]]
        idx = torch.cat([pos_idx, negatives])
        idx = idx[torch.randperm(idx.numel(), generator=gen)]
        total = 0.0
        for start in range(0, idx.numel(), batch_size):
            batch = idx[start : start + batch_size]
            loss = loss_fn(model.logits(train_x[batch]), train_y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * batch.numel()
        if verbose:
            print(f"[c2t train] epoch {epoch + 1}/{epochs}: BCE {total / max(idx.numel(), 1):.4f}")
    model.eval()


def train(
    data_path: str | Path | Sequence[str | Path],
    out_path: str | Path,
    hidden: int = 48,
    epochs: int = 10,
    batch_size: int = 1024,
    lr: float = 1e-3,
    neg_ratio: float = 1.0,
    val_fraction: float = 0.05,
    beta: float = 0.5,
    seed: int = 0,
    description: str | None = None,
    verbose: bool = False,
) -> dict[str, Any]:
    """Fit a C2T classifier on collected trees and save it (safetensors + JSON spec).

    Args:
        data_path: one or more files written by :func:`collect`.
        out_path: the classifier's safetensors file (its spec goes to the same name with ``.json``).
        hidden: hidden units (48).
        epochs, batch_size, lr: Adam training (10, 1024, 1e-3).
        neg_ratio: negatives sampled per positive each epoch (1.0).
        val_fraction: trees held out for the reported metrics (0.05; at least one tree).
        beta: threshold the metrics are reported at (the policy's default 0.5).
        seed: seeds the split, the sampling and the initialisation.
        description: free text stored in the spec (where the data came from).

    Returns:
        ``{"recall", "positive_rate"}`` on the held-out trees, the same on the training trees, and the counts.
    """
    _check_settings(lr, neg_ratio, val_fraction, beta, hidden=hidden, epochs=epochs, batch_size=batch_size)
    features, labels, trees = load_trees(data_path)
    positives_total = _check_both_classes(labels, data_path)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    tree_ids = trees.unique()
    n_val = max(1, round(val_fraction * tree_ids.numel())) if tree_ids.numel() >= 2 else 0
    val_mask = torch.isin(trees, tree_ids[torch.randperm(tree_ids.numel(), generator=gen)][:n_val])
    train_x, train_y = features[~val_mask], labels[~val_mask]
    val_x, val_y = (features[val_mask], labels[val_mask]) if n_val else (train_x, train_y)

    mean = train_x.mean(dim=0)
    std = train_x.std(dim=0).clamp_min(1e-6)
    model = C2TClassifier(hidden=hidden, mean=mean, std=std)
    _fit(model, train_x, train_y, epochs, batch_size, lr, neg_ratio, gen, verbose)
    held_out = evaluate(model, val_x, val_y, beta)
    on_train = evaluate(model, train_x, train_y, beta)
    metrics = {
        **held_out,
        "beta": beta,
        "train_recall": on_train["recall"],
        "train_positive_rate": on_train["positive_rate"],
        "trees": int(tree_ids.numel()),
        "validation_trees": n_val,
        "nodes": int(features.shape[0]),
        "positives": positives_total,
    }
    sources = _names(data_path)
    model.save(
        out_path,
        metrics={"split": "validation" if n_val else "train", **metrics},
        training={
            "data": [Path(p).name for p in sources],
            "hidden": hidden,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "optimizer": "adam",
            "loss": "bce",
            "neg_ratio": neg_ratio,
            "val_fraction": val_fraction,
            "seed": seed,
        },
        **({"description": description} if description else {}),
    )
    return metrics


def _check_both_classes(labels: torch.Tensor, data_path: str | Path | Sequence[str | Path]) -> int:
    """The number of accepted nodes in ``labels``; refuses data with only one class (naming its files)."""
    positives = int((labels > 0.5).sum())
    if positives in (0, labels.numel()):
        which = (
            "no accepted node (every label is 0)" if positives == 0 else "no rejected node (every label is 1)"
        )
        raise InvalidInputError(
            f"c2t train: the data {', '.join(_names(data_path))} holds {which}: a classifier needs both classes; "
            "collect more steps (more examples or a larger --max-new-tokens)"
        )
    return positives


def _names(data_path: str | Path | Sequence[str | Path]) -> list[str]:
    return [str(data_path)] if isinstance(data_path, (str, Path)) else [str(p) for p in data_path]


# ---- command line ------------------------------------------------------------------------------------------------
def _parser(prog: str) -> argparse.ArgumentParser:
    from .cli import ArgumentParser, fraction, positive_int

    parser = ArgumentParser(prog=prog, description="C2T: collect labelled token trees, train the classifier")
    sub = parser.add_subparsers(dest="command", required=True)
    col = sub.add_parser(
        "collect", help="decode prompts and record full token trees with accepted/rejected labels"
    )
    src = col.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--tiny", metavar="FAMILY", help="use the tiny fixture pair of a family (vlmspec.testing)"
    )
    src.add_argument(
        "--target",
        help="target: a pair name (e.g. testbed-mini), or a checkpoint (hub id or folder) with --draft",
    )
    col.add_argument("--draft", help="draft checkpoint (hub id or folder); default: a named pair's own draft")
    col.add_argument("--tiny-root", help="where the tiny pairs are cached (default: vlmspec.testing's)")
    col.add_argument(
        "--examples", help="JSON lines of {prompt, image, video}; default: the tiny fixture inputs"
    )
    col.add_argument(
        "--prompts-per-kind", type=positive_int, default=5, help="default examples: prompts per input kind"
    )
    col.add_argument("--out", required=True, help="output .safetensors file")
    col.add_argument("--depth", type=positive_int, default=11)
    col.add_argument("--top-k", type=positive_int, default=10)
    col.add_argument("--max-new-tokens", type=positive_int, default=64)
    col.add_argument("--dtype", default="float32", help="torch dtype of the models (default float32)")
    col.add_argument(
        "--prune-ratio", type=fraction, default=None, help="draft visual-token pruning (default: pipeline's)"
    )
    tr = sub.add_parser("train", help="fit the classifier on collected trees")
    tr.add_argument("--data", nargs="+", required=True, help="files written by `collect`")
    tr.add_argument("--out", required=True, help="output classifier .safetensors (spec: same name .json)")
    tr.add_argument("--hidden", type=positive_int, default=48)
    tr.add_argument("--epochs", type=positive_int, default=10)
    tr.add_argument("--batch-size", type=positive_int, default=1024)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--neg-ratio", type=float, default=1.0)
    tr.add_argument("--val-fraction", type=fraction, default=0.05)
    tr.add_argument("--beta", type=float, default=0.5)
    tr.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "vlmspec c2t") -> int:
    """``collect`` / ``train`` subcommands; returns the exit status."""
    from .cli import check_output_path
    from .named_pairs import is_pair_name, is_pipeline_folder

    args = _parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "collect":
        from .pipeline import VLMSpecPipeline

        if args.tiny:
            from .testing import build_tiny_pair

            pair = build_tiny_pair(args.tiny, root=args.tiny_root)
            target, draft = pair.target, pair.draft
        else:
            if not args.draft and not (is_pair_name(args.target) or is_pipeline_folder(args.target)):
                raise SystemExit(
                    f"{prog} collect: --target {args.target!r} is a checkpoint, not a pair name: give its --draft"
                )
            target, draft = args.target, args.draft
        check_output_path(args.out, "--out", folder=False)
        pipe = VLMSpecPipeline.from_pretrained(target, draft, policy="chain", torch_dtype=args.dtype,
                                               prune_ratio=args.prune_ratio)  # fmt: skip
        examples = load_examples(args.examples) if args.examples else default_examples(args.prompts_per_kind)
        summary = collect(pipe, examples, args.out, depth=args.depth, top_k=args.top_k,
                          max_new_tokens=args.max_new_tokens, verbose=True)  # fmt: skip
        print(json.dumps(summary))
    else:
        check_output_path(args.out, "--out", folder=False)
        metrics = train(args.data, args.out, hidden=args.hidden, epochs=args.epochs, batch_size=args.batch_size,
                        lr=args.lr, neg_ratio=args.neg_ratio, val_fraction=args.val_fraction, beta=args.beta,
                        seed=args.seed, verbose=True)  # fmt: skip
        print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
