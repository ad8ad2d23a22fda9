"""Vision pre-training of a testbed model's tower: a fixed linear probe on every grid cell's visual features.

Real VLMs start from a pre-trained vision encoder; :func:`pretrain_vision` gives the testbed's towers (and their
projectors/mergers) what is in each cell of the world's 3 x 3 grid before the language model trains on them
(:mod:`vlmspec.testbed.train`, which keeps the tower frozen).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .data import IGNORE
from .world import BACKGROUNDS, COLOURS, EVENTS, GRID, KINDS, MAX_SHAPES, Clip, Scene, sample
from .world import SIZES as SHAPE_SIZES

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel, ProcessorMixin

    from .train import SizeConfig

__all__ = [
    "CLIP_FAMILIES",
    "FEATURE_RMS_CAP",
    "cell_features",
    "is_vision_parameter",
    "pretrain_vision",
    "rms_penalty",
]

CLIP_FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Families whose patch embedding merges frame pairs (Qwen's temporal patches): their towers also learn clips in
vision pre-training (see :func:`pretrain_vision`)."""
FEATURE_RMS_CAP: dict[str, float] = {"llava_onevision": 1.0, "internvl": 1.0}
"""Per family, the largest RMS a visual feature may reach in vision pre-training (a hinge penalty above it; a
family not listed is not capped). See :func:`pretrain_vision`."""


# ---------------------------------------------------------------------------------------------
# Vision pre-training
# ---------------------------------------------------------------------------------------------
# Per-cell labels: occupied (2), colour (+none), kind (+none), size (+none), cell index (9), background, rank of
# the shape in reading order (+none: which sentence of the caption is about it), the scene's shape count, and
# for a clip's first frame pair the track's event (+none), a move's end cell (+none) and a turn's new colour (+none).
_AUX_CLASSES = (
    2, len(COLOURS) + 1, len(KINDS) + 1, len(SHAPE_SIZES) + 1, GRID * GRID, len(BACKGROUNDS), MAX_SHAPES + 1,
    MAX_SHAPES + 1, len(EVENTS) + 1, GRID * GRID + 1, len(COLOURS) + 1,
)  # fmt: skip
_AUX_WEIGHTS = (1.0, 1.0, 3.0, 1.0, 2.0, 0.5, 2.0, 0.5, 2.0, 1.0, 1.0)  # fmt: skip
"""Loss weight per label column: kind, cell, rank and event are the subtle ones."""
_LLAVA_CELL_TOKENS = tuple(range(GRID * GRID)) + tuple(
    GRID * GRID + r * (GRID + 1) + c for r in range(GRID) for c in range(GRID)
)  # base crop (raster), then the anyres tile (raster rows, each followed by a newline token)


def rms_penalty(features: torch.Tensor, cap: float) -> torch.Tensor:
    """Mean over tokens of ``max(0, log(rms / cap)) ** 2``: zero while every token's RMS is at most ``cap``.

    Args:
        features: ``[B, T, H]`` token features.
        cap: The largest RMS a token may have without penalty.
    """
    rms = features.float().pow(2).mean(-1).sqrt()  # [B, T]
    return (rms.log() - math.log(cap)).clamp(min=0).pow(2).mean()


def _cell_labels(scene: Scene | Clip, late: bool = False) -> list[list[int]]:
    """``[9, 11]`` aux labels of a still scene, or of a clip's first (``late=False``) or second frame pair.

    A still scene's rank is the shape's caption sentence. A clip's first frame pair shows each track before and
    after its event (see :data:`~vlmspec.testbed.world.CHANGE_FRAME`), so its labels are the caption's: every
    track at its anchor cell with its first-seen look, its sentence rank, the track count and the event (with the
    end cell of a move and the new colour of a turn). The second pair shows the end state; its rank and count
    describe what is drawn there (Qwen2-VL's vision tower attends within one frame pair). Event columns that a
    picture cannot show are :data:`IGNORE`.
    """
    none = (len(COLOURS), len(KINDS), len(SHAPE_SIZES))
    background = list(BACKGROUNDS).index(scene.background)
    if isinstance(scene, Clip) and not late:
        shapes = [t.shape for t in scene.tracks]
        events = [
            (
                EVENTS.index(t.event) + 1,
                GRID * GRID if t.end_cell is None else t.end_cell,
                len(COLOURS) if t.new_colour is None else list(COLOURS).index(t.new_colour),
            )
            for t in scene.tracks
        ]
        empty = (0, GRID * GRID, len(COLOURS))
    else:
        shapes = (
            scene.shapes if isinstance(scene, Scene) else [s for t in scene.tracks if (s := t.shape_at(late))]
        )
        events = [(IGNORE, IGNORE, IGNORE)] * len(shapes)
        empty = (IGNORE, IGNORE, IGNORE)
    rows = [[0, *none, cell, background, 0, len(shapes), *empty] for cell in range(GRID * GRID)]
    ranked = sorted(zip(shapes, events, strict=True), key=lambda pair: pair[0].cell)
    for rank, (shape, event) in enumerate(ranked):
        rows[shape.cell][:4] = [
            1,
            list(COLOURS).index(shape.colour),
            KINDS.index(shape.kind),
            list(SHAPE_SIZES).index(shape.size),
        ]
        rows[shape.cell][6] = rank + 1
        rows[shape.cell][8:] = event
    return rows


