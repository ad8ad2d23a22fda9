"""The tiny pairs' weights: redrawn so that greedy decoding is peaked but context-driven (:func:`shape_weights`), the
draft's head perturbed so that it agrees with the target about three times in four (:func:`perturb_draft_head`),
and the vision projector rescaled so that the pictures steer the replies (:func:`calibrate_vision`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import family_builders
from .media import make_image

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel, ProcessorMixin

# Weight shaping (see shape_weights). _QK_STD/_OV_GAIN trade context sensitivity against
# peakedness (bf16 robustness); measured on qwen2_vl, 80 prompts x 48 tokens:
#   qk 0.3 / ov 0.6: 2.7% of predictions change when the prompt is swapped, 0.03% bf16 flips
#   qk 0.3 / ov 1.0: 14% / 0.13%;  qk 0.45 / ov 1.0: 32% / 0.5%;  default-like init: 92% / 2%.
_LM_HEAD_SCALE = 1.0
_QK_STD = 0.3
_OV_GAIN = 0.8
_MLP_STD = 0.02
_DRAFT_HEAD_NOISE = 1.2  # draft greedy agreement with the target ~0.75 (plain copy: ~0.97)
_VISION_OUT_RMS = 1.0
_OVIS2_VISUAL_SHARPNESS = 4.0
"""Ovis2: the gain on the tower's normalised visual-vocabulary logits (a random tower's unit-variance logits spread a
token over most of the vocabulary, so its expected row would be about the same for every patch)."""
_GEMMA_MLP_GAIN = (
    0.05  # Gemma normalises the MLP's output: this keeps it the smooth noise the others' small MLPs add
)
_GEMMA_ATTENTION_GAIN = 0.8
_LFM3_ATTENTION_GAIN, _LFM3_CONV_GAIN = 1.0, 0.2
"""LFM3's normalised attention and convolution outputs: the convolutions quieter (they read the last few tokens
only, which the attention layers see too). Measured on the fixture's calibration inputs, 20 draws: convolutions at
0.3 and attention at 0.8 leave the replies blind to the context (at most 0.02 of the predictions change with the
prompt), attention at 1.2 leaves near-ties (best margin 0.02); these give draws with both (0.15 and 0.05)."""


def shape_weights(model: PreTrainedModel, special_ids: list[int], draw_seed: int) -> None:
    """Re-draws the language model's weights so greedy decoding is peaked *and* context-driven.

    * Input embeddings: random directions with equal norms ``sqrt(hidden)``.
    * ``lm_head`` = ``_LM_HEAD_SCALE`` x a fixed random permutation of the normalised embeddings:
      after the final RMSNorm the residual stream is dominated by the current token's embedding,
      so one row (that token's "successor") wins by a wide margin instead of near-ties between
      ~1000 random logits (random init: median top1-top2 gap ~0.25 logit std).
    * Attention: ``q_proj``/``k_proj`` ~ N(0, ``_QK_STD``) give sharp, content- and
      position-dependent attention; ``v_proj``/``o_proj`` are scaled so the attention output has
      ~``_OV_GAIN`` of the embedding's RMS. Sharp attention makes the context's influence sparse
      but strong, which buys more context sensitivity per near-tie than diffuse attention.
      (Qwen3-VL normalises q/k per head, so its ``q_norm``/``k_norm`` weights carry the scale.)
    * MLP weights ~ N(0, ``_MLP_STD``) (small: they only add smooth noise).
    * ``lm_head`` rows of special tokens are zeroed: their logit is exactly 0 while the maximum
      over ordinary tokens is positive, so greedy decoding never emits EOS/placeholders.

    Args:
        model: Target model, modified in place.
        special_ids: Token ids whose ``lm_head`` rows are zeroed.
        draw_seed: Seed of this draw.
    """
    import torch

    embed = model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    vocab, hidden = embed.shape
    gen = torch.Generator().manual_seed(draw_seed)
    ov_std = (_OV_GAIN / hidden) ** 0.5
    with torch.no_grad():
        embed.normal_(0.0, 1.0, generator=gen)
        embed.mul_(hidden**0.5 / embed.norm(dim=1, keepdim=True))
        perm = torch.randperm(vocab, generator=gen)
        lm_head.copy_(_LM_HEAD_SCALE * embed[perm] / hidden**0.5)
        lm_head[special_ids] = 0.0
        embed.div_(getattr(model.get_input_embeddings(), "scalar_embed_scale", 1.0))  # Gemma scales at lookup
        for layer in model.get_decoder().layers:
            mlp = layer.mlp if hasattr(layer, "mlp") else layer.feed_forward  # LFM2's and LFM3's
            if hasattr(
                getattr(layer, "post_ffn_norm", None), "weight"
            ):  # LFM3 normalises each block's output
                mixer_gain = _LFM3_ATTENTION_GAIN if hasattr(layer, "self_attn") else _LFM3_CONV_GAIN
                _set_gain(layer.post_operator_norm, mixer_gain)
                _set_gain(layer.post_ffn_norm, _GEMMA_MLP_GAIN)
            if not hasattr(layer, "self_attn"):  # recurrent layers: Qwen3.5's, LFM2's
                if hasattr(layer, "linear_attn"):
                    _shape_gated_delta(layer.linear_attn, hidden, ov_std, gen)
                else:
                    _shape_short_conv(layer.conv, hidden, ov_std, gen)
                for weight, std in _mlp_weights(mlp, hidden):
                    weight.normal_(0.0, std, generator=gen)
                continue
            attn = layer.self_attn
            qk_std = _QK_STD
            # q/k RMS-normalised per head after the projection (LFM2's names; Gemma 4's reusing layers: no keys)
            qk_norms = [
                getattr(attn, name, None) for name in ("q_norm", "k_norm", "q_layernorm", "k_layernorm")
            ]
            if any(norm is not None for norm in qk_norms):
                for norm in filter(None, qk_norms):
                    _set_gain(norm, _QK_STD * hidden**0.5)
                qk_std = 0.1
            if hasattr(layer, "post_feedforward_layernorm"):  # Gemma normalises each block's output too
                _set_gain(layer.post_attention_layernorm, _GEMMA_ATTENTION_GAIN)
                _set_gain(layer.post_feedforward_layernorm, _GEMMA_MLP_GAIN)
            if hasattr(layer, "post_per_layer_input_norm"):  # Gemma 4's per-layer inputs: a small addition
                _set_gain(layer.post_per_layer_input_norm, _GEMMA_MLP_GAIN)
            if hasattr(layer, "post_mlp_layernorm"):  # so does GLM-4
                _set_gain(layer.post_self_attn_layernorm, _GEMMA_ATTENTION_GAIN)
                _set_gain(layer.post_mlp_layernorm, _GEMMA_MLP_GAIN)
            projections = (
                ("q_proj", qk_std),
                ("k_proj", qk_std),
                ("v_proj", ov_std),
                ("o_proj", ov_std),
                ("out_proj", ov_std),  # LFM2's name of o_proj
            )
            for (
                name,
                std,
            ) in projections:  # Gemma 4: no k_proj where a layer reuses keys, no v_proj where k is v
                if getattr(attn, name, None) is not None:
                    getattr(attn, name).weight.normal_(0.0, std, generator=gen)
            for weight, std in _mlp_weights(mlp, hidden):
                weight.normal_(0.0, std, generator=gen)


def _shape_gated_delta(layer: torch.nn.Module, hidden: int, ov_std: float, gen: torch.Generator) -> None:
    """A Gated DeltaNet layer (Qwen3.5) that carries the context: its output gate ``silu(z)`` of order one (z ~ N(0, 4);
    its state's read-out is RMS-normed, so the gate decides how loud the layer is), the output projection as the
    attention layers' (``ov_std``), and keys, queries and values drawn as sharp as the attention layers'."""
    layer.in_proj_z.weight.normal_(0.0, 2.0 / hidden**0.5, generator=gen)
    layer.in_proj_qkv.weight.normal_(0.0, _QK_STD, generator=gen)
    layer.out_proj.weight.normal_(0.0, ov_std, generator=gen)


def _shape_short_conv(layer: torch.nn.Module, hidden: int, ov_std: float, gen: torch.Generator) -> None:
    """An LFM2 short convolution that carries the context: its gates and input ``B, C, x`` of order one, the
    convolution's taps of order one, the output projection as the attention layers' (``ov_std``)."""
    layer.in_proj.weight.normal_(0.0, hidden**-0.5, generator=gen)
    layer.conv.weight.normal_(0.0, layer.conv.weight.shape[-1] ** -0.5, generator=gen)
    layer.out_proj.weight.normal_(0.0, ov_std, generator=gen)


def _set_gain(norm: torch.nn.Module, gain: float) -> None:
    """Make an RMS norm scale its output by ``gain`` (Gemma's and Qwen3.5's norms multiply by ``1 + weight``, Gemma
    4's and the others' by ``weight``)."""
    name = type(norm).__name__
    centred = (name.startswith("Gemma") and not name.startswith("Gemma4")) or name.startswith("Qwen3_5")
    norm.weight.fill_(gain - 1.0 if centred else gain)


def _mlp_weights(mlp: torch.nn.Module, hidden: int) -> list[tuple[torch.Tensor, float]]:
    """A layer's MLP weights and the deviation each is drawn with: ``_MLP_STD`` for a dense MLP's and for every
    expert's; a sparse layer's router gets ``1 / sqrt(hidden)``, so that its logits over the experts are ~N(0, 1)
    and each token's top experts win by clear margins (a router as small as the MLPs would route on near-ties,
    which the last bits of a batched product can flip)."""
    if hasattr(mlp, "experts"):
        experts = [(mlp.experts.gate_up_proj, _MLP_STD), (mlp.experts.down_proj, _MLP_STD)]
        return [*experts, (mlp.gate.weight, hidden**-0.5)]
    if hasattr(mlp, "w1"):  # LFM2's gate (w1), up (w3) and down (w2) projections
        return [(proj.weight, _MLP_STD) for proj in (mlp.w1, mlp.w3, mlp.w2)]
    if hasattr(mlp, "gate_up_proj"):  # GLM's gate and up projections in one
        return [(proj.weight, _MLP_STD) for proj in (mlp.gate_up_proj, mlp.down_proj)]
    return [(proj.weight, _MLP_STD) for proj in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]


def perturb_draft_head(draft: PreTrainedModel, special_ids: list[int], seed: int) -> None:
    """Adds seeded noise (``_DRAFT_HEAD_NOISE`` x the row scale) to the draft's ``lm_head``.

    A plain truncated copy agrees with the peaked target on ~97% of positions, which would leave
    the rejection paths of speculative decoding nearly untested; the noise brings agreement down to
    a useful middle ground without touching the target.
    """
    import torch

    if _DRAFT_HEAD_NOISE <= 0:
        return
    weight = draft.get_output_embeddings().weight
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        noise = torch.randn(weight.shape, generator=gen) * (
            _DRAFT_HEAD_NOISE * _LM_HEAD_SCALE / weight.shape[1] ** 0.5
        )
        noise[special_ids] = 0.0
        weight.add_(noise)


def _vision_output_linears(model: PreTrainedModel, family: str) -> list[torch.nn.Module]:
    """Returns the last linear layer(s) producing the visual embeddings fed to the language model (Gemma 3: its
    projector, whose projection is the weight ``mm_input_projection_weight``)."""
    inner = model.model
    if family in ("qwen2_vl", "qwen2_5_vl"):
        return [inner.visual.merger.mlp[-1]]
    if family == "glm46v":
        return [inner.visual.merger.down_proj]
    if family in ("smolvlm", "idefics3"):
        return [inner.connector.modality_projection.proj]
    if family == "ovis2":  # a visual token is the expected row of this table (an indicator token, one row)
        return [inner.visual_embeddings_table]
    if family == "janus":
        return [inner.aligner.hidden_layers[-1]]
    if family == "deepseek_vl":
        return [inner.aligner.linear2]
    if family == "deepseek_vl_hybrid":
        return [inner.aligner.proj]
    if family == "video_llama_3":
        return [inner.projector.readout[-1]]
    if family == "gemma4":
        return [inner.embed_vision.embedding_projection]
    if family.startswith("minicpmv"):
        return [inner.merger.mlp[-1].linear_2]
    if family in family_builders.QWEN3_FAMILIES:
        deepstack = getattr(inner.visual, "deepstack_merger_list", [])  # Qwen3.5's tower has none
        return [inner.visual.merger.linear_fc2] + [m.linear_fc2 for m in deepstack]
    if (
        family == "gemma3"
    ):  # its projection is a bare weight: the projector is the module whose output is scaled
        return [inner.multi_modal_projector]
    return [inner.multi_modal_projector.linear_2]


def calibrate_vision(model: PreTrainedModel, family: str, processor: ProcessorMixin) -> None:
    """Rescales the vision projector so visual embeddings have RMS ``_VISION_OUT_RMS``.

    Randomly initialised vision towers emit tiny features; without this the language model would
    practically ignore images and videos, hiding bugs in visual-token handling.
    """
    import torch

    image_token = getattr(
        processor, "image_token", "<image>"
    )  # as a prompt writes a picture: LLaVA's, InternVL's
    if family == "gemma3":
        image_token = "<start_of_image>"
    elif family.startswith("qwen"):
        image_token = "<|vision_start|><|image_pad|><|vision_end|>"
    inputs = processor(text=[image_token + "hi"], images=[make_image(0)], return_tensors="pt")
    if family == "gemma3":  # transformers initialises Gemma 3's projection to zeros
        with torch.no_grad():
            projection = model.model.multi_modal_projector.mm_input_projection_weight
            projection.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    if family == "deepseek_vl_hybrid":  # transformers leaves its SAM encoder's weights uninitialised
        _init_sam_encoder(model.model.high_res_vision_model)
    if family == "ovis2":  # sharper visual-vocabulary distributions: averaged rows would make tokens alike
        with torch.no_grad():
            model.model.vision_tower.head_norm.weight.mul_(_OVIS2_VISUAL_SHARPNESS)
    if family == "fast_vlm":
        _init_fan_in(model.model.vision_tower)
    for linear in _vision_output_linears(model, family):
        captured: list[torch.Tensor] = []
        handle = linear.register_forward_hook(lambda _m, _i, out, acc=captured: acc.append(out.detach()))
        try:
            with torch.no_grad():
                model(**inputs)
        finally:
            handle.remove()
        rms = torch.cat([c.reshape(-1) for c in captured]).pow(2).mean().sqrt().item()
        with torch.no_grad():
            weight = linear.mm_input_projection_weight if family == "gemma3" else linear.weight
            weight.mul_(_VISION_OUT_RMS / rms)
            if getattr(linear, "bias", None) is not None:
                linear.bias.mul_(_VISION_OUT_RMS / rms)
    if family in ("llava_onevision", "llava_next", "llava_next_video"):
        with torch.no_grad():
            newline = model.model.image_newline
            newline.mul_(_VISION_OUT_RMS / newline.pow(2).mean().sqrt())


def _init_fan_in(tower: torch.nn.Module) -> None:
    """Draws a convolutional tower's convolutions and linear layers at ``1 / sqrt(fan_in)`` (FastViTHD: the timm
    wrapper draws every weight at 0.02, and through its five stages the features fall to ~1e-23)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in tower.modules():
            if isinstance(module, torch.nn.Conv2d | torch.nn.Linear):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, fan_in**-0.5, generator=gen)


def _init_sam_encoder(encoder: torch.nn.Module) -> None:
    """Draws a SAM encoder's weights (DeepSeek-VL's hybrid tower; norms at one and zero, biases at zero)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in encoder.named_parameters():
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=gen)
