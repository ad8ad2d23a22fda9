"""``c2t``: Classifier-based Tree construction (C2T, ``shared/papers/c2t.txt``).

A tiny classifier scores every draft candidate from three features and the tree grows layer by layer from the
candidates it trusts (a *pre-pruning* method, section 4.2):

* **Features** (section 4.1, Eq. 1-3) of a candidate ``v`` with parent ``u``:

  1. joint probability ``P(v) = prod_{w in path(v)} p(w)``: the product of the draft probabilities from the
     root to ``v`` (the cumulative probability of EAGLE-2);
  2. entropy ``H(v)`` of the distribution ``v`` was drawn from (the draft's next-token distribution after ``u``),
     computed over its top-1000 probabilities renormalised to sum to one, natural log;
  3. depth ``d(v)`` (root 0, its children 1).

* **Classifier** (section 4.1, Appendix B.3): a 2-layer FFN, ReLU hidden layer of 48 units, sigmoid output, the
  confidence ``C(v)`` in ``(0, 1)``. It is a :class:`C2TClassifier` whose weights live in a safetensors file next
  to a JSON feature spec (``<name>.json``); the default, trained on the testbed base qwen2_vl pair with
  :mod:`vlmspec.c2t_tools` (validation recall 0.66 at positive rate 0.024, beta 0.5), ships in
  ``vlmspec/assets/c2t_default.safetensors``.

* **Tree construction** (section 4.2). Layer ``l``: every node of layer ``l - 1`` that passed proposes its top-K
  children by draft probability (first purpose of top-K: the classifier only scores those); candidates with
  ``C(v) > beta`` pass (first pruning); of those, at most top-K with the highest confidence are kept (second
  pruning, default K = 15, Appendix B.6). The kept nodes join the tree and generate layer ``l + 1`` in one batched
  draft forward. Construction stops at ``max_depth`` or when no candidate of a layer passes.

Defaults and choices where the paper is open (the extracted text lost most symbols):

* ``beta = 0.5``: the threshold of the C2T rows compared with EAGLE-2 in Table 7 and one of the two values of the
  top-K study (Table 5, beta in {0.3, 0.5}).
* ``top_k = 15`` for both uses of top-K: Appendix B.6 "we default to using Top-K = 15 for two complete rounds of
  constrained pruning" (per-node candidates scored, then the layer's survivors by confidence).
* ``max_depth = 11``: the depth of the EAGLE-2 trees the classifier is trained on (Appendix B.1, d = 11 layers
  below the root, 1011 nodes), i.e. the depth range the depth feature was fitted on.
* Only candidates that pass the classifier are draft nodes of the verified tree (C2T scores each draft token "to
  determine whether it is the candidate token for verification"); a layer where nothing passes ends the tree, and
  a step where nothing passes at layer 1 verifies the root alone (a plain decoding step).
* Feature normalisation: the features enter the FFN raw (Appendix D feeds joint probability in [0, 1], entropy in
  nats, integer depth), standardised by a per-feature mean and standard deviation fitted on the training data and
  stored with the weights (an affine input map the first layer could absorb; it only conditions training).
* When the vocabulary has fewer than 1000 tokens, the entropy is over the whole distribution.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..artifacts import read_json_object, read_safetensors
from ..draft import DraftTree
from ..errors import InputNotFoundError, InvalidInputError
from ..tree import TokenTree
from .base import PolicyConfig, TreePolicy, check, check_positive_int, is_int, register_policy

FEATURES = ("joint_prob", "entropy", "depth")
SPEC_FORMAT = "vlmspec-c2t-classifier"
DEFAULT_CLASSIFIER = Path(__file__).resolve().parent.parent / "assets" / "c2t_default.safetensors"


def spec_path(weights: str | Path) -> Path:
    """The JSON feature spec that goes with a classifier's safetensors file (same name, ``.json``)."""
    return Path(weights).with_suffix(".json")


def distribution_entropy(probs: torch.Tensor, top: int = 1000) -> torch.Tensor:
    """C2T's entropy feature (Eq. 2-3): entropy of each row's top-``top`` probabilities, renormalised.

    Args:
        probs: ``[..., V]`` next-token distributions.
        top: how many of the largest probabilities count (1000 in the paper; all when ``V`` is smaller).

    Returns:
        ``[...]`` entropies in nats.
    """
    values = probs.topk(min(top, probs.shape[-1]), dim=-1).values.float()
    values = values / values.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return -(values * values.clamp_min(1e-30).log()).sum(dim=-1)


