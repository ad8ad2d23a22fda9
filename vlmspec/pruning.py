"""Visual-token pruning for the draft (SpecVLM-style), as pure functions: tensors in, indices out.

The draft model only has to *propose* tokens, so it can read a pruned prompt: every text token plus a fraction of
the visual tokens. The target still reads the whole prompt, so decoding stays lossless; pruning only trades draft
quality (acceptance) for a cheaper draft prefill and a shorter draft cache.

Two ways to choose the visual tokens the draft keeps:

* ``"attention"`` (SpecVLM's verifier-guided scheme): the target's prefill reports how much attention the text
  after the last visual token pays to each visual token (``Prefill.visual_scores``). The most attended tokens are
  kept until they cover a share ``mass`` of the total attention, and the rest of the budget is spread evenly over
  the remaining tokens so that no region of the image/video is dropped entirely.
* ``"uniform"``: evenly spaced visual tokens, no scores needed.

Images and videos are pruned separately, each with its own ratio (videos are more redundant, so they are usually
pruned harder).

**Pruning that pays for itself** (``min_keep``, default 64): a modality keeps at least ``min_keep`` visual tokens
(all of them when it has fewer), whatever its ratio. Why: pruning buys a cheaper draft prefill and a shorter draft
cache, and both savings scale with the number of tokens dropped. Below a few dozen visual tokens they are nothing
next to the draft's per-forward cost (its weights are read once per forward whatever the context length), while
the acceptance they cost is not: on the testbed, whose images have 9 visual tokens, dropping 80% of them blinds
the draft (sage's tau 2.84 -> 2.49, chain's 2.45 -> 1.85 on the calibrated base pair), and the default ratios made
every policy slower. Real VLM images and videos (hundreds to thousands of tokens: Qwen2-VL's 448x448 image is 256)
are still pruned at SAGE's and SpecVLM's ratios, down to the floor. ``min_keep=0`` gives the papers' literal
ratios, and an explicit ``prune_ratio`` in a call is applied as given.

Nothing here runs a model; :mod:`vlmspec.models` runs the pruned draft prefill.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from .errors import InputTypeError, InvalidInputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .models.base import PromptLayout

PruningMethod = Literal["attention", "uniform"]
METHODS: tuple[str, ...] = ("attention", "uniform")


def _check_ratio(ratio: float, name: str = "ratio") -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) < 1.0:
        raise InvalidInputError(
            f"{name} must be a number in [0, 1) (the fraction of visual tokens pruned), got {ratio!r}; "
            "use 0 to keep every visual token"
        )


def _check_mass(mass: float, name: str = "mass") -> None:
    if isinstance(mass, bool) or not isinstance(mass, (int, float)) or not 0.0 <= float(mass) <= 1.0:
        raise InvalidInputError(
            f"{name} must be a number in [0, 1] (the share of attention the top-scored tokens must cover), "
            f"got {mass!r}"
        )


def _check_min_keep(min_keep: int, name: str = "min_keep") -> None:
    if isinstance(min_keep, bool) or not isinstance(min_keep, int) or min_keep < 0:
        raise InvalidInputError(
            f"{name} must be an integer >= 0 (the fewest visual tokens a modality keeps), got {min_keep!r}; "
            "use 0 to apply the prune ratios as given"
        )


def keep_count(num_visual: int, ratio: float) -> int:
    """Number of visual tokens kept when a fraction ``ratio`` of ``num_visual`` tokens is pruned.

    ``(1 - ratio) * num_visual`` rounded to the nearest integer, halves rounded up (the product is first snapped
    to 6 decimals so that float noise such as ``(1 - 0.8) * 5 = 0.9999999999999998`` does not move it), and at
    least 1 when ``num_visual > 0``. ``ratio = 0`` keeps every token.

    Args:
        num_visual: visual tokens before pruning (``>= 0``).
        ratio: fraction pruned, in ``[0, 1)``.

    Returns:
        The number kept, in ``[min(1, num_visual), num_visual]``.

    Raises:
        ValueError: ``ratio`` is outside ``[0, 1)`` or ``num_visual`` is negative.
    """
    _check_ratio(ratio)
    if isinstance(num_visual, bool) or not isinstance(num_visual, int) or num_visual < 0:
        raise InvalidInputError(f"num_visual must be a non-negative int, got {num_visual!r}")
    if num_visual == 0:
        return 0
    kept = math.floor(round((1.0 - float(ratio)) * num_visual, 6) + 0.5)
    return min(max(kept, 1), num_visual)


def floored_keep_count(num_visual: int, ratio: float, min_keep: int) -> int:
    """:func:`keep_count`, but never fewer than ``min(min_keep, num_visual)`` (the pruning floor)."""
    return max(keep_count(num_visual, ratio), min(min_keep, num_visual))


def uniform_keep(n: int, budget: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``budget`` evenly spaced indices out of ``n``.

    Pick ``i`` (``0 <= i < budget``) is ``floor((2 i + 1) n / (2 budget))``: the centre of the ``i``-th of
    ``budget`` equal slices of ``range(n)``, computed in exact integer arithmetic. Consecutive picks differ by
    ``floor`` or ``ceil`` of ``n / budget`` (at least 1), so the result is strictly increasing; ``budget == n``
    gives ``arange(n)`` and ``budget == 1`` gives the middle index ``n // 2``.

    Args:
        n: number of candidates.
        budget: picks wanted, ``0 <= budget <= n``.
        device: device of the result.

    Returns:
        ``[budget]`` long, ascending.

    Raises:
        ValueError: ``budget`` is negative or larger than ``n``.
    """
    if n < 0 or not 0 <= budget <= n:
        raise InvalidInputError(f"uniform_keep needs 0 <= budget <= n, got n={n!r}, budget={budget!r}")
    if budget == 0:
        return torch.zeros(0, dtype=torch.long, device=device)
    i = torch.arange(budget, dtype=torch.long, device=device)
    return torch.div((2 * i + 1) * n, 2 * budget, rounding_mode="floor")


