"""Deterministic CPU training of a testbed pair: a target on the world's texts, a draft distilled from it.

* **Target**: next-token cross-entropy on the assistant reply (and its closing ``<|im_end|>``) of chat-formatted
  prompts with the picture/clip, on freshly sampled scenes (seeds from ``TRAIN_SEED_OFFSET`` up, never those
  the quality gates or benchmarks draw).
* **Draft**: smaller language model *and* vision tower, distilled from the trained target (KL from the target's
  next-token distributions on the same batches, as in EDD) for fewer steps, so it agrees with the target often
  but is clearly weaker.

Determinism: seeded initialisation and data, a fixed torch thread count per size,
``torch.use_deterministic_algorithms``; the same seed on the same machine gives the same weights.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from .data import IGNORE, encode
from .models import ModelSpec, build_model
from .world import BACKGROUNDS, COLOURS, EVENTS, GRID, KINDS, MAX_SHAPES, TASKS, Clip, Example, Scene, sample
from .world import SIZES as SHAPE_SIZES

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel, ProcessorMixin

__all__ = [
    "FAMILY_HEAD_DIM",
    "QA_RICH_CYCLE",
    "SIZES",
    "TASK_CYCLE",
    "TRAIN_SEED_OFFSET",
    "SizeConfig",
    "get_size",
    "model_spec",
    "pretrain_vision",
    "rms_penalty",
    "train_draft",
    "train_target",
]

TRAIN_SEED_OFFSET = 1_000_000_000
"""Training scenes use seeds from here up; smaller seeds are held out."""

CLIP_FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""Families whose patch embedding merges frame pairs (Qwen's temporal patches): their towers also learn clips in
vision pre-training (see :func:`pretrain_vision`)."""
FAMILY_HEAD_DIM: dict[str, int] = {"qwen3_vl": 32}
"""Per family, the language models' head width where it differs from the size's (see :func:`model_spec`).

Qwen3-VL interleaves M-RoPE's sections rotary pair by pair (temporal, height, width, temporal, ...), so a
calibration (:mod:`vlmspec.testbed.calibrate`) widens its heads exactly only by a factor ``c`` with ``c % 3 == 1``,
which keeps every pair on its axis: 32 -> 128 (x4) does, 16 -> 128 (x8) does not. Its mini pair's heads are 32 wide
already; the base target gets 4 heads of 32 instead of 8 of 16 (the same width and parameters)."""
FEATURE_RMS_CAP: dict[str, float] = {"llava_onevision": 1.0, "internvl": 1.0}
"""Per family, the largest RMS a visual feature may reach in vision pre-training (a hinge penalty above it; a
family not listed is not capped). See :func:`pretrain_vision`."""

TASK_CYCLE: tuple[str, ...] = ("image_caption", "image_qa", "video_caption", "image_qa")
"""Default task order: training step ``i`` does ``cycle[i % len(cycle)]`` (QA batches are short and cheap)."""

QA_RICH_CYCLE: tuple[str, ...] = (
    "image_caption", "image_qa", "image_qa", "video_caption", "image_qa", "image_qa",
)  # fmt: skip
"""The ``base`` order: two QA steps per caption step. A QA step costs about a third of a caption step, and
finding one shape among several (the lookups QA asks for) is what the base targets learn last."""


