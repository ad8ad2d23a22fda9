"""Language-model shapes of the calibrations (:mod:`vlmspec.testbed.calibrate`): the real bodies they mirror, the
named calibrations, parameter counts, and the shape an exact inflation of a trained model needs."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformers import PreTrainedModel

__all__ = [
    "CALIBRATIONS",
    "CPU_TARGET",
    "REAL_BODIES",
    "Calibration",
    "LMShape",
    "body_parameters",
    "exact_shape",
    "get_calibration",
    "kv_copies",
    "lm_shape",
]


@dataclass(frozen=True)
class LMShape:
    """Shape of a Qwen2-style language model.

    Attributes:
        hidden: Residual width.
        intermediate: MLP width.
        layers: Decoder layers.
        heads: Query heads.
        kv_heads: Key/value heads (divides ``heads``).
        head_dim: Attention head width (``hidden / heads``, as in every Qwen2 checkpoint).
        vocab: Vocabulary rows (``None``: keep the model's own).
        tied: Whether the real model ties its LM head to its embedding (counts only).
        name: What it is (``"Qwen2-7B"``, ...).
        qk_norm: Qwen3-style attention: RMS norms on each head's queries and keys, no query/key/value biases.
        interleaved_rope: Qwen3-VL's M-RoPE, its sections interleaved pair by pair (widening limits: see
            :func:`exact_shape`).
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int | None = None
    tied: bool = False
    name: str = ""
    qk_norm: bool = False
    interleaved_rope: bool = False

    def __post_init__(self) -> None:
        fields = ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim")
        bad = [
            f"{f}={getattr(self, f)!r}"
            for f in fields
            if not (isinstance(getattr(self, f), int) and getattr(self, f) > 0)
        ]
        if bad:
            raise InvalidInputError(f"LMShape {self.name!r}: {', '.join(bad)} must be positive integers")
        if self.heads % self.kv_heads or self.heads * self.head_dim != self.hidden:
            raise InvalidInputError(
                f"LMShape {self.name!r}: heads={self.heads} must be a multiple of kv_heads={self.kv_heads} and "
                f"heads * head_dim ({self.heads * self.head_dim}) must equal hidden={self.hidden} (Qwen2-VL "
                "derives the head width from them)"
            )


REAL_BODIES: dict[str, LMShape] = {
    shape.name: shape
    for shape in (
        LMShape(3584, 18944, 28, 28, 4, 128, vocab=152064, name="Qwen2-7B"),  # Qwen2-VL-7B, Qwen2.5-VL-7B
        LMShape(1536, 8960, 28, 12, 2, 128, vocab=151936, tied=True, name="Qwen2-1.5B"),  # Qwen2-VL-2B
        LMShape(2048, 11008, 36, 16, 2, 128, vocab=151936, tied=True, name="Qwen2.5-3B"),  # Qwen2.5-VL-3B
        LMShape(896, 4864, 24, 14, 2, 64, vocab=151936, tied=True, name="Qwen2-0.5B"),  # LLaVA-OV-0.5B
        LMShape(4096, 12288, 36, 32, 8, 128, vocab=151936, qk_norm=True, name="Qwen3-VL-8B"),
        LMShape(2048, 6144, 28, 16, 8, 128, vocab=151936, tied=True, qk_norm=True, name="Qwen3-VL-2B"),
    )
}
"""Language-model bodies of real checkpoints (their ``config.json`` text settings). LLaVA-OneVision-7B's is
Qwen2-7B with a 152128-row vocabulary; InternVL3-8B's and -1B's are Qwen2.5-7B's and -0.5B's (the shapes of
Qwen2-7B and -0.5B) with InternVL's 151674-row vocabulary. Qwen3-VL's are Qwen3 bodies (``qk_norm``)."""

CPU_TARGET = LMShape(1024, 2816, 8, 8, 8, 128, name="cpu-105M")


@dataclass(frozen=True)
class Calibration:
    """A named calibration: the shape the target (and the draft) are inflated to.

    Attributes:
        name: The suffix after ``@`` in a pair name.
        target: Target language-model shape.
        draft: Draft shape (``None``: the trained draft as it is).
        mirrors: The real pair whose costs it reproduces.
        why: One line for the demo.
    """

    name: str
    target: LMShape
    draft: LMShape | None
    mirrors: str
    why: str


def _body(name: str, **changes: Any) -> LMShape:
    return replace(REAL_BODIES[name], **changes)