def attention_keep(scores: torch.Tensor, budget: int, mass: float = 0.4) -> torch.Tensor:
    """SpecVLM's verifier-guided selection of ``budget`` visual tokens.

    1. **Top tokens.** Tokens are ranked by descending score; ties keep the lower index first (stable sort). The
       smallest number ``t`` of leading ranked tokens whose scores sum to at least ``mass * scores.sum()`` is taken,
       capped at ``budget`` (``t = 0`` when ``mass * total == 0``, e.g. ``mass = 0`` or all scores 0; when float
       error keeps the running sum just below the target, every token is needed and the cap applies).
    2. **Even fill.** The remaining ``budget - t`` picks are spread evenly over the *other* tokens in their original
       order, with :func:`uniform_keep`'s rule (centre of equal slices, exact integer arithmetic).

    Args:
        scores: ``[n]`` non-negative attention each visual token receives.
        budget: tokens to keep, ``0 <= budget <= n``.
        mass: share of the total attention the top tokens must cover, in ``[0, 1]``.

    Returns:
        ``[budget]`` long, ascending indices into ``scores``.

    Raises:
        ValueError: ``scores`` is not 1-D, has negative or non-finite entries, or ``budget``/``mass`` is out of range.
    """
    if scores.ndim != 1:
        raise InvalidInputError(f"scores must be 1-D [num_visual], got shape {tuple(scores.shape)}")
    n = scores.shape[0]
    if not 0 <= budget <= n:
        raise InvalidInputError(
            f"attention_keep needs 0 <= budget <= len(scores) = {n}, got budget={budget!r}"
        )
    _check_mass(mass)
    scores = scores.detach().to(torch.float64)
    if n and not (bool(torch.isfinite(scores).all()) and bool((scores >= 0).all())):
        raise InvalidInputError(
            "scores must be finite and non-negative (attention weights); got negative, NaN or inf values"
        )
    if budget == n:
        return torch.arange(n, dtype=torch.long, device=scores.device)
    order = torch.sort(scores, descending=True, stable=True).indices  # [n]
    target = float(mass) * float(scores.sum())
    needed = int((scores[order].cumsum(0) < target).sum()) + int(target > 0)
    top = order[: min(needed, budget, n)]
    is_top = torch.zeros(n, dtype=torch.bool, device=scores.device)
    is_top[top] = True
    rest = (~is_top).nonzero().flatten()  # ascending
    fill = rest[uniform_keep(rest.shape[0], budget - top.shape[0], device=scores.device)]
    return torch.cat([top, fill]).sort().values


