"""Calibrated testbed pairs: a trained model inflated, exactly, to the cost of a real language model.

The trained testbed target costs about twice its draft; a real 7B/0.5B pair costs 10-20x. Speed-ups measured in
the first world mean nothing, so :func:`inflate` widens and deepens a trained model's language model to a named
shape without changing the function it computes: the new weights are zero (or copies), so the inflated model's
greedy output is token-for-token the trained model's, while every forward does the matrix work of the bigger
shape. The work is real: zero weights cost as much as any others in a dense matmul.

How each part is kept exact (``h``/``H``: old/new hidden size, ``d``/``D``: old/new head width, ``c = D / d``):

* **Hidden size.** The residual stream is padded with zeros: embeddings, projector/merger outputs and
  LLaVA-OneVision's ``image_newline`` fill the first ``h`` channels; every layer writes only those. RMSNorm
  divides by ``sqrt(mean(x^2) + eps)`` over ``H`` channels, ``h / H`` of the old mean, so each norm weight is
  scaled by ``sqrt(h / H)`` and ``rms_norm_eps`` by ``h / H``: ``sqrt(h/H) * sqrt(mean_h + eps)`` is then the old
  denominator times ``sqrt(h/H)``, which the weight cancels.
* **Head width and rotary (M-RoPE) sections.** Rotary pairs dimension ``j`` with ``j + D/2`` at frequency
  ``theta^(-2j/D)``. Old pair ``j`` goes to new pair ``c * j``, whose frequency ``theta^(-2cj/D)`` equals the old
  ``theta^(-2j/d)``, so ``rope_theta`` is unchanged, and M-RoPE's sections scale by ``c`` (``[2, 3, 3]`` at
  ``d = 16`` becomes Qwen2-VL's real ``[16, 24, 24]`` at ``D = 128``), keeping each pair in its temporal/height/
  width section. ``D`` must be a multiple of ``d``. Attention scales scores by ``D^-0.5``, so the query weights
  and biases are multiplied by ``sqrt(D / d)``. Value heads use their first ``d`` dimensions.
* **Qwen3-VL** normalises each head's queries and keys (RMSNorm over the head width, with the model's one
  ``rms_norm_eps``) and interleaves M-RoPE's sections pair by pair (temporal, height, width, temporal, ...). The
  interleaving keeps old pair ``j`` on its axis at ``c * j`` only when ``c % 3 == 1`` (so the testbed trains its
  Qwen3-VL heads 32 wide: ``c = 4`` to the real 128; see :data:`~vlmspec.testbed.train.FAMILY_HEAD_DIM`), and the
  section bounds scale by ``c`` as above (``[6, 5, 5]`` becomes the real ``[24, 20, 20]``). A head's RMS over ``D``
  dimensions is ``d / D`` of the old one's, but ``eps`` went to ``eps * h / H`` for the hidden size; so the query
  and key weights are multiplied by ``s = sqrt((h / H) * (D / d))``, which makes the norm's denominator
  ``sqrt(h / H) * sqrt(mean_d + eps)`` and its output ``sqrt(D / d)`` times the old one: the key norm's weight is
  scaled by ``sqrt(d / D)`` to cancel it, the query norm's keeps it (it is the ``sqrt(D / d)`` the attention scale
  needs). The first layers stay in place, one per DeepStack level (the vision tower's features are added to the
  residual stream after language-model layer ``0``, ``1``, ...); the others are spread over the rest.
* **Heads and GQA grouping.** Each old key/value head is copied into as many new key/value heads as its query
  group needs (``ceil(old group / new group)``); its query heads fill those groups' slots; all other heads are
  zero (uniform attention over zero values: zero output). Two old key/value heads cannot share one new head,
  because every rotary pair of a head has its own frequency. When the named shape has too few key/value heads
  for that (the base target has 8 distinct ones, a 7B body 4), :func:`exact_shape` raises them to the smallest
  count that divides the query heads and works, and narrows the MLP by the same number of parameters, so the
  parameter count stays within 1% of the named body. It is reported with every calibrated pair.
* **Layers.** The old layers are spread evenly over the new depth; the others have zero output projections, so
  they add nothing to the residual stream (``x + 0 == x`` exactly). **MLP**: extra rows/columns zero
  (``silu(0) * 0 = 0``). **Biases** (query/key/value) are mapped like their rows.
* **Vocabulary.** Real shapes pad the vocabulary to the real size (its embedding and LM-head cost is a large part
  of a small draft's). Padded embedding rows are zero (the tokenizer never produces their ids). Padded LM-head
  rows are copies of the row of a token the model never emits (the image placeholder), so a padded logit always
  *equals* that token's logit: argmax returns the first maximal index, so a padded id can never win a greedy
  step (it would need to beat a lower id that has the same logit), and ``suppress_tokens`` in the generation
  config gives them probability 0 when sampling (``generate()`` and :mod:`vlmspec.sampling` both apply it).
* **Vision tower**: unchanged (the calibration is of the language model, where decoding spends its time).

Parameter counts are compared "vocabulary aside": the language-model body (layers and final norm) of the
inflated model against the real one's; the embedding and LM head are reported separately.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidInputError
from .shapes import (
    CALIBRATIONS,
    REAL_BODIES,
    Calibration,
    LMShape,
    body_parameters,
    exact_shape,
    get_calibration,
    kv_copies,
    lm_shape,
)

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel

__all__ = [
    "CALIBRATIONS",
    "REAL_BODIES",
    "Calibration",
    "LMShape",
    "body_parameters",
    "calibrate",
    "exact_shape",
    "get_calibration",
    "inflate",
    "inflate_edd",
    "lm_shape",
]


def _rotary_slots(d: int, c: int) -> list[int]:
    """New position of each old head dimension: rotary pair ``j`` (``j``, ``j + d/2``) goes to pair ``c * j``."""
    half = d // 2
    return [c * a if a < half else c * half + c * (a - half) for a in range(d)]


@dataclass(frozen=True)
class _HeadMap:
    """Where old heads go: ``query[i]`` new query head of old query head ``i``; ``kv[r]`` the old key/value
    head new key/value head ``r`` copies (``-1``: none); ``rows[a]`` new position of old dimension ``a``."""

    query: list[int]
    kv: list[int]
    rows: list[int]


def _head_map(old: LMShape, new: LMShape) -> _HeadMap:
    group, new_group = old.heads // old.kv_heads, new.heads // new.kv_heads
    copies = kv_copies(old.heads, old.kv_heads, new.heads, new.kv_heads)
    kv = [-1] * new.kv_heads
    query = []
    for i in range(old.heads):
        m, j = divmod(i, group)
        r = m * copies + j // new_group
        kv[r] = m
        query.append(r * new_group + j % new_group)
    return _HeadMap(query, kv, _rotary_slots(old.head_dim, new.head_dim // old.head_dim))


def _new_config(model: PreTrainedModel, old: LMShape, new: LMShape) -> Any:
    config = copy.deepcopy(model.config)
    text = config.get_text_config()
    c = new.head_dim // old.head_dim
    text.hidden_size = new.hidden
    text.intermediate_size = new.intermediate
    text.num_hidden_layers = new.layers
    text.num_attention_heads = new.heads
    text.num_key_value_heads = new.kv_heads
    text.head_dim = new.head_dim
    text.vocab_size = new.vocab or old.vocab
    text.rms_norm_eps = text.rms_norm_eps * old.hidden / new.hidden
    if getattr(text, "layer_types", None):
        text.layer_types = [text.layer_types[0]] * new.layers
    rope = dict(text.rope_parameters)
    if "mrope_section" in rope:
        rope["mrope_section"] = [c * s for s in rope["mrope_section"]]
    text.rope_parameters = rope
    vision = getattr(config, "vision_config", None)
    # the Qwen mergers' output width is the language model's (the others read it from the text config)
    if config.model_type == "qwen2_vl" and vision is not None:
        vision.hidden_size = new.hidden
    elif config.model_type in ("qwen2_5_vl", "qwen3_vl") and vision is not None:
        vision.out_hidden_size = new.hidden
    return config


def _layer_positions(old_layers: int, new_layers: int, fixed: int = 0) -> list[int]:
    """New index of each old layer: the first ``fixed`` stay in place, the others spread evenly over the rest."""
    spread = range(old_layers - fixed)
    return list(range(fixed)) + [fixed + i * (new_layers - fixed) // len(spread) for i in spread]


def _deepstack_levels(model: PreTrainedModel) -> int:
    """Language-model layers after which Qwen3-VL adds vision features (DeepStack); 0 for the other families."""
    vision = getattr(model.config, "vision_config", None)
    return len(getattr(vision, "deepstack_visual_indexes", None) or ())


class _Filler:
    """Writes an old model's weights into a new model's zeroed state, dimension by dimension."""

    def __init__(self, old: LMShape, new: LMShape) -> None:
        self.old, self.new = old, new
        self.heads = _head_map(old, new)
        self.norm_scale = math.sqrt(old.hidden / new.hidden)
        widening = new.head_dim / old.head_dim
        # queries and keys: see the module docstring (with qk_norm the query norm carries the attention scale)
        self.q_scale = math.sqrt(old.hidden / new.hidden * widening) if old.qk_norm else math.sqrt(widening)
        self.k_scale = self.q_scale if old.qk_norm else 1.0
        self.k_norm_scale = math.sqrt(1 / widening)

    def q_rows(self) -> tuple[list[int], list[int]]:
        d, D = self.old.head_dim, self.new.head_dim
        pairs = [
            (i * d + a, p * D + s)
            for i, p in enumerate(self.heads.query)
            for a, s in enumerate(self.heads.rows)
        ]
        return [o for o, _ in pairs], [n for _, n in pairs]

    def kv_rows(self, rotary: bool) -> tuple[list[int], list[int]]:
        d, D = self.old.head_dim, self.new.head_dim
        slots = self.heads.rows if rotary else list(range(d))
        pairs = [
            (m * d + a, r * D + s) for r, m in enumerate(self.heads.kv) if m >= 0 for a, s in enumerate(slots)
        ]
        return [o for o, _ in pairs], [n for _, n in pairs]

    def o_cols(self) -> tuple[list[int], list[int]]:
        d, D = self.old.head_dim, self.new.head_dim
        pairs = [(i * d + a, p * D + a) for i, p in enumerate(self.heads.query) for a in range(d)]
        return [o for o, _ in pairs], [n for _, n in pairs]

    def rows_cols(
        self, key: str
    ) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]] | None, float]:
        """``(rows, cols, scale)`` maps (old indices, new indices) of parameter ``key`` (a name's last parts)."""
        h = (list(range(self.old.hidden)),) * 2
        i = (list(range(self.old.intermediate)),) * 2
        head = (list(range(self.old.head_dim)), self.heads.rows)
        table = {
            "q_norm.weight": (head, None, 1.0),
            "k_norm.weight": (head, None, self.k_norm_scale),
            "q_proj.weight": (self.q_rows(), h, self.q_scale),
            "q_proj.bias": (self.q_rows(), None, self.q_scale),
            "k_proj.weight": (self.kv_rows(True), h, self.k_scale),
            "k_proj.bias": (self.kv_rows(True), None, self.k_scale),
            "v_proj.weight": (self.kv_rows(False), h, 1.0),
            "v_proj.bias": (self.kv_rows(False), None, 1.0),
            "o_proj.weight": (h, self.o_cols(), 1.0),
            "o_proj.bias": (h, None, 1.0),
            "gate_proj.weight": (i, h, 1.0),
            "up_proj.weight": (i, h, 1.0),
            "down_proj.weight": (h, i, 1.0),
            "norm.weight": (h, None, self.norm_scale),
        }
        return table[key]


def _copy_block(
    dst: torch.Tensor, src: torch.Tensor, rows: tuple[list[int], list[int]], cols: Any, scale: float
) -> None:
    import torch

    old_rows, new_rows = (torch.tensor(r, device=dst.device) for r in rows)
    values = (src.float() * scale).to(
        device=dst.device, dtype=dst.dtype
    )  # scaled before rounding to dst.dtype
    if cols is None:
        dst[new_rows] = values[old_rows]
    else:
        old_cols, new_cols = (torch.tensor(c, device=dst.device) for c in cols)
        dst[new_rows[:, None], new_cols[None, :]] = values[old_rows][:, old_cols]


def _fill(
    new_model: PreTrainedModel, old_model: PreTrainedModel, old: LMShape, new: LMShape, never: int
) -> None:
    """Zeroes ``new_model`` and writes ``old_model``'s weights into it (see the module docstring)."""
    import torch

    filler = _Filler(old, new)
    old_state = old_model.state_dict()
    positions = _layer_positions(old.layers, new.layers, _deepstack_levels(old_model))
    with torch.no_grad():
        for name, param in new_model.named_parameters():
            param.zero_()
            source = _source_name(name, positions)
            if source is None:
                continue
            src = old_state[source]
            if ".language_model." in name and not name.endswith("embed_tokens.weight"):
                rows, cols, scale = filler.rows_cols(_lm_key(name))
                _copy_block(param, src, rows, cols, scale)
                continue
            # Everything else is zero-padded where it grew: the embedding and LM head (vocabulary rows, hidden
            # columns), the merger/projector outputs and image_newline (hidden); the vision tower is unchanged.
            param[tuple(slice(0, n) for n in src.shape)] = src.to(param.device, param.dtype)
            if name.endswith("lm_head.weight"):
                param[src.shape[0] :, : old.hidden] = src[never].to(param.device, param.dtype)


def _lm_key(name: str) -> str:
    module, kind = name.split(".")[-2:]
    hidden_norm = module.endswith("norm") and module not in ("q_norm", "k_norm")  # not Qwen3's per-head ones
    return "norm.weight" if hidden_norm else f"{module}.{kind}"


def _source_name(name: str, positions: list[int]) -> str | None:
    """The old parameter that ``name`` (a new one) is filled from; ``None`` for a new (zero) layer."""
    parts = name.split(".")
    if "layers" in parts and "language_model" in parts:
        k = parts.index("layers") + 1
        new_index = int(parts[k])
        if new_index not in positions:
            return None
        parts[k] = str(positions.index(new_index))
    return ".".join(parts)


def _never_emitted_token(model: PreTrainedModel) -> int:
    """A token the model never emits: its image placeholder."""
    config = model.config
    for attr in ("image_token_id", "image_token_index"):
        if getattr(config, attr, None) is not None:
            return int(getattr(config, attr))
    raise InvalidInputError(f"{type(model).__name__} has no image token id to copy padded LM-head rows from")


def inflate(
    model: PreTrainedModel, shape: LMShape, dtype: torch.dtype | None = None, device: Any = None
) -> PreTrainedModel:
    """A new model whose language model has ``shape`` (made exact by :func:`exact_shape`) and ``model``'s function.

    Args:
        model: A trained testbed model (unchanged).
        shape: The language-model shape to reach.
        dtype: The new model's dtype (default: ``model``'s).
        device: Where to build it (default: ``model``'s device).

    Returns:
        The inflated model in eval mode, with a copy of ``model``'s generation config (plus ``suppress_tokens``
        for padded vocabulary rows).
    """
    import torch
    from transformers.initialization import no_init_weights

    old = lm_shape(model)
    new = exact_shape(old, shape)
    config = _new_config(model, old, new)
    dtype = dtype or model.dtype
    device = torch.device(device) if device is not None else model.device
    with no_init_weights(), torch.device(device):
        inflated = type(model)._from_config(config, dtype=dtype)
    never = _never_emitted_token(model)
    _fill(inflated, model, old, new, never)
    inflated.generation_config = copy.deepcopy(model.generation_config)
    if new.vocab and new.vocab > old.vocab:
        inflated.generation_config.suppress_tokens = list(range(old.vocab, new.vocab))
    return inflated.eval()


def inflate_edd(edd: Any, target: PreTrainedModel, inflated_target: PreTrainedModel) -> Any:
    """An EDD draft (:class:`vlmspec.models.edd.EDDDraft`) of ``target`` inflated, exactly, for ``inflated_target``.

    The draft's layer, embedding, norm and LM head are put into a one-layer copy of ``target`` (its vision tower
    rides along unused), inflated like the target (same head width, heads, MLP and vocabulary), and taken out
    again; the layer it reads moves to where :func:`inflate` put that target layer (the zero layers after it
    leave the residual stream unchanged, so the hidden state there is the same, zero-padded).
    """
    import torch
    from transformers.initialization import no_init_weights

    from ..models.edd import EDDConfig, EDDDraft, target_signature

    old, new = lm_shape(target), lm_shape(inflated_target)
    one_layer = copy.deepcopy(target.config)
    text = one_layer.get_text_config()
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:1]
    with no_init_weights(), torch.device(target.device):
        carrier = type(target)._from_config(one_layer, dtype=target.dtype)
    state = {k: v for k, v in target.state_dict().items() if k in carrier.state_dict()}
    decoder_prefix = _module_name(carrier, carrier.get_decoder())
    head_name = _module_name(carrier, carrier.get_output_embeddings())
    for name, value in edd.decoder.state_dict().items():
        state[f"{decoder_prefix}.{name}"] = value
    state[f"{head_name}.weight"] = edd.lm_head.weight
    carrier.load_state_dict(state, strict=False)
    inflated = inflate(
        carrier, replace(new, layers=1), dtype=inflated_target.dtype, device=inflated_target.device
    )
    config = EDDConfig(
        **{
            **edd.edd_config.__dict__,
            "text_config": inflated.config.get_text_config().to_dict(),
            "hidden_layer": _layer_positions(old.layers, new.layers, _deepstack_levels(target))[
                edd.edd_config.hidden_layer
            ],
            "target_layers": new.layers,
            "target_signature": target_signature(inflated_target),
        }
    )
    return EDDDraft(config, inflated.get_decoder(), inflated.get_output_embeddings()).eval()


