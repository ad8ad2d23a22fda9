"""The adapter contract: what the engine needs from a VLM family, and nothing else.

An adapter wraps one loaded ``*ForConditionalGeneration`` model and offers three things:

* ``prefill(inputs, keep=None, score_visual=False)``: run the multimodal prompt (optionally only the prompt
  positions in ``keep``, for the pruned draft; optionally measuring how much attention the text pays to each
  visual token, for attention-guided pruning) and return the last position's logits with a fresh
  :class:`DecodeState`;
* ``forward(state, tokens, positions, bias)``: run ``n`` new tokens at explicit *logical* positions under an
  explicit additive mask on top of the cache and return their logits;
* ``prompt_layout(inputs)``: which prompt positions are visual tokens.

*Logical* positions count tokens of the full (unpruned) sequence: the prompt occupies ``0 .. L-1`` and the
``i``-th generated token sits at ``L + i``. Each family maps them to its own rotary positions (M-RoPE for the
Qwen families adds the prompt's ``rope_delta``), so a pruned draft keeps every kept token at its original place
while its cache is shorter than the sequence.

Pruned and scored prefills do not go through the model's top-level ``forward``; they build the language model's
inputs themselves, with the model's own public methods (``get_input_embeddings``, ``get_image_features``,
``get_video_features``, ``get_placeholder_mask``), then run ``model.get_decoder()`` and the output embeddings:

1. :meth:`VLMAdapter.embed_prompt` merges the visual features (family hook :meth:`VLMAdapter.visual_features`)
   into the text embeddings, giving the language-model inputs of the whole prompt (plus family extras from
   :meth:`VLMAdapter.extra_prompt_inputs`, e.g. Qwen3-VL's deepstack features);
2. :meth:`VLMAdapter.select_prompt` keeps some prompt positions of those inputs (the pruned draft keeps ``keep``;
   the scored prefill cuts the prompt in two chunks with it);
3. the language model runs the kept positions at their original rotary positions.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, NamedTuple

import torch
from transformers.cache_utils import Cache, DynamicCache
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from ..cache import cache_kwarg, new_cache, row_caches
from ..errors import InvalidInputError
from .attention import model_lock, visual_scores
from .data import DecodeState, Prefill, PromptLayout
from .media import MediaRows
from .prompt_inputs import PromptInputs


class _PromptRows(NamedTuple):
    """A prompt as the decoder takes it (:meth:`VLMAdapter._prompt_rows`)."""

    prompt: dict[str, Any]  # inputs_embeds [1, K, D] and the family's extra inputs
    positions: torch.Tensor  # [1, K] or [3, 1, K] rotary positions of the K positions run
    rope_ids: torch.Tensor | None  # prompt_rope's position ids of the whole prompt (None: plain positions)
    rope_delta: torch.Tensor
    layout: PromptLayout
    visual_tokens: int  # visual tokens among the K


NO_VIDEO_TOKEN = -1
"""The video placeholder id of a family that reads pictures only (:meth:`VLMAdapter.visual_token_ids`): no token has
it."""


class VLMAdapter(MediaRows, PromptInputs):
    """Base adapter; subclasses set ``model_types`` and override the position/embedding hooks."""

    model_types: ClassVar[tuple[str, ...]] = ()
    layout_fields: ClassVar[tuple[str, ...]] = ()
    """Config fields (dotted paths) that decide how many visual tokens a picture or video becomes and how its
    pixels are laid out: the draft reads the target's processor outputs, so a draft must agree on each (its
    vision tower may be smaller). :func:`vlmspec.loading.check_compatible` compares them."""
    reads_pictures: ClassVar[bool] = True
    mtp_draft: ClassVar[bool] = False
    """A multi-token drafter (Gemma 4's assistant): no cache of its own, each node drafted from its parent's state
    (:class:`vlmspec.draft.MTPDraftTree`)."""
    """Whether the model reads the prompt's pictures and videos (a language-model draft reads its text only)."""
    pictures_apart_from_videos: ClassVar[str] = ""
    """Why a prompt (a whole conversation) may not hold both pictures and videos, for the family whose processor
    cannot give both ("" where it can)."""
    fixed_processor_settings: ClassVar[frozenset[str]] = frozenset()
    """Processor settings a request may not change (:mod:`vlmspec.processor_settings`) because the family's model
    fixes them: the vision tower's input size, the patch grid the pixels must be resized to."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._embeddings_path: str | None = None  # found on first use

    @property
    def embeddings(self) -> torch.nn.Module:
        """The language model's input table, ``model.get_input_embeddings()``, reached by its attribute path (found
        once): transformers' lookup costs tens of microseconds, and every decoding forward embeds its tokens. A
        table swapped in later (``resize_token_embeddings``) sits at the same path, so it is the one found."""
        if self._embeddings_path is None:
            table = self.model.get_input_embeddings()
            self._embeddings_path = next((name for name, m in self.model.named_modules() if m is table), "")
            return table
        if not self._embeddings_path:  # not a submodule (a model that builds its table on the fly)
            return self.model.get_input_embeddings()
        return functools.reduce(getattr, self._embeddings_path.split("."), self.model)

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def max_positions(self) -> int | None:
        """The language model's context length, if the config states it."""
        return getattr(self.config.get_text_config(), "max_position_embeddings", None)

    @property
    def reads_target_layer(self) -> int | None:
        """For a draft that reads the target's hidden states (EDD), the target layer it reads; else ``None``."""
        return None

    @property
    def min_video_frames(self) -> int:
        """The fewest frames the family's video processor takes (a shorter video is padded with its last frame)."""
        return 1

    # ---- family hooks -------------------------------------------------------------------------------------
    def visual_token_ids(self) -> tuple[int, int]:
        """(image placeholder id, video placeholder id)."""
        raise NotImplementedError

    def prompt_rope(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rotary position ids of the prompt (``None``: the model's default) and the decode ``rope_delta``."""
        return None, torch.zeros((), dtype=torch.long, device=self.device)

    @staticmethod
    def rope_ids(positions: torch.Tensor, rope_delta: torch.Tensor) -> torch.Tensor:
        """Model ``position_ids`` for ``[n]`` logical positions of generated (text) tokens."""
        return positions[None]  # [1, n]

    # ---- shared ---------------------------------------------------------------------------------------------
    def prompt_layout(self, inputs: dict[str, torch.Tensor]) -> PromptLayout:
        image_id, video_id = self.visual_token_ids()
        ids = inputs["input_ids"][0]
        is_video = ids == video_id
        return PromptLayout(visual=(ids == image_id) | is_video, is_video=is_video)

    @torch.inference_mode()
    def prefill(
        self,
        inputs: dict[str, torch.Tensor],
        keep: torch.Tensor | None = None,
        score_visual: bool = False,
        hidden_layer: int | None = None,
    ) -> Prefill:
        """Run the multimodal prompt.

        Args:
            inputs: processor outputs for one prompt (batch 1), already on the model's device.
            keep: ``[K]`` ascending prompt positions to keep (all text positions plus the kept visual ones);
                ``None`` keeps everything (what :meth:`run_positions` gives, for a model that reads no pictures).
                Only the kept positions enter the cache, each at its original (rotary) position; the decode
                ``rope_delta`` stays the full prompt's, since generated tokens continue from the full prompt's
                logical length.
            score_visual: also return ``visual_scores`` (attention-guided pruning of the draft), only with
                ``keep=None``. The prefill itself is the model's own full forward, exactly what ``generate()`` runs
                (so the target's cache and first token are bit-identical to ``generate()``'s, in every dtype, up to
                the last bits :func:`vlmspec.kernels.onednn_linears` changes on the CPU, which it documents); the
                scores come from a side pass, as SpecVLM's split prefill does, so memory stays bounded over long
                visual prefixes: the text after the last visual token is run again, under eager attention, on top
                of the cache cut back to the visual prefix, and the cache is restored afterwards. Scores are what
                those text queries pay to each visual key (mean over heads, layers and queries). When no text
                follows the last visual token, there is nothing to score and ``visual_scores`` is ``None``.
            hidden_layer: also return ``hidden``, the output of this decoder layer at every prompt position (read
                by a hook during the same forward), only with ``keep=None``.

        Returns:
            The last position's logits, the decoding state and (if asked) the visual scores.

        Raises:
            ValueError: ``keep`` is not a 1-D ascending set of positions inside the prompt.
        """
        if keep is None and self.reads_pictures:
            cache = new_cache(self.model)
            position_ids, rope_delta = self.prompt_rope(inputs)
            with self._layer_output(hidden_layer) as hidden:
                out = self.model(
                    **inputs,
                    position_ids=position_ids,
                    **cache_kwarg(self.model, cache),
                    use_cache=True,
                    logits_to_keep=1,
                    **_no_router_loss(self.model),
                )
            layout = self.prompt_layout(inputs)
            state = DecodeState(cache, rope_delta, layout.num_visual)
            scores = visual_scores(self, inputs, layout, position_ids, state) if score_visual else None
            prefill = Prefill(logits=out.logits[0, -1], state=state, visual_scores=scores)
            if hidden_layer is not None:
                length = inputs["input_ids"].shape[1]
                if position_ids is None:
                    position_ids = torch.arange(length, device=self.device)[None]
                prefill.hidden, prefill.position_ids = hidden[0][0], position_ids
            return prefill
        if score_visual or hidden_layer is not None:
            raise InvalidInputError(
                "score_visual and hidden_layer are for the full (target) prefill; they cannot be combined with keep "
                "or read off a model that reads no pictures"
            )
        return self._pruned_prefill(inputs, keep)

    @torch.inference_mode()
    def prefill_many(
        self,
        prompts: list[dict[str, torch.Tensor]],
        keeps: list[torch.Tensor | None] | None = None,
        score_visual: bool | list[bool] = False,
    ) -> list[Prefill]:
        """:meth:`prefill` (no ``hidden_layer``) of several prompts in one decoder forward: the prefills of the
        requests that join a batch together (:mod:`vlmspec.batching`).

        Each prompt is embedded on its own (its media through the vision tower, its rotary positions, its kept
        positions), exactly as :meth:`prefill` embeds it; the decoder then runs once over the prompts right-padded
        to the longest, under a padding mask, so every position sees its own prompt only and sits at its own
        position. Row ``b``'s cache is its first ``L_b`` entries and its logits those of its last position; its
        visual scores come from :meth:`prefill`'s side pass on that cache. The results are :meth:`prefill`'s, up
        to the float rounding of batched kernels (as a batched ``generate()``'s).

        Args:
            prompts: processor outputs, one prompt (batch 1) each, on the model's device.
            keeps: per prompt, :meth:`prefill`'s ``keep`` (``None`` runs the whole prompt); ``None``: none pruned.
            score_visual: also return ``visual_scores``, as :meth:`prefill` (not with a ``keep``): for every prompt,
                or per prompt.

        Returns:
            One :class:`Prefill` per prompt, in order.
        """
        keeps = keeps or [None] * len(prompts)
        scores = score_visual if isinstance(score_visual, list) else [score_visual] * len(prompts)
        if any(score and keep is not None for score, keep in zip(scores, keeps, strict=True)):
            raise InvalidInputError(
                "score_visual is for the full (target) prefill; it cannot be combined with keep"
            )
        rows = [self._prompt_rows(inputs, keep) for inputs, keep in zip(prompts, keeps, strict=True)]
        lengths = [row.positions.shape[-1] for row in rows]
        n = max(lengths)
        position_ids = torch.cat(
            [pad_positions(row.positions, n) for row in rows], dim=-2
        )  # [B, n] or [3, B, n]
        ends = torch.tensor(lengths, device=self.device)  # [B]
        mask = (
            torch.arange(n, device=self.device)[None] < ends[:, None]
        ).long()  # [B, n] 1: prompt, 0: padding
        cache = new_cache(self.model)
        with model_lock(self.model):
            hidden = self._run_language_model(
                self.join_prompts([r.prompt for r in rows], n), position_ids, cache, mask
            )
            last = hidden[torch.arange(len(prompts), device=self.device), ends - 1]  # [B, D]
            logits = self.model.get_output_embeddings()(last)  # [B, V]
        prefills = []
        for b, (row, own, inputs) in enumerate(zip(rows, row_caches(cache, lengths), prompts, strict=True)):
            state = DecodeState(own, row.rope_delta, row.visual_tokens)
            paid = visual_scores(self, inputs, row.layout, row.rope_ids, state) if scores[b] else None
            prefills.append(Prefill(logits=logits[b], state=state, visual_scores=paid))
        return prefills

    def _prompt_rows(self, inputs: dict[str, torch.Tensor], keep: torch.Tensor | None) -> _PromptRows:
        """One prompt ready for the decoder: its embedded inputs and rotary positions, of the positions ``keep``
        (all of them for ``None``)."""
        length = inputs["input_ids"].shape[1]
        rope_ids, rope_delta = self.prompt_rope(inputs)
        positions = (
            torch.arange(length, device=self.device)[None] if rope_ids is None else rope_ids
        )  # [.., 1, L]
        layout = self.prompt_layout(inputs)
        prompt = self.embed_prompt(inputs)
        if keep is None:
            return _PromptRows(prompt, positions, rope_ids, rope_delta, layout, layout.num_visual)
        keep = _check_keep(keep, length).to(self.device)
        visual = int(layout.visual.to(self.device)[keep].sum())
        return _PromptRows(
            self.select_prompt(prompt, keep), positions[..., keep], rope_ids, rope_delta, layout, visual
        )

    def run_positions(
        self, inputs: dict[str, torch.Tensor], keep: torch.Tensor | None, start: int = 0
    ) -> torch.Tensor:
        """``[K]`` the prompt positions a prefill (:meth:`prefill`, or :meth:`extend` from ``start``) puts in the
        cache: those of ``keep`` from ``start`` on, or all of them (``keep`` ``None``)."""
        if keep is None:
            return torch.arange(start, inputs["input_ids"].shape[1], device=self.device)
        return keep[keep >= start]

    def _pruned_prefill(self, inputs: dict[str, torch.Tensor], keep: torch.Tensor) -> Prefill:
        """:meth:`prefill` of the prompt positions ``keep`` only (the pruned draft).

        Its forwards hold :func:`model_lock`, as every other forward of the model does: the model may be another
        pipeline's target (or this pipeline's own) whose pruning probe, in another thread, switches the decoder to
        eager attention and hooks its layers; run under that switch, this forward would add its own attention to
        the probe's scores, or run eager attention with the mask sdpa built (not causal).
        """
        cache = new_cache(self.model)
        with model_lock(self.model):
            row = self._prompt_rows(inputs, keep)
            hidden = self._run_language_model(row.prompt, row.positions, cache)
            logits = self.model.get_output_embeddings()(hidden[:, -1])[0]  # [V]
        state = DecodeState(cache=cache, rope_delta=row.rope_delta, visual_tokens=row.visual_tokens)
        return Prefill(logits=logits, state=state)

    @torch.inference_mode()
    def extend(
        self,
        state: DecodeState,
        inputs: dict[str, torch.Tensor],
        start: int,
        media: tuple[int, int],
        keep: torch.Tensor | None = None,
        score_visual: bool = False,
        hidden_layer: int | None = None,
    ) -> Prefill:
        """Run the prompt from position ``start`` on, on top of a cache that holds what comes before: the next turn
        of a conversation, or a request reusing an earlier one's prefix (:mod:`vlmspec.prefix_cache`), prefills only
        the tokens the cache does not hold.

        Args:
            state: the decoding state whose cache holds the prompt before ``start`` (every visual token there
                included); its cache grows by the positions run and its ``rope_delta`` becomes this prompt's.
            inputs: processor outputs for the whole prompt (batch 1), on the model's device.
            start: the first prompt position to run (at least one position must follow).
            media: ``(images, videos)``: how many of the prompt's images and videos lie before ``start``; only the
                later ones go through the vision tower (:meth:`media_items`).
            keep: ``[K]`` ascending positions ``>= start`` to run (a pruned draft); ``None`` runs them all.
            score_visual: also return ``visual_scores`` over all the prompt's visual tokens, as :meth:`prefill`.
            hidden_layer: also return ``hidden`` (and ``position_ids``) of the positions run.

        Returns:
            The last position's logits and ``state`` (``cached`` = ``start``).
        """
        ids = inputs["input_ids"]
        length = ids.shape[1]
        position_ids, rope_delta = self.prompt_rope(inputs)
        if position_ids is None:
            position_ids = torch.arange(length, device=self.device)[None]  # [1, L]
        run = self.run_positions(inputs, None, start) if keep is None else keep.to(self.device)
        if run.numel() == 0 or int(run[0]) < start:
            raise InvalidInputError(f"extend runs positions from start={start} on, got {run.tolist()[:8]}")
        run = _check_keep(run, length)
        images, videos = media
        suffix = {  # the per-token inputs from start on (ids; GLM-V's mm_token_type_ids) and the later media
            **{k: v[:, start:] for k, v in inputs.items() if torch.is_tensor(v) and v.shape == ids.shape},
            **self.media_items(inputs, slice(images, None), slice(videos, None)),
        }
        prompt = self.select_prompt(self.embed_prompt(suffix), run - start)
        with self._layer_output(hidden_layer) as hidden:
            last = self._run_language_model(prompt, position_ids[..., run], state.cache)
        state.rope_delta = rope_delta
        logits = self.model.get_output_embeddings()(last[:, -1])[0]  # [V]
        prefill = Prefill(logits=logits, state=state, cached=start)
        layout = self.prompt_layout(inputs)
        if score_visual and bool(layout.visual[start:].any()):  # earlier visual tokens were scored before
            prefill.visual_scores = visual_scores(self, inputs, layout, position_ids, state)
        if hidden_layer is not None:
            prefill.hidden, prefill.position_ids = hidden[0][0], position_ids[..., run]
        return prefill

    def _run_language_model(
        self,
        prompt: dict[str, Any],
        position_ids: torch.Tensor,
        cache: DynamicCache,
        bias: torch.Tensor | dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the decoder on ``n`` prompt positions on top of ``cache``; ``[1, n, D]`` last hidden states.

        ``bias`` ``None`` lets the model build its causal mask (the cache is always passed, so transformers never
        mistakes the gaps of pruned positions for packed sequences); a 2-D padding mask, or the models' own masks
        per layer type (``{"full_attention": ..., "sliding_attention": ...}``), are passed on as they are.
        """
        decoder = self.model.get_decoder()
        out = decoder(
            **prompt,
            position_ids=position_ids,
            attention_mask=bias,
            **cache_kwarg(decoder, cache),
            use_cache=True,
        )
        return out.last_hidden_state

    @contextmanager
    def _layer_output(self, layer: int | None) -> Iterator[list[torch.Tensor]]:
        """Collect the output ``[1, n, D]`` of decoder layer ``layer`` during the forwards run inside the block.

        A forward hook on that layer, removed on exit (``layer`` ``None``: nothing is collected). The hook only
        reads: the forward computes exactly what it computes without it. The block holds :func:`model_lock`.
        """
        found: list[torch.Tensor] = []
        with model_lock(self.model):
            if layer is None:
                yield found
                return
            handle = self._hook_layer_output(layer, found)
            try:
                yield found
            finally:
                handle.remove()

    def _hook_layer_output(self, layer: int, found: list[torch.Tensor]) -> Any:
        """A forward hook appending decoder layer ``layer``'s output ``[1, n, D]`` to ``found``; its handle."""

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            found.append(output[0] if isinstance(output, tuple) else output)

        return self.model.get_decoder().layers[layer].register_forward_hook(hook)

    # ---- decoding ---------------------------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[n]`` token ids -> ``[n, D]`` input rows of the language model."""
        return self.embeddings(tokens)

    def row_inputs(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs for ``[B, n, W]`` input rows (:meth:`embed`'s): ``inputs_embeds`` (a family whose rows
        carry more, Gemma 4's per-layer inputs, splits them)."""
        return {"inputs_embeds": rows}

    def root_rows(self, pending: torch.Tensor, root: torch.Tensor) -> torch.Tensor:
        """Input rows ``[p + 1, D]`` of a draft's first forward of a step: the ``[p]`` pending tokens, the root."""
        return self.embed(torch.cat([pending, root.reshape(1)]))

    @torch.inference_mode()
    def run(
        self,
        cache: Cache,
        rows: torch.Tensor,
        position_ids: torch.Tensor,
        bias: torch.Tensor,
        hidden_layer: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ``n`` input rows per request on top of the cache: the one forward every decoding call ends in.

        Args:
            cache: the KV cache of ``B`` requests (a batch-1 ``DynamicCache``/``RowCache``, or a ``BatchCache``).
            rows: ``[B, n, D]`` input rows (token embeddings, or an EDD draft's soft-prompt rows).
            position_ids: the model's rotary ``position_ids`` (``[B, n]``, or ``[3, B, n]`` with M-RoPE).
            bias: ``[B, 1, n, keys]`` additive attention mask.
            hidden_layer: also return the output of this decoder layer.

        Returns:
            ``[B, n, V]`` logits and (when asked) ``[B, n, D]`` hidden states of ``hidden_layer``.
        """
        with self._layer_output(hidden_layer) as hidden:
            logits = self._logits(cache, rows, position_ids, bias)
        return logits, (hidden[0] if hidden else None)

    def _logits(
        self,
        cache: Cache,
        rows: torch.Tensor,
        position_ids: torch.Tensor,
        bias: torch.Tensor | dict[str, torch.Tensor],
    ) -> torch.Tensor:
        """The model call of :meth:`run`: ``[B, n, V]`` logits of ``rows`` on top of ``cache`` (``bias``: the
        additive mask, or one per layer type for a model whose layers differ, as transformers takes them)."""
        return self.model(
            **self.row_inputs(rows),
            position_ids=position_ids,
            attention_mask=bias,
            **cache_kwarg(self.model, cache),
            use_cache=True,
            **_no_router_loss(self.model),
        ).logits

    @torch.inference_mode()
    def forward_hidden(
        self,
        state: DecodeState,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor,
        layer: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, plus the output ``[n, D]`` of decoder layer ``layer`` at the ``n`` tokens."""
        rope = self.rope_ids(positions, state.rope_delta)
        logits, hidden = self.run(state.cache, self.embed(tokens)[None], rope, bias, layer)
        return logits[0], hidden[0]

    @torch.inference_mode()
    def forward_root(
        self,
        state: DecodeState,
        pending: torch.Tensor,
        root: torch.Tensor,
        positions: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """A draft's first forward of a step: the ``[p]`` pending rows, then the root; ``[p + 1, V]`` logits."""
        rope = self.rope_ids(positions, state.rope_delta)
        return self.run(state.cache, self.root_rows(pending, root)[None], rope, bias)[0][0]

    @torch.inference_mode()
    def forward(
        self, state: DecodeState, tokens: torch.Tensor, positions: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        """Feed ``n`` new tokens on top of the cache.

        Args:
            state: decoding state; its cache grows by ``n`` entries.
            tokens: ``[n]`` token ids.
            positions: ``[n]`` logical positions.
            bias: ``[1, 1, n, cache_len + n]`` additive attention mask.

        Returns:
            ``[n, V]`` logits.
        """
        rope = self.rope_ids(positions, state.rope_delta)
        return self.run(state.cache, self.embed(tokens)[None], rope, bias)[0][0]


def config_value(config: Any, key: str) -> Any:
    """``config.key`` (``None`` where it has none). A config whose layers differ (Gemma 4's local and global layers:
    their ``head_dim`` and ``num_key_value_heads``) refuses to give a per-layer value on the whole; its saved value,
    the local layers', is read then."""
    try:
        return getattr(config, key, None)
    except AmbiguousGlobalPerLayerAttributeError:
        return config.to_dict().get(key)


def layer_config(config: Any, index: int) -> Any:
    """Layer ``index``'s view of a text config whose layers differ (Gemma 4's: its own ``head_dim`` and
    ``num_key_value_heads``), or the config itself where they do not."""
    return config.per_layer_config[index] if getattr(config, "per_layer_config", None) else config


def pad_positions(position_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Right-pad rotary ``position_ids`` (``[..., 1, k]``) to ``n`` by repeating the last one."""
    k = position_ids.shape[-1]
    if k == n:
        return position_ids
    return torch.cat([position_ids, position_ids[..., -1:].expand(*position_ids.shape[:-1], n - k)], dim=-1)


def _check_keep(keep: torch.Tensor, length: int) -> torch.Tensor:
    """Validate ``keep`` (``[K]`` ascending unique positions in ``[0, length)``) and return it as long."""
    if not torch.is_tensor(keep) or keep.ndim != 1 or keep.numel() == 0:
        shape = tuple(keep.shape) if torch.is_tensor(keep) else type(keep).__name__
        raise InvalidInputError(f"keep must be a non-empty 1-D tensor of prompt positions, got {shape}")
    if keep.dtype.is_floating_point or keep.dtype == torch.bool:
        raise InvalidInputError(
            f"keep must hold integer positions, got dtype {keep.dtype}; pass e.g. mask.nonzero().flatten()"
        )
    keep = keep.long()
    if int(keep[0]) < 0 or int(keep[-1]) >= length or not bool((keep[1:] > keep[:-1]).all()):
        raise InvalidInputError(
            f"keep must be strictly ascending positions in [0, {length}) (the prompt length), got "
            f"first={int(keep[0])}, last={int(keep[-1])}; build it with vlmspec.pruning.select_prompt_positions"
        )
    return keep


def _no_router_loss(model: torch.nn.Module) -> dict[str, bool]:
    """``output_router_logits=False`` for a mixture-of-experts model (its checkpoint may turn it on, as training
    recipes do): its forward would then compute the load-balancing loss over the attention mask, which a tree's 4-D
    mask is not shaped for. Nothing for the other models."""
    return {"output_router_logits": False} if _takes_router_flag(type(model)) else {}


@functools.cache
def _takes_router_flag(model_class: type) -> bool:
    return "output_router_logits" in inspect.signature(model_class.forward).parameters