@dataclass(frozen=True)
class SizeConfig:
    """Everything that defines a testbed size.

    Attributes:
        name: ``"base"`` or ``"mini"``.
        target: Target model shape.
        draft: Draft model shape.
        target_steps: Optimiser steps of the target.
        draft_steps: Distillation steps of the draft.
        vision_steps: Vision-tower pre-training steps of the target and of the draft (see
            :func:`pretrain_vision`).
        batch_size: Examples per step.
        lr: Peak AdamW learning rate (linear warm-up over ``warmup`` steps, cosine decay to 10%).
        warmup: Warm-up steps.
        eval_examples: Held-out examples per task for the quality figures.
        seed: Seed of initialisation and training data.
        task_cycle: Task of each training step, in a repeating cycle (see :data:`TASK_CYCLE`).
        threads: Torch threads of the whole build. Fixed per size, so the weights do not depend on the
            machine's core count (a different thread count splits float reductions differently).
        gates: Minimum target ``caption_accuracy`` / ``qa_exact_match`` / ``video_accuracy``, minimum
            ``entropy_autocorr``, minimum ``draft_agreement``, and the margin by which the draft's
            mean of ``caption_accuracy``, ``qa_exact_match`` and ``video_accuracy`` must trail the target's
            (``draft_gap``).
    """

    name: str
    target: ModelSpec
    draft: ModelSpec
    target_steps: int
    draft_steps: int
    vision_steps: tuple[int, int]
    batch_size: int
    lr: float
    warmup: int
    eval_examples: int
    seed: int = 0
    task_cycle: tuple[str, ...] = TASK_CYCLE
    threads: int = 1
    gates: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        unknown = [t for t in self.task_cycle if t not in TASKS]
        if not self.task_cycle or unknown:
            raise ValueError(
                f"SizeConfig {self.name!r}: task_cycle {self.task_cycle!r} must be a non-empty sequence of "
                f"{', '.join(TASKS)}."
            )
        if self.threads < 1:
            raise ValueError(f"SizeConfig {self.name!r}: threads must be >= 1, got {self.threads}.")


SIZES: dict[str, SizeConfig] = {
    "base": SizeConfig(
        name="base",
        target=ModelSpec(hidden=128, layers=4, kv_heads=8, intermediate=384, head_dim=16, vision_hidden=64,
                         vision_layers=3, vision_heads=2, init_std=0.08),
        draft=ModelSpec(hidden=64, layers=2, kv_heads=1, intermediate=192, vision_hidden=32, vision_layers=1,
                        vision_heads=2, init_std=0.08),
        target_steps=5400,
        draft_steps=900,
        vision_steps=(800, 150),
        batch_size=32,
        lr=3e-3,
        warmup=100,
        eval_examples=64,
        task_cycle=QA_RICH_CYCLE,
        threads=2,  # the ~20 minutes per pair are for 2 cores; 2 threads train about 1.45x faster than 1
        gates=(("caption_accuracy", 0.95), ("qa_exact_match", 0.95), ("video_accuracy", 0.8),
               ("entropy_autocorr", 0.3), ("draft_agreement", 0.6), ("draft_gap", 0.05)),
    ),
    "mini": SizeConfig(
        name="mini",
        target=ModelSpec(hidden=128, layers=3, kv_heads=2, intermediate=256, vision_hidden=48, vision_layers=1,
                         vision_heads=2, init_std=0.08),
        draft=ModelSpec(hidden=64, layers=1, kv_heads=1, intermediate=128, vision_hidden=32, vision_layers=1,
                        vision_heads=2, init_std=0.08),
        target_steps=450,
        draft_steps=120,
        vision_steps=(150, 40),
        batch_size=24,
        lr=3e-3,
        warmup=30,
        eval_examples=24,
        gates=(("caption_accuracy", 0.5), ("qa_exact_match", 0.6), ("entropy_autocorr", 0.3),
               ("draft_agreement", 0.5), ("draft_gap", 0.05)),
    ),
}  # fmt: skip
"""The testbed sizes: ``base`` (benchmarks, demo; <= ~20 min per pair) and ``mini`` (CI; <= ~2 min)."""


