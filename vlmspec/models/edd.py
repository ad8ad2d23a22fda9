"""EDD: a one-layer draft decoder that reads the target's own encoding (edd_pct.txt, section 3.1).

The draft is one decoder layer of the target's own language-model class (``type(target.get_decoder())`` built
from the target's text config with ``num_hidden_layers=1``), with the target's embedding, final norm and LM head
copied in. Its input sequence is the target's hidden states of everything already committed (the *soft prompt*),
then its own token embeddings for the draft block::

    rows:      h_0  h_1  ...  h_{s-1} | e(x_s)  e(x_{s+1}) ...      (x_s: the root, the token the target just chose)
    positions: 0    1    ...  s-1     | s       s+1         ...     (the target's own rotary positions)

``h_i`` is the output of target decoder layer :attr:`EDDConfig.hidden_layer` at position ``i``; row ``e(x_j)``
predicts ``x_{j+1}``. This is the paper's Eq. 3, ``P_d(t_i | t_{jL:i}, h_{<= jL})``, with the block starting at the
root: the soft prompt reaches exactly as far as the target has run, so no extra target forward is ever needed.
The hidden states come from forwards the engine makes anyway: the prefill gives ``h_0 .. h_{L-1}`` of the prompt,
and every verification gives those of the root and the accepted nodes. In the draft's KV cache the soft prompt's
entries replace the draft's own entries of the accepted tokens at commit time (see :mod:`vlmspec.draft`).

Choices where the paper is open, and why:

* **Which layer.** The paper takes the fourth-to-last of LLaMA2-7B's 32 layers (its 28th) as best (section 4.3.1).
  :func:`default_hidden_layer` keeps that *relative* depth, layer ``floor(7 L / 8)`` (1-based), so a 28-layer
  Qwen2-7B reads its 24th layer and the testbed's 4-layer target its 3rd; the literal "fourth-to-last" would be
  the embeddings of a 4-layer model. Any layer can be chosen at training time.
* **Initial layer weights.** The paper copies the embedding and LM head and trains everything. The layer itself
  starts as a copy of the target layer right after :attr:`EDDConfig.hidden_layer` (the layer trained to read
  exactly these states), which converges faster than a random layer; all weights are then trained.
* **What must match.** A draft is tied to the target it was trained for: the family, the language model's shape
  and :func:`target_signature` (norms of some LM-head rows, stable across dtypes and calibrated inflation) are
  recorded in ``edd_config.json`` and checked on load.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers.cache_utils import Cache

from ..artifacts import read_json_object, read_safetensors
from ..cache import cache_kwarg, new_cache
from ..errors import InvalidInputError
from .base import DecodeState, VLMAdapter, config_value

CONFIG_NAME = "edd_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT = "vlmspec-edd"
SIGNATURE_ROWS = 16
SIGNATURE_RTOL = 1e-2
SHAPE_KEYS = (
    "hidden_size",
    "vocab_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
"""The draft's text-config entries that must be the target's: they set the shapes of the copied weights."""
_RETRAIN = "train the draft again with `vlmspec edd train`"
_NO_EDD = {
    "gemma4": "its layers read per-layer inputs looked up from token ids, which the draft's soft prompt (the "
    "target's hidden states) has none of, and its last layers reuse earlier layers' keys, which one layer has no "
    "earlier layer to give; draft with a smaller Gemma 4 (gemma-4-E2B-it) or the target's assistant instead",
}
"""Families an EDD draft is not built for, and why."""


def default_hidden_layer(num_layers: int) -> int:
    """0-based index of the target layer EDD reads: layer ``floor(7 L / 8)`` (1-based), the paper's relative depth."""
    return max(0, (7 * num_layers) // 8 - 1)


def target_signature(target: torch.nn.Module) -> list[float]:
    """Norms of :data:`SIGNATURE_ROWS` evenly spaced LM-head rows among the first 4096 tokens (float32, rounded).

    Tells one trained target from another of the same shape; unchanged by the dtype (within bf16's precision,
    :data:`SIGNATURE_RTOL`) and by calibrated inflation, which pads those rows with zeros.
    """
    weight = target.get_output_embeddings().weight
    rows = min(weight.shape[0], 4096)
    ids = torch.linspace(0, rows - 1, SIGNATURE_ROWS).round().long().to(weight.device)
    return [round(float(v), 6) for v in weight[ids].float().norm(dim=-1).tolist()]


@dataclass
class EDDConfig:
    """What an EDD draft is and which target it was trained for (saved as ``edd_config.json``).

    Attributes:
        target_model_type: the target VLM's ``model_type`` (``qwen2_vl``, ``llava_onevision``, ...).
        text_config: the draft decoder's config as a dict (the target's text config, one layer).
        hidden_layer: 0-based index of the target decoder layer whose output is the soft prompt.
        target_layers: decoder layers of the target it was trained for.
        target_signature: :func:`target_signature` of that target.
        target_name: where that target was loaded from (for messages only).
        training: settings and metrics of the training run (for the record).
    """

    target_model_type: str
    text_config: dict[str, Any]
    hidden_layer: int
    target_layers: int
    target_signature: list[float]
    target_name: str = ""
    training: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)