def select_prompt_positions(
    visual: torch.Tensor,
    is_video: torch.Tensor,
    scores: torch.Tensor | None,
    method: PruningMethod,
    image_ratio: float,
    video_ratio: float,
    mass: float = 0.4,
    min_keep: int = 0,
) -> torch.Tensor:
    """Prompt positions the pruned draft keeps: every non-visual position plus the kept visual ones.

    Image tokens (all images of the prompt together) keep ``keep_count(num_image, image_ratio)`` tokens and video
    tokens ``keep_count(num_video, video_ratio)``, but never fewer than ``min(min_keep, tokens of the modality)``;
    each modality is selected on its own among its tokens (with their slice of ``scores`` for ``"attention"``,
    evenly for ``"uniform"``).

    Args:
        visual: ``[L]`` bool, visual placeholder positions.
        is_video: ``[L]`` bool, video placeholder positions (a subset of ``visual``).
        scores: ``[num_visual]`` attention per visual token, in the order of the visual positions; needed for
            ``"attention"`` when a modality present is pruned, ignored for ``"uniform"``.
        method: ``"attention"`` or ``"uniform"``.
        image_ratio: fraction of image tokens pruned, ``[0, 1)``.
        video_ratio: fraction of video tokens pruned, ``[0, 1)``.
        mass: attention share for :func:`attention_keep`.
        min_keep: the fewest visual tokens a modality keeps (see the module docstring), ``>= 0``.

    Returns:
        ``[K]`` long, ascending prompt positions.

    Raises:
        ValueError: bad method/ratio/mass, mismatched shapes, video positions outside ``visual``, or missing scores.
    """
    if method not in METHODS:
        raise InvalidInputError(f"method must be one of {METHODS}, got {method!r}")
    _check_ratio(image_ratio, "image_ratio")
    _check_ratio(video_ratio, "video_ratio")
    _check_mass(mass)
    _check_min_keep(min_keep)
    if visual.ndim != 1 or visual.shape != is_video.shape:
        raise InvalidInputError(
            f"visual {tuple(visual.shape)} and is_video {tuple(is_video.shape)} must be 1-D masks of the same length"
        )
    visual, is_video = visual.bool(), is_video.bool()
    if bool((is_video & ~visual).any()):
        raise InvalidInputError(
            "is_video marks positions that visual does not; video tokens must be visual tokens"
        )
    visual_pos = visual.nonzero().flatten()  # [num_visual]
    num_visual = visual_pos.shape[0]
    video_among = is_video[visual_pos]  # [num_visual]
    if scores is not None and (scores.ndim != 1 or scores.shape[0] != num_visual):
        raise InvalidInputError(
            f"scores must be [num_visual] = [{num_visual}] (one per visual position), got {tuple(scores.shape)}"
        )

    keep = ~visual
    for members, ratio, name in ((~video_among, image_ratio, "image"), (video_among, video_ratio, "video")):
        idx = members.nonzero().flatten()  # indices into the visual positions
        budget = floored_keep_count(idx.shape[0], ratio, min_keep)
        if budget == idx.shape[0]:
            chosen = idx
        elif method == "uniform":
            chosen = idx[uniform_keep(idx.shape[0], budget, device=idx.device)]
        elif scores is None:
            raise InvalidInputError(
                f"attention-guided pruning of the {name} tokens needs scores (the target's "
                "`prefill(..., score_visual=True).visual_scores`); pass them or use method='uniform'"
            )
        else:
            chosen = idx[attention_keep(scores.to(idx.device)[idx], budget, mass)]
        keep[visual_pos[chosen]] = True
    return keep.nonzero().flatten()