CALIBRATIONS: dict[str, Calibration] = {
    c.name: c
    for c in (
        Calibration(
            "cpu", CPU_TARGET, None, "a 7B/0.5B pair's cost ratio, on a 2-core CPU",
            "the trained target inflated exactly (zero-padded weights, same outputs) to 105M parameters, so that one "
            "target forward costs 15-25 draft forwards on a 2-core CPU, as a real 7B target costs against a small draft",
        ),
        Calibration(
            "ci", LMShape(256, 512, 5, 8, 8, 32, vocab=1024), LMShape(128, 256, 3, 4, 2, 32, vocab=1024),
            "nothing real: small shapes for tests",
            "small shapes that exercise every mapping (head width, GQA, depth, padded vocabulary) in seconds",
        ),
        Calibration(
            "7b-2b", _body("Qwen2-7B"), _body("Qwen2-1.5B", vocab=152064), "Qwen2-VL-7B / Qwen2-VL-2B",
            "language models inflated exactly to Qwen2-VL-7B's and -2B's shapes",
        ),
        Calibration(
            "7b-3b", _body("Qwen2-7B"), _body("Qwen2.5-3B", vocab=152064), "Qwen2.5-VL-7B / Qwen2.5-VL-3B",
            "language models inflated exactly to Qwen2.5-VL-7B's and -3B's shapes",
        ),
        Calibration(
            "7b-0.5b", _body("Qwen2-7B", vocab=152128), _body("Qwen2-0.5B", vocab=152128),
            "LLaVA-OneVision-7B / -0.5B",
            "language models inflated exactly to LLaVA-OneVision-7B's and -0.5B's shapes",
        ),
        Calibration(
            "8b-2b", _body("Qwen3-VL-8B"), _body("Qwen3-VL-2B"), "Qwen3-VL-8B / Qwen3-VL-2B",
            "language models inflated exactly to Qwen3-VL-8B's and -2B's shapes",
        ),
        Calibration(
            "8b-1b", _body("Qwen2-7B", vocab=151674), _body("Qwen2-0.5B", vocab=151674),
            "InternVL3-8B / InternVL3-1B",
            "language models inflated exactly to InternVL3-8B's and -1B's shapes (Qwen2.5-7B and -0.5B bodies)",
        ),
    )
}  # fmt: skip
"""Every calibration, by the name used after ``@`` (``testbed-base@cpu``, ``testbed-base:llava_onevision@7b-0.5b``).

A draft's vocabulary is padded to its target's (a few hundred rows more than the real draft's): transformers'
assisted generation, one of the bench's baselines, refuses a draft whose vocabulary size differs."""


def get_calibration(name: str) -> Calibration:
    """The :class:`Calibration` named ``name``, or a ``ValueError`` listing the valid names."""
    if name not in CALIBRATIONS:
        raise InvalidInputError(f"unknown calibration {name!r}; valid: {', '.join(CALIBRATIONS)}")
    return CALIBRATIONS[name]


def lm_shape(model: PreTrainedModel) -> LMShape:
    """The language-model shape of a testbed model (its language model is a Qwen2, or Qwen3-VL's Qwen3)."""
    t = model.config.get_text_config()
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    return LMShape(
        t.hidden_size, t.intermediate_size, t.num_hidden_layers, t.num_attention_heads,
        t.num_key_value_heads, head_dim, vocab=t.vocab_size, tied=bool(model.config.tie_word_embeddings),
        qk_norm=t.model_type.startswith("qwen3"),
        interleaved_rope=bool((getattr(t, "rope_parameters", None) or {}).get("mrope_interleaved")),
    )  # fmt: skip


def body_parameters(shape: LMShape) -> int:
    """Parameters of a Qwen2 (or, with ``qk_norm``, Qwen3) language-model body (layers and final norm; vocabulary
    aside)."""
    q = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    extra = 2 * shape.head_dim if shape.qk_norm else q + 2 * kv  # query/key norms, or query/key/value biases
    attention = shape.hidden * (q + 2 * kv) + extra + q * shape.hidden
    layer = attention + 3 * shape.hidden * shape.intermediate + 2 * shape.hidden
    return shape.layers * layer + shape.hidden


def kv_copies(old_heads: int, old_kv: int, new_heads: int, new_kv: int) -> int:
    """New key/value heads each old one needs, or 0 when ``new_kv`` cannot hold them all."""
    copies = math.ceil((old_heads // old_kv) / (new_heads // new_kv))
    return copies if old_kv * copies <= new_kv else 0


def exact_shape(old: LMShape, shape: LMShape) -> LMShape:
    """``shape``, with more key/value heads (and a narrower MLP) where exact inflation of ``old`` needs them.

    The key/value heads become the smallest divisor of ``shape.heads`` that holds every old key/value head's
    copies (see the module docstring); the MLP loses as many parameters as the extra heads add, so
    :func:`body_parameters` stays within 1% of ``shape``'s.

    Raises:
        ValueError: When ``old`` does not fit in ``shape`` (a smaller dimension, or a head width that is not a
            multiple of the old one, or, with ``old.interleaved_rope``, not ``c`` times it with ``c % 3 == 1``).
    """
    smaller = [
        f"{f} {getattr(old, f)} > {getattr(shape, f)}"
        for f in ("hidden", "intermediate", "layers", "heads", "head_dim")
        if getattr(old, f) > getattr(shape, f)
    ]
    if smaller or shape.head_dim % old.head_dim or (shape.vocab or 0) and shape.vocab < (old.vocab or 0):
        raise InvalidInputError(
            f"cannot inflate {old} to {shape.name or shape}: "
            + ("; ".join(smaller) or "head_dim must be a multiple of the old one and vocab not smaller")
        )
    c = shape.head_dim // old.head_dim
    if old.interleaved_rope and c % 3 != 1:
        raise InvalidInputError(
            f"cannot inflate heads {old.head_dim} wide to {shape.head_dim} ({shape.name or shape}): interleaved "
            f"M-RoPE (Qwen3-VL) keeps each rotary pair on its axis only when the width grows by a factor c with "
            f"c % 3 == 1, not {c}"
        )
    for kv in range(shape.kv_heads, shape.heads + 1):
        if shape.heads % kv == 0 and kv_copies(old.heads, old.kv_heads, shape.heads, kv):
            break
    if kv == shape.kv_heads:
        return shape
    extra = 2 * (kv - shape.kv_heads) * shape.head_dim * (shape.hidden + 1) * shape.layers
    narrower = shape.intermediate - round(extra / (3 * shape.hidden * shape.layers))
    return replace(shape, kv_heads=kv, intermediate=max(narrower, old.intermediate), name=f"{shape.name}*")