class EDDDraft(torch.nn.Module):
    """The EDD draft: ``decoder`` (one layer of the target's language-model class) and ``lm_head``.

    Build one for a target with :meth:`for_target`, load a trained one with :meth:`from_pretrained`.
    """

    def __init__(self, config: EDDConfig, decoder: torch.nn.Module, lm_head: torch.nn.Linear) -> None:
        super().__init__()
        self.edd_config = config
        self.decoder = decoder
        self.lm_head = lm_head

    # ---- what the engine, the probe and the pipeline read ------------------------------------------------------
    @property
    def config(self) -> Any:
        """The decoder's text config (``get_text_config()`` returns itself), as caches and probes expect."""
        return self.decoder.config

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.decoder.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    # ---- building, saving, loading ------------------------------------------------------------------------------
    @classmethod
    def for_target(
        cls, target: torch.nn.Module, hidden_layer: int | None = None, target_name: str = ""
    ) -> EDDDraft:
        """A new (untrained) draft for ``target``: embedding, final norm and LM head copied, the layer copied
        from the target layer after ``hidden_layer`` (default :func:`default_hidden_layer`)."""
        refused = _NO_EDD.get(target.config.model_type)
        if refused:
            raise InvalidInputError(
                f"an EDD draft cannot be built for a {target.config.model_type!r} target: {refused}"
            )
        source = target.get_decoder()
        layers = len(source.layers)
        layer = default_hidden_layer(layers) if hidden_layer is None else hidden_layer
        if not 0 <= layer < layers:
            raise InvalidInputError(
                f"hidden_layer must be in [0, {layers}) for this target ({layers} layers), got {layer}"
            )
        copied = _attention_layer(source.layers, min(layer + 1, layers - 1))
        text = _one_layer(target.config.get_text_config(), copied)
        config = EDDConfig(
            target_model_type=target.config.model_type,
            text_config=text.to_dict(),
            hidden_layer=layer,
            target_layers=layers,
            target_signature=target_signature(target),
            target_name=target_name,
        )
        draft = cls._build(target, config)
        for name, module in source.named_children():  # the embedding, the final norm (LFM2's: embedding_norm)
            if name != "layers":
                getattr(draft.decoder, name).load_state_dict(module.state_dict())
        draft.decoder.layers[0].load_state_dict(source.layers[copied].state_dict())
        draft.lm_head.load_state_dict(target.get_output_embeddings().state_dict())
        return draft

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write ``edd_config.json`` and ``model.safetensors`` into ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": FORMAT})
        (folder / CONFIG_NAME).write_text(self.edd_config.to_json() + "\n")
        return folder

    @classmethod
    def from_pretrained(cls, folder: str | Path, target: torch.nn.Module) -> EDDDraft:
        """Load a trained draft for ``target`` (on its device and dtype).

        Raises:
            InvalidInputError: ``folder`` holds no EDD draft, its files are damaged, edited or inconsistent, or the
                draft was trained for another target (each naming the file and the field).
            InputNotFoundError: its ``model.safetensors`` is missing.
        """
        config = read_config(folder)
        check_target(config, target, where=str(folder))
        path = Path(folder) / WEIGHTS_NAME
        state = read_safetensors(path, "an EDD draft's weights", _RETRAIN)
        try:
            draft = cls._build(target, config)
            missing, unexpected = draft.load_state_dict(state, strict=False)
        except (ValueError, RuntimeError) as error:  # a text_config the target's classes refuse, other shapes
            raise InvalidInputError(
                f"{path} does not fit its {CONFIG_NAME} and this target ({str(error).splitlines()[0][:300]}); "
                f"{_RETRAIN}"
            ) from None
        missing = [name for name in missing if "rotary_emb" not in name]  # buffers, rebuilt from the config
        if missing or unexpected:
            raise InvalidInputError(
                f"{path} does not match its {CONFIG_NAME}: missing {missing[:4]}, unexpected {unexpected[:4]}; "
                f"{_RETRAIN}"
            )
        return draft

    @classmethod
    def _build(cls, target: torch.nn.Module, config: EDDConfig) -> EDDDraft:
        source = target.get_decoder()
        text = type(target.config.get_text_config())(**config.text_config)
        text._attn_implementation = target.config.get_text_config()._attn_implementation
        weight = target.get_output_embeddings().weight
        with torch.device(weight.device):
            decoder = type(source)(text).to(weight.dtype)
            lm_head = torch.nn.Linear(text.hidden_size, weight.shape[0], bias=False, dtype=weight.dtype)
        return cls(config, decoder, lm_head).eval()

    # ---- the forward --------------------------------------------------------------------------------------------
    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Any,
    ) -> torch.Tensor:
        """``[B, n, D]`` input rows (soft-prompt hidden states and/or token embeddings) -> ``[B, n, V]`` logits."""
        out = self.decoder(
            inputs_embeds=inputs_embeds,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=cache is not None,
            **cache_kwarg(self.decoder, cache),
        )
        return self.lm_head(out.last_hidden_state)