@dataclass(frozen=True)
class PruningConfig:
    """How the draft prunes visual tokens.

    Attributes:
        method: ``"attention"`` (verifier-guided, needs the target's visual scores) or ``"uniform"``.
        image_ratio: fraction of image tokens pruned, ``[0, 1)``.
        video_ratio: fraction of video tokens pruned, ``[0, 1)``.
        mass: attention share the top-scored tokens must cover (``"attention"`` only), ``[0, 1]``.
        min_keep: the fewest visual tokens each modality keeps (64; 0 applies the ratios as given: SAGE's and
            SpecVLM's literal pruning). See the module docstring for why.
    """

    method: PruningMethod = "attention"
    image_ratio: float = 0.8
    video_ratio: float = 0.9
    mass: float = 0.4
    min_keep: int = 64

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidInputError(f"PruningConfig.method must be one of {METHODS}, got {self.method!r}")
        _check_ratio(self.image_ratio, "PruningConfig.image_ratio")
        _check_ratio(self.video_ratio, "PruningConfig.video_ratio")
        _check_mass(self.mass, "PruningConfig.mass")
        _check_min_keep(self.min_keep, "PruningConfig.min_keep")

    @classmethod
    def disabled(cls) -> PruningConfig:
        """A config that keeps every visual token."""
        return cls(method="uniform", image_ratio=0.0, video_ratio=0.0)

    @property
    def enabled(self) -> bool:
        """Whether any visual token can be pruned."""
        return self.image_ratio > 0 or self.video_ratio > 0

    @property
    def needs_scores(self) -> bool:
        """Whether :meth:`select` needs the target's visual attention scores."""
        return self.method == "attention" and self.enabled

    def prunes(self, layout: PromptLayout) -> bool:
        """Whether this prompt loses any visual token (the floor keeps every token of a small modality)."""
        videos = int(layout.is_video.sum())
        images = int(layout.visual.sum()) - videos
        return any(
            floored_keep_count(n, ratio, self.min_keep) < n
            for n, ratio in ((images, self.image_ratio), (videos, self.video_ratio))
        )

    def draft_selection(
        self, adapter: Any, inputs: dict[str, Any]
    ) -> Callable[[torch.Tensor | None], torch.Tensor] | None:
        """How a draft (``adapter``) prunes the prompt ``inputs``: :meth:`select` on its layout, or ``None`` when
        nothing would be pruned (pruning off, a prompt whose every modality is under the floor, an EDD draft, which
        sees the prompt through the target's hidden states, or a language-model draft, which reads no visual token
        at all), so that no scoring pass is run for nothing."""
        if not self.enabled or adapter.reads_target_layer is not None or not adapter.reads_pictures:
            return None
        layout = adapter.prompt_layout(inputs)
        if layout is None or not self.prunes(layout):
            return None
        return lambda scores: self.select(layout, scores)

    def select(self, layout: PromptLayout, scores: torch.Tensor | None = None) -> torch.Tensor:
        """Prompt positions the draft keeps.

        Args:
            layout: the prompt's visual layout (``adapter.prompt_layout(inputs)``).
            scores: ``[num_visual]`` visual attention scores (``Prefill.visual_scores``). ``None`` with
                ``"attention"`` (a prompt with no text after its visual tokens has nothing to score them) falls
                back to uniform selection with the same budgets.

        Returns:
            ``[K]`` long, ascending prompt positions (all ``L`` positions when pruning is disabled).
        """
        method = self.method if scores is not None else "uniform"
        return select_prompt_positions(
            layout.visual,
            layout.is_video,
            scores,
            method,
            self.image_ratio,
            self.video_ratio,
            self.mass,
            self.min_keep,
        )


__all__ = [
    "METHODS",
    "PruningConfig",
    "PruningMethod",
    "attention_keep",
    "floored_keep_count",
    "keep_count",
    "select_prompt_positions",
    "uniform_keep",
]


def pruning_config(pruning: str | PruningConfig, prune_ratio: float | None) -> PruningConfig:
    """A :class:`PruningConfig` from a method name or config and an optional ratio for images and videos.

    A ratio is applied as given, with no ``min_keep`` floor; 0 disables pruning while keeping the method (and
    mass), so that a later per-call ratio (or a saved pipeline) prunes the way that was asked."""
    if isinstance(pruning, PruningConfig):
        config = pruning
    elif isinstance(pruning, str):
        config = PruningConfig(method=pruning)
    else:
        raise InputTypeError(
            f"pruning must be 'attention', 'uniform' or a PruningConfig, got {type(pruning).__name__}"
        )
    if prune_ratio is not None:
        config = PruningConfig(  # an explicit ratio is applied as given: no min_keep floor
            method=config.method,
            image_ratio=prune_ratio,
            video_ratio=prune_ratio,
            mass=config.mass,
            min_keep=0,
        )
    return config