def _module_name(model: torch.nn.Module, module: torch.nn.Module) -> str:
    return next(name for name, found in model.named_modules() if found is module)


def calibrate(
    target: PreTrainedModel, draft: PreTrainedModel | None, calibration: str, **kwargs: Any
) -> tuple[PreTrainedModel, PreTrainedModel | None]:
    """``(target, draft)`` inflated to the named calibration (the draft is kept when it names no draft shape).

    ``kwargs`` go to :func:`inflate` (``dtype``, ``device``).
    """
    cal = get_calibration(calibration)
    for model, shape in ((target, cal.target), (draft, cal.draft)):
        if model is not None and shape is not None:  # refuse a shape before building either model
            exact_shape(lm_shape(model), shape)
    inflated_draft = inflate(draft, cal.draft, **kwargs) if draft is not None and cal.draft else draft
    return inflate(target, cal.target, **kwargs), inflated_draft


def parameter_table(size: str = "base") -> str:
    """Markdown: each calibration's inflated language models against the real bodies they mirror.

    Counts are computed from the shapes (:func:`body_parameters`, checked against transformers' own modules in
    the tests); "with vocabulary" adds the embedding and an untied LM head (the real ones of the small Qwen2
    models are tied).
    """
    from .train import get_size

    spec = get_size(size)
    lines = [
        "| calibration | role | mirrors | hidden/MLP/layers/heads/kv/head_dim | body | real body | difference "
        "| with vocabulary (inflated / real) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for cal in CALIBRATIONS.values():
        for role, named in (("target", cal.target), ("draft", cal.draft)):
            if named is None:
                continue
            model = getattr(spec, role)
            old = LMShape(
                model.hidden, model.intermediate, model.layers, model.hidden // model.head_dim, model.kv_heads,
                model.head_dim, vocab=None,
            )  # fmt: skip
            exact = exact_shape(old, named)
            vocab = named.vocab or 0
            real = REAL_BODIES.get(named.name)
            inflated_total = body_parameters(exact) + 2 * vocab * exact.hidden
            real_total = (
                body_parameters(real) + (1 if real.tied else 2) * real.vocab * real.hidden if real else None
            )
            shape = "/".join(str(v) for v in (exact.hidden, exact.intermediate, exact.layers, exact.heads,
                                              exact.kv_heads, exact.head_dim))  # fmt: skip
            lines.append(
                f"| {cal.name} | {role} | {named.name or '-'} | {shape} | {body_parameters(exact) / 1e6:,.1f}M | "
                f"{body_parameters(named) / 1e6:,.1f}M | {body_parameters(exact) / body_parameters(named) - 1:+.3%} | "
                + (f"{inflated_total / 1e6:,.0f}M / {real_total / 1e6:,.0f}M |" if real_total else "- |")
            )
    return "\n".join(lines)


if __name__ == "__main__":
    print(parameter_table())