def candidate_features(
    parent_cum: torch.Tensor,
    parent_entropy: torch.Tensor,
    child_probs: torch.Tensor,
    depth: int | torch.Tensor,
) -> torch.Tensor:
    """Features ``[..., 3]`` = (joint probability, entropy, depth) of candidate children.

    Args:
        parent_cum: ``[F]`` joint probabilities of the parents.
        parent_entropy: ``[F]`` entropies of the parents' next-token distributions.
        child_probs: ``[F, k]`` draft probabilities of the candidates given their parent.
        depth: the candidates' depth (an int for a level, or ``[F, k]``).

    Returns:
        ``[F, k, 3]`` float32.
    """
    joint = parent_cum[:, None].float() * child_probs.float()
    entropy = parent_entropy[:, None].float().expand_as(joint)
    if isinstance(depth, torch.Tensor):
        depth = depth.to(torch.float32).expand_as(joint)
    else:  # a level's: filled on the device (no host-to-device copy per level)
        depth = joint.new_full(joint.shape, float(depth))
    return torch.stack([joint, entropy, depth], dim=-1)


class C2TClassifier(torch.nn.Module):
    """The C2T confidence model: standardise -> Linear(3, hidden) -> ReLU -> Linear(hidden, 1) -> sigmoid.

    Args:
        hidden: hidden units (48, Appendix B.3).
        mean, std: ``[3]`` per-feature standardisation (identity by default).
    """

    def __init__(
        self, hidden: int = 48, mean: torch.Tensor | None = None, std: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.hidden = hidden
        self.fc1 = torch.nn.Linear(len(FEATURES), hidden)
        self.fc2 = torch.nn.Linear(hidden, 1)
        self.register_buffer("mean", torch.zeros(len(FEATURES)) if mean is None else mean.float().clone())
        self.register_buffer("std", torch.ones(len(FEATURES)) if std is None else std.float().clone())
        self.spec: dict[str, Any] = {}

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., 3]`` features -> ``[...]`` pre-sigmoid scores (what BCE-with-logits trains)."""
        x = (features.to(self.mean.dtype) - self.mean) / self.std.clamp_min(1e-6)
        return self.fc2(torch.relu(self.fc1(x))).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """``[..., 3]`` features -> ``[...]`` confidence in ``(0, 1)``."""
        return torch.sigmoid(self.logits(features))

    def save(self, path: str | Path, **extra: Any) -> Path:
        """Write ``path`` (safetensors weights) and its JSON spec; ``extra`` entries go into the spec."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"format": SPEC_FORMAT})
        spec = {
            "format": SPEC_FORMAT,
            "version": 1,
            "features": list(FEATURES),
            "feature_definitions": {
                "joint_prob": "product of the draft probabilities from the root to the node (root excluded)",
                "entropy": "entropy (nats) of the draft distribution the node was drawn from, over its top "
                "`entropy_top` probabilities renormalised",
                "depth": "node depth, root 0 (its children 1), raw integer",
            },
            "entropy_top": 1000,
            "normalisation": "x' = (x - mean) / std per feature; mean and std are stored in the weights file",
            "architecture": {"layers": 2, "hidden": self.hidden, "activation": "relu", "output": "sigmoid"},
            **extra,
        }
        spec_path(path).write_text(json.dumps(spec, indent=2) + "\n")
        self.spec = spec
        return path

    @classmethod
    def load(cls, path: str | Path) -> C2TClassifier:
        """Load weights (safetensors) and check them against the JSON spec next to them.

        Raises:
            InputNotFoundError: the weights or the spec are missing.
            InvalidInputError: either is unreadable or not a C2T classifier (naming the file and what is wrong).
        """
        path = Path(path)
        remedy = "train one with `vlmspec c2t train`, or leave `classifier` unset for the shipped default"
        if not path.is_file():
            raise InputNotFoundError(f"C2T classifier {str(path)!r} does not exist; {remedy}")
        spec_file = spec_path(path)
        if not spec_file.is_file():
            raise InputNotFoundError(
                f"C2T classifier {str(path)!r} has no feature spec {str(spec_file)!r} next to it; {remedy}"
            )
        spec = read_json_object(spec_file, "a C2T classifier spec", remedy)
        if spec.get("format") != SPEC_FORMAT or tuple(spec.get("features", ())) != FEATURES:
            raise InvalidInputError(
                f"{str(spec_file)!r} is not a C2T classifier spec with features {list(FEATURES)} "
                f"(got format {spec.get('format')!r}, features {spec.get('features')!r}); {remedy}"
            )
        tensors = read_safetensors(path, "a C2T classifier's weights", remedy)
        hidden = _check_weights(path, tensors, remedy)
        model = cls(hidden=hidden)
        model.load_state_dict(tensors)
        model.spec = spec
        return model.eval()