def read_config(folder: str | Path) -> EDDConfig:
    """The :class:`EDDConfig` saved in ``folder``.

    Raises:
        ValueError: no readable EDD config there.
    """
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise InvalidInputError(
            f"{folder} is not an EDD draft: it has no {CONFIG_NAME} (train one with `vlmspec edd train`)"
        )
    raw = read_json_object(path, "an EDD config", _RETRAIN)
    try:
        config = EDDConfig(**raw)
    except TypeError as error:
        raise InvalidInputError(f"{path} is not a valid EDD config ({error}); {_RETRAIN}") from None
    if config.format != FORMAT:
        raise InvalidInputError(f"{path}: format {config.format!r}, expected {FORMAT!r}; {_RETRAIN}")
    problem = _config_problem(config)
    if problem is not None:
        raise InvalidInputError(f"{path}: {problem}; the file was edited or damaged: {_RETRAIN}")
    return config


def _config_problem(config: EDDConfig) -> str | None:
    """What is wrong with the fields of a read :class:`EDDConfig` (types and ranges), or ``None``."""
    layers, layer, signature = config.target_layers, config.hidden_layer, config.target_signature
    if not isinstance(config.text_config, dict):
        return f"text_config is a {type(config.text_config).__name__}, not an object"
    if not _is_int(layers) or layers < 1:
        return f"target_layers is {layers!r}, not an integer >= 1"
    if not _is_int(layer) or not 0 <= layer < layers:
        return (
            f"hidden_layer is {layer!r}, not a layer index of the {layers}-layer target (0 to {layers - 1})"
        )
    if config.text_config.get("num_hidden_layers") != 1:
        return f"text_config.num_hidden_layers is {config.text_config.get('num_hidden_layers')!r}, not 1"
    if not (
        isinstance(signature, list)
        and len(signature) == SIGNATURE_ROWS
        and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in signature
        )
    ):
        return f"target_signature is not a list of {SIGNATURE_ROWS} numbers (got {str(signature)[:80]})"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_edd_folder(folder: str | Path) -> bool:
    """Whether ``folder`` holds an EDD draft (an ``edd_config.json``)."""
    return (Path(folder) / CONFIG_NAME).is_file()


def check_target(config: EDDConfig, target: torch.nn.Module, where: str = "this EDD draft") -> None:
    """Refuse a target the draft was not trained for (family, language-model shape or weights differ).

    Raises:
        ValueError: naming what differs and what to do.
    """
    trained_for = f"{config.target_name or 'its target'} ({config.target_model_type})"
    advice = "train a draft for this target with `vlmspec edd train --target ...`"
    if target.config.model_type != config.target_model_type:
        raise InvalidInputError(
            f"{where} was trained for a {config.target_model_type!r} target, not {target.config.model_type!r}; "
            f"{advice}"
        )
    text = target.config.get_text_config()
    layers = len(target.get_decoder().layers)
    for key in SHAPE_KEYS:
        if config_value(text, key) != config.text_config.get(key):
            raise InvalidInputError(
                f"{where} was trained for {trained_for} with {key} {config.text_config.get(key)}, but this target "
                f"has {config_value(text, key)} (its {CONFIG_NAME} text_config.{key}); {advice}"
            )
    if layers != config.target_layers:
        raise InvalidInputError(
            f"{where} was trained for {trained_for} with {config.target_layers} layers, but this target has "
            f"{layers}; {advice}"
        )
    signature = target_signature(target)
    if not all(
        math.isclose(a, b, rel_tol=SIGNATURE_RTOL, abs_tol=1e-6)
        for a, b in zip(signature, config.target_signature, strict=True)
    ):
        raise InvalidInputError(
            f"{where} was trained for {trained_for}, a target of the same shape but other weights (LM-head "
            f"signature differs); {advice}"
        )


