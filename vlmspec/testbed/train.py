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
from .vision import is_vision_parameter, pretrain_vision
from .world import TASKS, Example, sample

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
    "train_draft",
    "train_target",
]

TRAIN_SEED_OFFSET = 1_000_000_000
"""Training scenes use seeds from here up; smaller seeds are held out."""

FAMILY_HEAD_DIM: dict[str, int] = {"qwen3_vl": 32}
"""Per family, the language models' head width where it differs from the size's (see :func:`model_spec`).

Qwen3-VL interleaves M-RoPE's sections rotary pair by pair (temporal, height, width, temporal, ...), so a
calibration (:mod:`vlmspec.testbed.calibrate`) widens its heads exactly only by a factor ``c`` with ``c % 3 == 1``,
which keeps every pair on its axis: 32 -> 128 (x4) does, 16 -> 128 (x8) does not. Its mini pair's heads are 32 wide
already; the base target gets 4 heads of 32 instead of 8 of 16 (the same width and parameters)."""
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
            :func:`~vlmspec.testbed.vision.pretrain_vision`).
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


def _spec(**shape: int) -> ModelSpec:
    """A testbed model of ``shape``: every one has 2 vision heads and starts from weights of std 0.08."""
    return ModelSpec(**shape, vision_heads=2, init_std=0.08)


SIZES: dict[str, SizeConfig] = {
    "base": SizeConfig(
        name="base",
        target=_spec(hidden=128, layers=4, kv_heads=8, intermediate=384, head_dim=16, vision_hidden=64,
                     vision_layers=3),
        draft=_spec(hidden=64, layers=2, kv_heads=1, intermediate=192, vision_hidden=32, vision_layers=1),
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
        target=_spec(hidden=128, layers=3, kv_heads=2, intermediate=256, vision_hidden=48, vision_layers=1),
        draft=_spec(hidden=64, layers=1, kv_heads=1, intermediate=128, vision_hidden=32, vision_layers=1),
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
        param.requires_grad_(not is_vision_parameter(name))
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