def _check_weights(path: Path, tensors: dict[str, torch.Tensor], remedy: str) -> int:
    """The hidden width of classifier weights ``tensors``, after checking they are exactly a
    :class:`C2TClassifier`'s (names, shapes, finite values); an error naming ``path`` and the problem otherwise."""
    fc1 = tensors.get("fc1.weight")
    hidden = int(fc1.shape[0]) if fc1 is not None and fc1.dim() == 2 and fc1.shape[0] > 0 else 0
    expected = {
        "fc1.weight": (hidden, len(FEATURES)),
        "fc1.bias": (hidden,),
        "fc2.weight": (1, hidden),
        "fc2.bias": (1,),
        "mean": (len(FEATURES),),
        "std": (len(FEATURES),),
    }
    problem = None
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        problem = f"its tensors are not a C2T classifier's (missing {missing[:6]}, unexpected {extra[:6]})"
    elif bad := [n for n, shape in expected.items() if tuple(tensors[n].shape) != shape]:
        got = {n: list(tensors[n].shape) for n in bad}
        want = {n: list(expected[n]) for n in bad}
        problem = f"tensor shapes {got} are not the {len(FEATURES)}-feature classifier's {want}"
    elif bad := [n for n, t in tensors.items() if not torch.isfinite(t.float()).all()]:
        problem = f"tensors {bad} hold NaN or infinite values"
    if problem is not None:
        raise InvalidInputError(f"C2T classifier {str(path)!r}: {problem}; {remedy}")
    return hidden


@dataclass(frozen=True)
class C2TConfig(PolicyConfig):
    """C2T hyper-parameters (see the module docstring for where each default comes from).

    Args:
        beta: confidence threshold; a candidate passes when ``C(v) > beta`` (0.5).
        max_depth: most layers below the root (11).
        top_k: children scored per expanded node, and most nodes kept per layer after the classifier (15).
        entropy_top: probabilities the entropy feature covers (1000).
        classifier: path of a classifier's safetensors weights (text or a ``pathlib.Path``, kept as text); ``None``:
            the shipped default.
    """

    depth_field = "max_depth"
    file_fields = ("classifier",)

    beta: float = 0.5
    max_depth: int = 11
    top_k: int = 15
    entropy_top: int = 1000
    classifier: str | None = None

    def __post_init__(self) -> None:
        check(0.0 <= self.beta < 1.0, self, "beta", self.beta, "a number in [0, 1)")
        check_positive_int(self, "max_depth")
        check_positive_int(self, "top_k")
        check(is_int(self.entropy_top) and self.entropy_top >= 2, self, "entropy_top", self.entropy_top,
              "an integer >= 2")  # fmt: skip
        if self.classifier is not None:
            exists = isinstance(self.classifier, (str, Path)) and Path(self.classifier).is_file()
            need = "the path of an existing classifier .safetensors file, or None for the default"
            check(exists, self, "classifier", self.classifier, need)
            object.__setattr__(self, "classifier", str(self.classifier))

    @classmethod
    def companion_files(cls, field: str, path: Path) -> tuple[Path, ...]:
        """A classifier's JSON feature spec (:func:`spec_path`)."""
        return (spec_path(path),)


@register_policy("c2t")
class C2TPolicy(TreePolicy):
    config_class = C2TConfig

    def __init__(self, config: C2TConfig | None = None, fixed: Collection[str] | None = None) -> None:
        super().__init__(config, fixed)
        self.classifier = C2TClassifier.load(self.config.classifier or DEFAULT_CLASSIFIER)
        self._classifier_device: torch.device | None = None

    def reset(self) -> None:
        self._last: dict[str, Any] = {}

    def build_tree(self, draft: DraftTree) -> TokenTree:
        c = self.config
        device = draft.tokens.device
        if self._classifier_device != device:
            self.classifier.to(device)
            self._classifier_device = device
        frontier = torch.zeros(1, dtype=torch.long, device=device)  # the root
        probs = draft.next_probs(frontier)  # [1, V]
        layers: list[int] = []
        for level in range(1, c.max_depth + 1):
            k = min(c.top_k, probs.shape[-1])
            top_p, top_tok = probs.topk(k, dim=-1)  # [F, k] the candidates the classifier scores
            entropy = distribution_entropy(probs, c.entropy_top)  # [F]
            features = candidate_features(draft.cum_probs[frontier], entropy, top_p, level)  # [F, k, 3]
            with torch.inference_mode():
                confidence = self.classifier(features)  # [F, k]
            confidence = confidence.masked_fill(~(confidence > c.beta), -1.0)  # first pruning: C(v) > beta
            passed = int((confidence > c.beta).sum())
            if passed == 0:
                break
            # Second pruning: the top-K passing candidates by confidence, then in (parent, rank) order.
            ids = draft.add_best(frontier, top_tok, top_p, confidence, min(c.top_k, passed))
            if ids.numel() == 0:
                break
            layers.append(ids.numel())
            if level == c.max_depth:
                break
            frontier = ids
            probs = draft.next_probs(frontier)  # one batched draft forward per layer
        self._last = {"layers": layers}
        return draft.tree()

    def trace(self) -> dict[str, Any]:
        return dict(self._last)