def cell_features(
    model: PreTrainedModel, family: str, pixels: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Language-model-ready visual features of the grid cells of a batch of pictures (or Qwen clips).

    Args:
        model: A testbed model.
        family: Its family.
        pixels: The image processor's output for ``B`` testbed pictures, or the Qwen2-VL video processor's for
            ``B`` clips.

    Returns:
        ``(features, rows)``: ``[B, T, hidden]`` features of the ``T`` tokens that cover one grid cell each
        (Qwen2-VL: the 9 merged tokens, or 2 x 9 for a clip: first half of the frames, then the second;
        LLaVA-OneVision: 9 base-crop tokens and 9 tile tokens; InternVL: the tile's 9 tokens; Qwen3-VL: the merged
        tokens, then its DeepStack features of the same tokens) and ``[T]`` the label row of each (the cell of a
        picture's token; for a clip, ``cell`` for the first frame pair and ``9 + cell`` for the second).
    """
    import torch

    core = model.model
    if "pixel_values_videos" in pixels:
        out = core.get_video_features(
            pixels["pixel_values_videos"], pixels["video_grid_thw"], return_dict=True
        )
        return _with_deepstack(out, torch.arange(2 * GRID * GRID))
    if family in CLIP_FAMILIES:
        out = core.get_image_features(pixels["pixel_values"], pixels["image_grid_thw"], return_dict=True)
        return _with_deepstack(out, torch.arange(GRID * GRID))
    if family == "internvl":  # one tile per picture, its 9 pixel-shuffled tokens in raster order
        out = core.get_image_features(pixels["pixel_values"], return_dict=True)
        return out.pooler_output, torch.arange(GRID * GRID)
    out = core.get_image_features(
        pixels["pixel_values"],
        pixels["image_sizes"],
        batch_num_images=pixels.get("batch_num_images"),
        return_dict=True,
    )
    index = torch.tensor(_LLAVA_CELL_TOKENS)
    return torch.stack([f[index] for f in out.pooler_output]), torch.arange(len(index)) % (GRID * GRID)


def _with_deepstack(out: Any, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen tower's merged features ``[B, T, hidden]``, then (Qwen3-VL) each DeepStack level's: the features of
    earlier vision layers that the language model adds to its first layers' hidden states, probed like the merged
    ones so that they carry what is in each cell too. ``rows`` (``[T]``) repeats for every level."""
    import torch

    levels = [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())]
    return torch.cat([torch.stack(list(level)) for level in levels], dim=1), rows.repeat(len(levels))


def pretrain_vision(
    model: PreTrainedModel,
    family: str,
    processor: ProcessorMixin,
    steps: int,
    size: SizeConfig,
    seed_offset: int,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Pre-trains the vision tower (and projector/merger) on the world's dense per-cell labels.

    Real VLMs start from a pre-trained vision encoder; here a linear probe on the features of every grid-cell
    token learns what is in the cell (occupied, colour, kind, size), where the cell is, the background, the
    shape's rank and count and, on a Qwen clip's first frame pair, the track's event (see
    :func:`_cell_labels`). The probe is discarded; only the vision weights keep what it taught them. Qwen3-VL's
    DeepStack features (earlier vision layers' tokens, merged by mergers of their own and added to the language
    model's first layers) are probed with the final ones; otherwise their mergers would stay as initialised, since
    the tower is frozen while the language model trains.

    The probe reads RMS-normalised features, so it leaves their scale free, and LLaVA-OneVision's projector
    (Linear-GELU-Linear; InternVL's is the same behind a LayerNorm) grew them to a norm of about 40 against the text embeddings' 1 and Qwen2-VL's merged
    features' 10. Its language model then found a shape by its colour and kind far less reliably (QA 0.90 on 192
    held-out questions against Qwen2-VL's 0.97). For a family in :data:`FEATURE_RMS_CAP` a hinge penalty on
    ``log(rms / cap)`` per token (:func:`rms_penalty`) keeps them at Qwen2-VL's scale; the first LLaVA-OneVision
    build with it answered 188 of those 192 questions, against 173. Qwen2-VL is not capped: its features already
    sit near RMS 1 and its pair passes.

    Args:
        model: The model whose vision tower is trained (in place).
        family: Its family.
        processor: The pair's processor.
        steps: Optimiser steps (0: nothing to do).
        size: The size's config (batch size, learning rate, warm-up).
        seed_offset: First training seed of the pictures (distinct per model).
        on_step: Called with ``(step, loss)`` after every step.

    Returns:
        ``{"steps", "seconds", "loss_first", "loss_last"}``.
    """
    import torch

    from .train import _info, _schedule  # (train imports this module)

    if steps <= 0:
        return _info([], 0.0)
    hidden = model.config.get_text_config().hidden_size
    # A fixed random probe on RMS-normalised features: the features themselves must carry every label as a
    # large, linearly readable component (a trainable probe could read weak directions the LM then struggles with).
    gen = torch.Generator().manual_seed(size.seed + 7)
    probe = torch.linalg.qr(
        torch.randn(hidden, sum(_AUX_CLASSES), generator=gen)
    ).Q.T  # [C, H] orthonormal rows
    params = [p for n, p in model.named_parameters() if is_vision_parameter(n)]
    optimizer = torch.optim.AdamW(params, lr=size.lr, weight_decay=0.0)
    batch_size = 2 * size.batch_size
    start, losses = time.perf_counter(), []
    model.train()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = size.lr * _schedule(step, steps, min(size.warmup, steps // 5 + 1))
        first_seed = seed_offset + step * batch_size
        feats, labels = _probe_batch(model, family, processor, step, first_seed, batch_size)
        loss = _probe_loss(feats, labels, probe, FEATURE_RMS_CAP.get(family))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return _info(losses, time.perf_counter() - start)


def _probe_batch(
    model: PreTrainedModel,
    family: str,
    processor: ProcessorMixin,
    step: int,
    first_seed: int,
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s pictures (or clips), seeds from ``first_seed``: their grid-cell features ``[B, T, H]`` and
    labels ``[B, T, 11]`` (:func:`cell_features`, :func:`_cell_labels`)."""
    import torch

    # Qwen merges frame pairs in its patch embedding, so its tower also learns clips (every other step).
    clips = family in CLIP_FAMILIES and step % 2 == 1
    task = "video_caption" if clips else "image_caption"
    examples = [sample(task, first_seed + i) for i in range(batch_size)]
    if clips:
        pixels = processor.video_processor(videos=[e.video for e in examples], return_tensors="pt")
        label_rows = [_cell_labels(e.scene) + _cell_labels(e.scene, late=True) for e in examples]
    else:
        pixels = processor.image_processor(images=[e.image for e in examples], return_tensors="pt")
        label_rows = [_cell_labels(e.scene) for e in examples]
    feats, rows = cell_features(model, family, pixels)  # [B, T, H], [T]
    return feats, torch.tensor(label_rows)[:, rows]  # [B, T, 11] from [B, 9 or 18, 11]


def _probe_loss(
    feats: torch.Tensor, labels: torch.Tensor, probe: torch.Tensor, rms_cap: float | None
) -> torch.Tensor:
    """The fixed probe's loss on RMS-normalised ``feats`` ``[B, T, H]`` (``probe``: ``[C, H]``), plus the
    :func:`rms_penalty` above ``rms_cap`` when there is one."""
    import torch
    import torch.nn.functional as F

    counted = (labels != IGNORE).sum((0, 1)).clamp(min=1)  # [11] labelled tokens per column
    normed = feats.float() * torch.rsqrt(feats.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    logits = (normed @ probe.T).split(_AUX_CLASSES, dim=-1)
    loss = sum(  # mean cross-entropy over each column's labelled tokens (0 where a column has none)
        w * F.cross_entropy(lg.flatten(0, 1), labels[..., i].flatten(), reduction="sum") / counted[i]
        for i, (lg, w) in enumerate(zip(logits, _AUX_WEIGHTS, strict=True))
    )
    return loss if rms_cap is None else loss + rms_penalty(feats, rms_cap)


def is_vision_parameter(name: str) -> bool:
    """Whether parameter ``name`` belongs to the vision tower or its projector/merger (what this pre-trains)."""
    return any(key in name for key in ("visual", "vision_tower", "multi_modal_projector", "image_newline"))