def model_spec(family: str, size: SizeConfig, role: str) -> ModelSpec:
    """The shape of ``family``'s ``role`` (``"target"`` or ``"draft"``) at ``size``: the size's, with the head
    width of :data:`FAMILY_HEAD_DIM` (and at most one key/value head per query head)."""
    spec: ModelSpec = getattr(size, role)
    head_dim = FAMILY_HEAD_DIM.get(family, spec.head_dim)
    return replace(spec, head_dim=head_dim, kv_heads=min(spec.kv_heads, spec.hidden // head_dim))


def get_size(size: str) -> SizeConfig:
    """Returns the :class:`SizeConfig` named ``size`` or raises ``ValueError`` naming the known sizes."""
    if size not in SIZES:
        raise ValueError(f"Unknown testbed size {size!r}; expected one of {', '.join(SIZES)}.")
    return SIZES[size]


@contextlib.contextmanager
def deterministic(threads: int = 1) -> Iterator[None]:
    """One (fixed) torch thread count and deterministic algorithms; both restored afterwards."""
    import torch

    old_threads = torch.get_num_threads()
    old_det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


CURRICULUM: tuple[tuple[float, int], ...] = ((0.15, 1), (0.35, 2), (1.0, 3))
"""``(fraction of the steps, most shapes per scene)``: one shape first (what is seen maps to words without any
binding), then two, then the full world (which shape is where must be bound)."""


def max_shapes_at(step: int, steps: int) -> int:
    """Most shapes per training scene at ``step`` of ``steps`` (see :data:`CURRICULUM`)."""
    return next(n for fraction, n in CURRICULUM if step < fraction * steps)


def training_batch(
    step: int, batch_size: int, steps: int | None = None, cycle: tuple[str, ...] = TASK_CYCLE
) -> list[Example]:
    """The examples of training step ``step`` (the target's and the draft's step ``i`` see the same ones).

    Args:
        step: Step index.
        batch_size: Examples per step.
        steps: Total steps of the run (for the :data:`CURRICULUM`); ``None``: the full world throughout.
        cycle: Task order (step ``i`` does ``cycle[i % len(cycle)]``).
    """
    task = cycle[step % len(cycle)]
    first = TRAIN_SEED_OFFSET + step * batch_size
    limit = max_shapes_at(step, steps) if steps else CURRICULUM[-1][1]
    if task == "image_qa":
        return [_training_question(first + i, limit, lookup=i % 4 != 3) for i in range(batch_size)]
    return [sample(task, first + i, max_shapes=limit) for i in range(batch_size)]


LOOKUP_CANDIDATES = 8
"""Seeds tried per training slot that asks for a lookup question (see :func:`_training_question`)."""


def is_lookup(example: Example) -> bool:
    """Whether a question asks to find one shape among several by what it is (its position or colour)."""
    asks = example.prompt.startswith("Where is") or (
        example.prompt.startswith("What color is the") and not example.prompt.endswith("background?")
    )
    return asks and len(example.scene.shapes) > 1


def _training_question(seed: int, max_shapes: int, lookup: bool) -> Example:
    """A training question: the world's own mix, or (``lookup``) the first lookup among a few candidate seeds.

    Lookups (``Where is the red circle?`` / ``What color is the square?`` in a scene of several shapes) teach
    the language model to find a shape by its attributes, the hardest skill QA asks for, yet they are under a
    third of the world's questions and have one- or two-token answers; three slots in four of every training QA
    batch are therefore lookups (the fourth keeps the world's mix, so counts and backgrounds are still learned).
    A lookup slot prefers a ``Where is the <colour> <kind>?`` question (matching two attributes at once is what
    the targets learned last; single-attribute colour questions were already near 100%).
    Evaluation draws from the world's own mix. Candidate seeds ``4 * TRAIN_SEED_OFFSET + 8 * seed + j`` are
    disjoint from every other training seed.
    """
    if lookup and max_shapes > 1:
        base = 4 * TRAIN_SEED_OFFSET + LOOKUP_CANDIDATES * seed
        drafts = [
            sample("image_qa", c, max_shapes=max_shapes, render=False)
            for c in range(base, base + LOOKUP_CANDIDATES)
        ]
        # the first "Where" lookup, else the first lookup
        best = min(
            (e for e in drafts if is_lookup(e)), key=lambda e: not e.prompt.startswith("Where"), default=None
        )
        if best is not None:
            return sample("image_qa", best.seed, max_shapes=max_shapes)
    return sample("image_qa", seed, max_shapes=max_shapes)


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def _optimizer(model: PreTrainedModel, lr: float) -> torch.optim.Optimizer:
    import torch

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in params if not (p.ndim >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.98), eps=1e-8)


def _reply_logits(model: PreTrainedModel, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[N, V]`` predicting the ``N`` reply tokens of the batch, and those tokens ``[N]``."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits[:, :-1]  # [B, L-1, V]
    labels = batch["labels"][:, 1:]  # [B, L-1]
    mask = labels != IGNORE
    return logits[mask].float(), labels[mask]


def _run(
    model: PreTrainedModel,
    steps: int,
    size: SizeConfig,
    processor: ProcessorMixin,
    loss_fn: Callable[[dict[str, Any]], torch.Tensor],
    lr: float,
    on_step: Callable[[int, float], None] | None,
) -> list[float]:
    import torch

    for name, param in model.named_parameters():  # the pre-trained vision tower stays frozen, as in LLaVA
        param.requires_grad_(not _is_vision(name))
    optimizer = _optimizer(model, lr)
    model.train()
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * _schedule(step, steps, size.warmup)
        batch = encode(processor, training_batch(step, size.batch_size, steps, size.task_cycle))
        loss = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, losses[-1])
    for param in model.parameters():
        param.requires_grad_(True)
    model.eval()
    return losses


def train_target(
    family: str,
    size: SizeConfig,
    processor: ProcessorMixin,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Trains the target with reply cross-entropy.

    Args:
        family: One of :data:`FAMILIES`.
        size: The size's config.
        processor: The pair's processor.
        on_step: Called with ``(step, loss)`` after every step (progress bars).

    Returns:
        ``(model, info)`` with ``info`` = steps, seconds, first/last mean losses.
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(size.seed)
    model = build_model(family, model_spec(family, size, "target"), processor.tokenizer)
    vision = pretrain_vision(
        model, family, processor, size.vision_steps[0], size, 2 * TRAIN_SEED_OFFSET, on_step
    )

    def loss_fn(batch: dict[str, Any]) -> torch.Tensor:
        logits, labels = _reply_logits(model, batch)
        return F.cross_entropy(logits, labels)

    start = time.perf_counter()
    losses = _run(model, size.target_steps, size, processor, loss_fn, size.lr, on_step)
    return model, {**_info(losses, time.perf_counter() - start), "vision_pretraining": vision}


def train_draft(
    family: str,
    size: SizeConfig,
    processor: ProcessorMixin,
    teacher: PreTrainedModel,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Distils the draft from ``teacher``: KL(teacher || draft) on the reply tokens of the same batches.

    Args:
        teacher: The trained target; the other arguments are :func:`train_target`'s.

    Returns:
        ``(model, info)`` as :func:`train_target`.
    """
    import torch
    import torch.nn.functional as F

    torch.manual_seed(size.seed + 1)
    model = build_model(family, model_spec(family, size, "draft"), processor.tokenizer)
    vision = pretrain_vision(
        model, family, processor, size.vision_steps[1], size, 3 * TRAIN_SEED_OFFSET, on_step
    )
    teacher.eval()

    def loss_fn(batch: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits, _ = _reply_logits(teacher, batch)
        logits, _ = _reply_logits(model, batch)
        return F.kl_div(
            logits.log_softmax(-1), teacher_logits.log_softmax(-1), log_target=True, reduction="batchmean"
        )

    start = time.perf_counter()
    losses = _run(model, size.draft_steps, size, processor, loss_fn, size.lr, on_step)
    return model, {**_info(losses, time.perf_counter() - start), "vision_pretraining": vision}


def _info(losses: list[float], seconds: float) -> dict[str, Any]:
    window = max(1, min(50, len(losses) // 5))
    return {
        "steps": len(losses),
        "seconds": round(seconds, 1),
        "loss_first": round(sum(losses[:window]) / window, 4),
        "loss_last": round(sum(losses[-window:]) / window, 4),
    }


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

    if steps <= 0:
        return _info([], 0.0)
    hidden = model.config.get_text_config().hidden_size
    # A fixed random probe on RMS-normalised features: the features themselves must carry every label as a
    # large, linearly readable component (a trainable probe could read weak directions the LM then struggles with).
    gen = torch.Generator().manual_seed(size.seed + 7)
    probe = torch.linalg.qr(
        torch.randn(hidden, sum(_AUX_CLASSES), generator=gen)
    ).Q.T  # [C, H] orthonormal rows
    params = [p for n, p in model.named_parameters() if _is_vision(n)]
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


def _is_vision(name: str) -> bool:
    return any(key in name for key in ("visual", "vision_tower", "multi_modal_projector", "image_newline"))