class EDDAdapter(VLMAdapter):
    """The engine's handle on an :class:`EDDDraft` (see :mod:`vlmspec.models.base` for the adapter contract).

    It is always a draft: its prefill is the soft prompt of the target's prefill hidden states, and the root
    forward of each step takes the hidden states the last verification produced (``pending`` rows ``[p, D]``).

    Args:
        draft: the EDD draft.
        family: the target's adapter class, whose ``rope_ids`` map logical positions to rotary ones.
    """

    def __init__(self, draft: EDDDraft, family: type[VLMAdapter]) -> None:
        if not draft.edd_config.training.get("use_hidden", True):
            raise InvalidInputError(
                "this EDD draft was trained without the target's hidden states (the paper's 'w/o encoding result' "
                "ablation, `vlmspec edd train --no-hidden`); it is for `vlmspec edd eval`, not for decoding"
            )
        super().__init__(draft)
        self.family = family

    @property
    def reads_target_layer(self) -> int | None:
        return self.model.edd_config.hidden_layer

    def rope_ids(self, positions: torch.Tensor, rope_delta: torch.Tensor) -> torch.Tensor:
        return self.family.rope_ids(positions, rope_delta)

    @torch.inference_mode()
    def prefill_soft(
        self,
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
        rope_delta: torch.Tensor,
        state: DecodeState | None = None,
        target: DecodeState | None = None,
    ) -> DecodeState:
        """Run the soft prompt: ``hidden`` ``[L, D]`` target states at rotary ``position_ids`` ``[..., 1, L]``, into a
        fresh cache, or on top of ``state``'s (the rest of a prompt whose start it holds: a conversation's next turn).
        ``target`` (the target's state) is not read: the draft keeps a cache of its own.
        """
        if state is None:
            state = DecodeState(cache=new_cache(self.model), rope_delta=rope_delta, visual_tokens=0)
        state.rope_delta = rope_delta
        self.model(
            hidden[None].to(self.dtype), position_ids=position_ids, attention_mask=None, cache=state.cache
        )
        return state

    def root_rows(self, pending: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """``pending`` ``[p, D]`` target hidden states, then the root's embedding: ``[p + 1, D]``."""
        root_row = self.embed(root.reshape(1))  # [1, D]
        return torch.cat([pending.to(root_row.dtype), root_row])

    def _logits(
        self, cache: Cache, rows: torch.Tensor, position_ids: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        return self.model(rows, position_ids=position_ids, attention_mask=bias, cache=cache)

    @contextmanager
    def _layer_output(self, layer: int | None) -> Iterator[list[torch.Tensor]]:
        """No layer to read, and no :func:`~vlmspec.models.attention.model_lock`: that lock keeps a model's forwards out
        of the pruning probe's eager switch and the layer hooks, which only ever touch a target, and an EDD draft
        shares no module or config with its target (its decoder is built from its own copy of the text config).
        Its forwards (:meth:`run`, :meth:`prefill_soft`) switch and hook nothing, so two threads may run them on
        one draft at once."""
        if layer is not None:
            raise InvalidInputError(
                "an EDD draft has no target layer to read: hidden_layer is for the target"
            )
        yield []


def _attention_layer(layers: Sequence[torch.nn.Module], index: int) -> int:
    """``index``, or where layer ``index`` is recurrent (a hybrid's Gated DeltaNet or short convolution: Qwen3.5,
    LFM2), the nearest attention layer after it, else before it. Why: the draft's one layer runs as an attention
    layer over the tree, through the draft's own cache; a recurrent one would need the hybrid decoder's tree
    recurrence (:mod:`vlmspec.models.hybrid`), which one layer fed with the target's states has no use for. The
    paper copies the layer after the one it reads; the nearest attention layer is the closest thing a hybrid has."""
    attends = [i for i, layer in enumerate(layers) if hasattr(layer, "self_attn")]
    after = [i for i in attends if i >= index]
    return after[0] if after else attends[-1] if attends else index


def _one_layer(text_config: Any, index: int) -> Any:
    """A copy of ``text_config`` with one decoder layer, of the kind of its layer ``index`` (the one it is copied
    from): that layer's attention type (``layer_types``, ``max_window_layers``) and, in a mixture-of-experts model,
    whether its MLP is sparse (``mlp_only_layers`` names the dense layers, ``decoder_sparse_step`` spaces the sparse
    ones), so that the copied weights fit."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list) and config.layer_types:
        config.layer_types = [config.layer_types[index]]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = 0 if index >= config.max_window_layers else 1
    if getattr(config, "mlp_only_layers", None) is not None:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = index in config.mlp_only_layers or (index + 1) % step != 0
        config.mlp_only_layers, config.decoder_sparse_step = ([0] if dense else []), 1
    return config
