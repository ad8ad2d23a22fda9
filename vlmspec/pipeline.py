"""``VLMSpecPipeline``: a target VLM, a draft VLM of the same family, a processor and a tree policy.

    pipe = VLMSpecPipeline.from_pretrained(target, draft, policy="static")
    out = pipe(image, "Describe this image.")   # out.text, out.token_ids, out.stats

Components are plain attributes and can be swapped (``pipe.policy = get_policy("chain", gamma=4)``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from . import hf_compat
from .batching import DRAFT_FIRST, TARGET, Batcher, RowAdapter
from .chat import Chat
from .costs import BudgetFactor, ForwardCosts
from .draft import draft_vocab
from .engine import DraftPrompt, SpecOutput, speculative_generate
from .errors import InputTypeError, InvalidInputError
from .inputs import ImageInput, VideoInput, check_num_frames, check_prompt_inputs, check_token_ids, on_device
from .kernels import cudnn_attention_default, decoding_kernels
from .loading import check_attention, check_compatible, load_pair, model_options
from .models import EDDDraft, VLMAdapter, adapter_for
from .models.edd import check_target
from .named_pairs import is_pipeline_folder
from .policies import TreePolicy, available_policies, get_policy, policy_with
from .prefix_cache import PrefixCache
from .probe import cached_costs
from .prompting import PromptBuilder
from .pruning import PruningConfig, pruning_config
from .reasoning import ParserAttribute, ReasoningParser, reply_reasoning, split_reply
from .requests import (
    PreparedRequest,
    Requests,
    batch_rows,
    call_arguments,
    check_length,
    check_requests,
    decoding_settings,
    naming_request,
    request_kwargs,
)
from .saving import check_request_settings, read_settings, restore_settings, save_pipeline, saved_policy
from .scores import ScoreLog, check_output_scores, continuation_ids, continuation_logits
from .streaming import StreamPiece, check_stream_kwargs, check_streamer, stream_call
from .structured import StructuredOutputs

DEFAULT_POLICY = "sage"


class VLMSpecPipeline(PromptBuilder):
    """Speculative decoding for a target/draft VLM pair.

    Args:
        target: the target ``*ForConditionalGeneration`` model.
        draft: the draft model of the same family and vocabulary (``None`` only for ``policy="ar"``).
        processor: the target's processor (tokenizer + image/video processors + chat template).
        policy: a registered policy name or a :class:`TreePolicy` instance.
        pruning: how the draft prunes visual tokens: a :class:`PruningConfig`, or the method name
            ``"attention"`` (SpecVLM's verifier-guided scheme, default) / ``"uniform"``.
        prune_ratio: fraction of visual tokens the draft drops, for images and videos alike, applied as given;
            ``None`` keeps :class:`PruningConfig`'s defaults (the SAGE paper's 0.8 for images and 0.9 for videos,
            never below 64 tokens per modality: pruning that pays for itself, see :mod:`vlmspec.pruning`); 0
            disables pruning.
        **policy_options: options of the named policy's config. The node budget and depth options you leave out
            (and PCT's cost ratio) are fitted to this machine when the policy is attached: see :attr:`costs`.

    Attributes:
        target_adapter, draft_adapter: the family adapters (:mod:`vlmspec.models`) the target and the draft run
            through: a decoding forward ends in their ``run`` (a Gemma 4 assistant's in its inner model).
        costs: the measured forward costs of this pair on this machine (:class:`~vlmspec.costs.ForwardCosts`),
            which size every tree: the first policy with a budget or depth the user did not set triggers the
            cost probe (:func:`vlmspec.probe.cached_costs`: a few seconds, once per machine, model shapes and
            dtype, then read from disk). Assign your own (e.g. a probe after a real prompt) and re-assign
            ``pipe.policy`` to refit it. :meth:`TreePolicy.fit` says which options it sets and how.
        budget_factor: the most a verification may cost, in one-token target forwards, under the automatic node
            budget (a finite number >= 1, default 2; see :mod:`vlmspec.costs`).
        onednn_linears: run the models' fp32 CPU linear layers through oneDNN while generating (default True; see
            :mod:`vlmspec.kernels`: a tree's few-row products are up to 2.7x faster than torch's default on the CPU).
            Set it to False for torch's own kernels. No effect on GPUs or other dtypes.
        cudnn_attention: keep SDPA's cuDNN backend while decoding on a GPU (default False, ``VLMSPEC_CUDNN_ATTENTION=1``
            sets True: it builds a plan per new query/key length, nearly every speculative forward; see
            :mod:`vlmspec.kernels`).
        prefix_cache: a :class:`~vlmspec.prefix_cache.PrefixCache` every request reuses (its prompt's prefix
            shared with an earlier request's is not prefilled again), or ``None`` (default).
        reasoning_parser: how a thinking model marks its reasoning (:mod:`vlmspec.reasoning`; a name such as
            ``"qwen3"``, or ``None``, default): replies are split into ``out.reasoning`` and ``out.content``, and a
            structure (``structured_outputs``) applies after the reasoning.
        mm_processor_kwargs: the processor's settings every request starts from (vLLM's name;
            :mod:`vlmspec.processor_settings`: ``{"max_pixels": 401408}``); a request's own win. ``{}`` by default.

    Raises:
        ValueError: the draft's family or vocabulary differs from the target's, or the policy is unknown
            or misconfigured.
    """

    budget_factor = BudgetFactor()
    reasoning_parser = ParserAttribute()

    def __init__(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        processor: Any,
        policy: str | TreePolicy = DEFAULT_POLICY,
        pruning: str | PruningConfig = "attention",
        prune_ratio: float | None = None,
        **policy_options: Any,
    ) -> None:
        self.target = target.eval()
        self.draft = draft.eval() if draft is not None else None
        self.processor = processor
        self.target_adapter = adapter_for(target)
        self.draft_adapter = adapter_for(draft, self.target_adapter) if draft is not None else None
        check_attention(target, "target")
        if isinstance(draft, EDDDraft):
            check_target(draft.edd_config, target)
        elif draft is not None:
            check_attention(draft, "draft")
            check_compatible(target, draft, target_tokenizer=getattr(processor, "tokenizer", None))
        self._draft_vocab = draft_vocab(target, draft, processor)
        self.onednn_linears, self.cudnn_attention = True, cudnn_attention_default()
        self.prefix_cache: PrefixCache | None = None
        self.costs: ForwardCosts | None = None
        self.policy = policy_with(policy, policy_options)
        self.pruning = pruning_config(pruning, prune_ratio)

    # ---- components ----------------------------------------------------------------------------------------------
    @property
    def policy(self) -> TreePolicy:
        return self._policy

    @policy.setter
    def policy(self, policy: TreePolicy) -> None:
        if isinstance(policy, str):
            policy = get_policy(policy)
        if not isinstance(policy, TreePolicy):
            raise InputTypeError(
                f"pipe.policy must be a TreePolicy (e.g. get_policy('chain')), got {type(policy).__name__}; "
                f"available policies: {', '.join(available_policies())}"
            )
        if policy.uses_draft and self.draft is None:
            raise InvalidInputError(
                f"policy {policy.name!r} needs a draft model; this pipeline was built without one"
            )
        if policy.uses_draft:
            policy.config.check_vocabulary(self._draft_vocab.proposable)
        if policy.uses_draft and policy.free_hardware_options():
            policy = copy.copy(policy)  # fitted as a copy: one object may serve two pipes
            policy.fit(self.hardware_costs(), self.budget_factor)
            policy.warn_if_slow(self.costs)
        self._policy = policy

    def hardware_costs(self) -> ForwardCosts:
        """:attr:`costs`, measured (or read from the on-disk cache) on first use."""
        if self.costs is None:
            kernels = (
                f"{'onednn' if self.onednn_linears else 'torch'}{'+cudnn' if self.cudnn_attention else ''}"
            )
            self.costs = cached_costs(self.target, self.draft, self.kernels(), kernels)
        return self.costs

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    # ---- loading -----------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        policy: str | TreePolicy | None = None,
        torch_dtype: str | torch.dtype | None = "auto",
        device_map: str | dict[str, Any] | None = None,
        trust_remote_code: bool = False,
        pruning: str | PruningConfig | None = None,
        prune_ratio: float | None = None,
        calibration: str | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        reasoning_parser: str | ReasoningParser | None = None,
        **policy_options: Any,
    ) -> VLMSpecPipeline:
        """Load a target/draft pair from hub ids, local folders or a named pair.

        With no model named, this loads the embedded default ``testbed-base@cpu``: the trained testbed ``base``
        pair that ships with the package (see :mod:`vlmspec.testbed`), its target inflated exactly to a 105M
        language model so that it costs what a real target costs against its draft. ``"testbed-mini"``,
        ``"testbed-base"`` and ``"tiny"`` (optionally ``":<family>"`` and ``"@<calibration>"``) name pairs; see
        :mod:`vlmspec.named_pairs`.

        A folder written by :meth:`save_pretrained` loads back as it was saved: its pair, policy, the options set
        on it, its pruning, processor settings and reasoning parser (the machine-fitted options are fitted again
        here). Arguments given here win: a ``policy`` replaces the saved one with its options; ``policy_options``
        alone go on top of the saved ones; ``mm_processor_kwargs`` and ``reasoning_parser`` replace the saved ones.

        Args:
            target: hub id, folder or pair name of the target model (its processor is loaded from the same
                place), or a saved pipeline's folder; ``None``: the default pair.
            draft: hub id or folder of the draft model (``None`` only with ``policy="ar"``, a pair name or a
                saved pipeline).
            policy: policy name or instance (``None``: a saved pipeline's, else ``"sage"``).
            torch_dtype: passed to ``from_pretrained`` (``"auto"``: the checkpoint's dtype).
            device_map: passed to accelerate (e.g. ``"auto"`` to spread a large target over several GPUs).
                Without it, models go to the GPU when one is present, else stay on the CPU.
            trust_remote_code: only when you trust the checkpoints' code; off by default.
            pruning, prune_ratio: the draft's visual-token pruning (see the class docstring; ``None``: a saved
                pipeline's, else ``"attention"``).
            calibration: inflate the loaded pair to this calibration's shapes (see
                :mod:`vlmspec.testbed.calibrate`); a pair name's ``@<calibration>`` sets it too.
            mm_processor_kwargs: the processor settings every request starts from (:attr:`mm_processor_kwargs`;
                ``None``: a saved pipeline's, else none).
            reasoning_parser: :attr:`reasoning_parser` (``None``: a saved pipeline's, else none; ``"none"``: none,
                whatever was saved).
            **policy_options: the policy's config options; also ``attn_implementation`` ('sdpa', 'eager') and
                ``dtype`` (transformers 5's name for ``torch_dtype``), passed to both models' ``from_pretrained``,
                ``chat_template`` (a template's text, instead of the processor's own), ``quantization_config`` /
                ``draft_quantization_config`` (:mod:`vlmspec.quantization`).
        """
        loading, policy_options = model_options(policy_options)  # the models' own keywords apart
        saved = read_settings(target) if is_pipeline_folder(target) else {}
        if policy is None and saved:  # its policy, the options given here on top (an error names its file)
            policy, policy_options = saved_policy(target, saved, policy_options), {}
        policy = policy if policy is not None else DEFAULT_POLICY
        policy = policy_with(policy, policy_options)  # a bad name or option fails before any model loads
        pruning = pruning if pruning is not None else saved.get("pruning", "attention")
        given = {"mm_processor_kwargs": mm_processor_kwargs, "reasoning_parser": reasoning_parser}
        check_request_settings(target, saved, given)
        models = load_pair(target, draft, torch_dtype, device_map, trust_remote_code, calibration, **loading)
        pipe = cls(*models, policy=policy, pruning=pruning, prune_ratio=prune_ratio)
        restore_settings(pipe, target, saved, given)
        return pipe

    def save_pretrained(self, folder: str | Path) -> Path:
        """Save the pair and this pipeline's policy, the options set on it, its pruning, :attr:`mm_processor_kwargs`
        and :attr:`reasoning_parser` into ``folder`` (:mod:`vlmspec.saving`), for :meth:`from_pretrained` (or any
        entry point's ``--target``) to load back."""
        return save_pipeline(self, folder)

    def default_batch_size(self) -> int:
        """The batch size throughput jobs use when none is given: from :attr:`costs`, the smallest batch whose
        expected throughput with :attr:`policy` reaches 90% of the best (:meth:`ForwardCosts.batch_size`)."""
        return self.hardware_costs().batch_size(self.budget_factor, speculative=self.policy.uses_draft)

    def kernels(self) -> contextlib.AbstractContextManager[int]:
        """The context both models generate in (:func:`~vlmspec.kernels.decoding_kernels`): oneDNN linears on the CPU
        when :attr:`onednn_linears` is set, SDPA's cuDNN backend off unless :attr:`cudnn_attention` is."""
        models = (self.target, self.draft)
        return decoding_kernels(*models, onednn=self.onednn_linears, cudnn_attention=self.cudnn_attention)

    # ---- generation ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def reference_generate(
        self, inputs: dict[str, torch.Tensor], max_new_tokens: int, structured_outputs: Any = None
    ) -> list[int]:
        """The new ids of the target's own greedy ``generate()`` on ``inputs`` (with xgrammar's processor under
        ``structured_outputs``, after the reasoning as :attr:`reasoning_parser` says): what users run without
        vlmspec, and what greedy speculative output equals."""
        return hf_compat.reference_generate(self, inputs, max_new_tokens, structured_outputs)

    def token_logprobs(self, inputs: Mapping[str, torch.Tensor], token_ids: Sequence[int]) -> torch.Tensor:
        """``[n, V]`` float32 log-probabilities of the target's next token before each of the ``n`` ``token_ids``,
        given ``inputs`` (:meth:`prepare_inputs`'s, or a processor's for one prompt): teacher forcing in one forward,
        the raw distribution (no logits processors or sampling warpers).

        ``out.gather(-1, ids[:, None]).sum()`` is a continuation's log-likelihood (lmms-eval's ``loglikelihood``),
        ``exp`` of its negative mean the perplexity, ``-(out.exp() * out).sum(-1)`` the target's entropies.
        """
        checked = check_prompt_inputs(inputs, self._vocab_size(), hf_compat.model_inputs(self.target))
        tokens = continuation_ids(token_ids)
        check_token_ids(torch.as_tensor(tokens), self._vocab_size(), "token_ids")
        on_target = on_device(checked, self.target_adapter.device)
        return continuation_logits(self.target, on_target, tokens).log_softmax(-1)

    @torch.inference_mode()
    def __call__(
        self,
        image: ImageInput | Sequence[ImageInput] | None = None,
        prompt: str | None = None,
        video: VideoInput | None = None,
        max_new_tokens: int = 128,
        do_sample: bool = False,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Mapping[int, float] | None = None,
        min_new_tokens: int | None = None,
        stop_strings: str | Sequence[str] | None = None,
        num_frames: int = 8,
        prune_ratio: float | None = None,
        streamer: Any = None,
        messages: Sequence[dict] | None = None,
        inputs: Mapping[str, Any] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        output_scores: bool = False,
        structured_outputs: StructuredOutputs | Mapping[str, Any] | None = None,
        tools: Sequence[dict] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        mm_processor_kwargs: Mapping[str, Any] | None = None,
        **unknown: Any,
    ) -> SpecOutput:
        """Generate a reply to ``prompt`` about ``image`` (and/or ``video``), or to a conversation (``messages``).

        Args:
            image: a PIL image, an image path, a list of them, or ``None`` (text only / video only).
            prompt: the user's text.
            video: a video file path or a list of frames (PIL images or HxWx3 uint8 arrays), or a
                :class:`~vlmspec.VideoClip` of one (a time window: ``VideoClip("clip.mp4", start=2.0, end=6.5)``).
            max_new_tokens: the most tokens to generate.
            do_sample: sample from the target's distribution instead of greedy decoding. ``temperature``,
                ``top_k``, ``top_p`` default to the target's ``generation_config`` as in ``generate()``; ``seed``
                makes a run repeatable. The output follows the target's own sampling distribution whatever the tree.
            repetition_penalty: as ``generate(repetition_penalty=...)`` (default: the target's ``generation_config``'s;
                1.0 is none), greedy and sampled alike, so the output stays ``generate()``'s (:mod:`vlmspec.processors`).
            presence_penalty, frequency_penalty, logit_bias: OpenAI's (and vLLM's): each token's logit loses
                ``presence_penalty`` once it was generated and ``frequency_penalty`` per time, and gains
                ``logit_bias[token]``; the reply is then the target's own under those logits (tree nodes included).
            min_new_tokens: EOS cannot end the reply before this many new tokens, as in ``generate()``.
            stop_strings: a string or strings that end generation (as ``generate()``; default: the config's).
            num_frames: frames sampled evenly from a video file.
            prune_ratio: overrides ``pipe.pruning``'s ratios for this call, applied as given (no ``min_keep``
                floor; 0 disables pruning).
            messages: instead of ``image``/``prompt``/``video``: a conversation in transformers' chat format
                (``[{"role": "user", "content": [{"type": "image", "image": ...}, {"type": "text", "text": ...}]}]``),
                system, user and assistant turns, images and videos in any turn (:meth:`prepare_messages`).
            inputs: instead of the above: one prompt's processor outputs, as ``target.generate(**inputs)`` takes
                them (``input_ids`` ``[1, L]``, ``pixel_values``, ...), for prompts built outside the pipeline.
            streamer: a transformers streamer (``TextStreamer``, ``TextIteratorStreamer``, anything with
                ``put``/``end``), driven as ``generate(streamer=...)`` drives it: the prompt's ids first, then each
                verification step's tokens together (see :mod:`vlmspec.streaming`).
            eos_token_id: the token id(s) that end generation, as ``generate(eos_token_id=...)`` (default: the
                target's ``generation_config``'s; ``[]``: none, decode to ``max_new_tokens`` or a stop string).
            output_scores: also return the target's logits and scores behind each new token (``output.scores``,
                :class:`~vlmspec.scores.TokenScores`), as ``generate(output_logits=True, output_scores=True)``.
            structured_outputs: the reply follows a JSON schema, a regular expression, a list of choices or a
                grammar (a :class:`~vlmspec.StructuredOutputs` or a dict of its fields: ``{"json": schema}``), as
                the target's own under that constraint (:mod:`vlmspec.structured`).
            tools: with ``messages``: function specs the chat template renders (``apply_chat_template(tools=...)``).
            chat_template_kwargs: with ``messages``: the chat template's variables (Qwen3's ``{"enable_thinking":
                False}``), as ``apply_chat_template(**chat_template_kwargs)`` takes them.
            mm_processor_kwargs: the processor's settings for this request's pictures and videos, over
                :attr:`mm_processor_kwargs` (``{"max_pixels": 401408}``; :mod:`vlmspec.processor_settings`).
            **unknown: none is taken: a keyword argument not listed here is refused by name, with the nearest
                valid name (``max_tokens``: did you mean ``max_new_tokens``?).

        Returns:
            :class:`SpecOutput` with ``text``, ``token_ids`` and ``stats`` (and the reply's ``reasoning`` and
            ``content``, as :attr:`reasoning_parser` splits it).
        """
        arguments = dict(locals())
        del arguments["self"]
        arguments.update(arguments.pop("unknown"))  # refused by _prepare, as pipe.batch refuses them
        ((_, result),) = self.batch_iter([self._prepare(arguments)], batch_size=1)
        if isinstance(result, BaseException):
            raise result
        return result

    @torch.inference_mode()
    def batch(
        self, requests: Sequence[dict[str, Any]], batch_size: int = 8, return_exceptions: bool = False
    ) -> list[SpecOutput | Exception]:
        """Generate replies to many requests, ``batch_size`` of them decoding together (:mod:`vlmspec.batching`).

        Each request keeps its own tree, policy state, stop conditions and sampler. Greedy: the output of each is
        what ``pipe(**request)`` returns, the target's own ``generate()``, token for token, at any batch size (up to
        floating-point differences of batched kernels). Sampling: each reply is drawn from the target's own
        distribution, and a seeded request gives the same reply at the same batch size. At another batch size it
        is the same reply only when the policy leaves nothing to the machine (every node budget and depth option
        set, and ``sage``'s node and level prices: ``policy.free_hardware_options()`` is empty); otherwise :meth:`batch_policy` refits those options
        for each batch size, the trees differ, and the reply is another draw from the same distribution, not the
        same draw (see docs/batching.md). As a request ends, the next one takes its place.

        Args:
            requests: a list of requests, each one dict of :meth:`__call__` keyword arguments
                (``{"image": ..., "prompt": ...}``, ``{"messages": [...]}``, ``{"video": ..., "prompt": ...,
                "max_new_tokens": 64}``, ...).
            batch_size: how many requests decode at once.
            return_exceptions: put a failing request's exception in its place in the output instead of raising
                it (the other requests are decoded either way).

        Returns:
            One :class:`SpecOutput` (or exception) per request, in the order of ``requests``.
        """
        check_requests(requests, "pipe.batch")
        calls: list[PreparedRequest | Exception] = []
        for i, request in enumerate(requests):
            try:
                calls.append(self._prepare(request_kwargs(request)))
            except (TypeError, ValueError, OSError) as error:
                if not return_exceptions:
                    raise naming_request(error, i) from error
                calls.append(error)
        todo = [c for c in calls if not isinstance(c, Exception)]
        done = dict(self.batch_iter(todo, batch_size))
        order = iter(range(len(todo)))
        results = [c if isinstance(c, Exception) else done[next(order)] for c in calls]
        for result in results:
            if isinstance(result, BaseException) and not return_exceptions:
                raise result
        return results

    @torch.inference_mode()
    def batch_iter(
        self, requests: Requests, batch_size: int = 8
    ) -> Iterator[tuple[int, SpecOutput | Exception]]:
        """:meth:`batch` as results come: ``(index, output or exception)`` as each request ends.

        For long jobs: ``requests`` is read lazily, one request as a row of the batch frees, and a request may be a
        function that builds its keyword arguments only then (so that a job reads each video when its turn comes;
        a failure there is that request's result, like any other bad input). For requests that arrive while the
        batch decodes (a server), ``requests`` is a :class:`~vlmspec.requests.RequestFeed`.
        """
        check_requests(requests, "pipe.batch_iter")
        # trees fitted to batch_size all the same; prefills merged unless a prefix cache shares them instead
        batcher = Batcher(batch_rows(requests, batch_size), merge_prefills=self.prefix_cache is None)
        policy = self.batch_policy(batch_size)
        row = lambda adapter, order: RowAdapter(adapter, batcher, order)  # noqa: E731
        job = lambda i, request: partial(self._decode, request, policy, i, row, self.prefix_cache)  # noqa: E731
        with self.kernels():
            for index, output, error in batcher.map(requests, job):
                yield index, (output if error is None else error)

    def _prepare(
        self, request: dict[str, Any], generation_config: Any = None, custom: Any = None
    ) -> PreparedRequest:
        """Everything one request (:meth:`__call__`'s keyword arguments) needs before decoding: its steps 1 and 2
        (``generation_config``, ``custom``: a :meth:`generate` call's config and own callables).

        Raises:
            TypeError: an argument :meth:`__call__` does not take, named with the nearest valid one.
        """
        a = SimpleNamespace(**call_arguments(_CALL_SIGNATURE, request))
        image, prompt, video, num_frames = a.image, a.prompt, a.video, a.num_frames
        # 1. Check the request before any model work.
        settings = decoding_settings(
            a, self.target, self.tokenizer, self._vocab_size(), generation_config, custom
        )
        check_streamer(a.streamer)
        check_num_frames(num_frames)
        want_scores = check_output_scores(a.output_scores)
        extras = [name for name in ("tools", "chat_template_kwargs") if getattr(a, name) is not None]
        if extras and a.messages is None:
            raise InvalidInputError(f"{' and '.join(extras)} go with messages=[...]: the template reads them")
        # 2. Build the multimodal prompt once; the draft sees the same inputs.
        if a.inputs is not None:
            if a.messages is not None or prompt is not None or image is not None or video is not None:
                raise InvalidInputError("give either inputs or messages or image/prompt/video, not several")
            if a.mm_processor_kwargs is not None:
                raise InvalidInputError(
                    "mm_processor_kwargs are for the processor: inputs= were processed already"
                )
            checked = check_prompt_inputs(a.inputs, self._vocab_size(), hf_compat.model_inputs(self.target))
            inputs = on_device(checked, self.target_adapter.device)
        elif a.messages is not None:
            if prompt is not None or image is not None or video is not None:
                raise InvalidInputError("give either messages or image/prompt/video, not both")
            inputs = self.prepare_messages(
                a.messages, num_frames, a.tools, a.chat_template_kwargs, a.mm_processor_kwargs
            )
        elif prompt is None:
            raise InputTypeError("pipe(...) needs a prompt (pipe(image, prompt)) or messages=[...]")
        else:
            inputs = self.prepare_inputs(image, prompt, video, num_frames, a.mm_processor_kwargs)
        check_length(inputs["input_ids"].shape[1], a.max_new_tokens, self.target_adapter.max_positions)
        prompt_ids = inputs["input_ids"][0]  # read on the host only with a reasoning parser
        reasoning = reply_reasoning(self.reasoning_parser, self.tokenizer, prompt_ids, a.chat_template_kwargs)
        grammar = None if settings.grammar is None else settings.grammar.after(reasoning, self.tokenizer)
        draft = None
        if self.policy.uses_draft:
            pruning = self.pruning if a.prune_ratio is None else pruning_config(self.pruning, a.prune_ratio)
            draft = DraftPrompt.pruned(self.draft_adapter, inputs, pruning, self._draft_vocab)
        return PreparedRequest(
            inputs,
            settings.stop,
            settings.sampling,
            draft,
            streamer=a.streamer,
            processing=settings.processing,
            grammar=grammar,
            reasoning=reasoning,
            scores=partial(ScoreLog, settings.sampling, settings.renormalize) if want_scores else None,
        )

    def batch_policy(self, batch_size: int) -> TreePolicy:
        """:attr:`policy` as requests decoding ``batch_size`` at a time use it: the node budget and depth it left
        to the machine are refitted per request for that batch (:meth:`~vlmspec.costs.ForwardCosts.node_budget`
        with ``rows``), since ``batch_size`` trees share every verification."""
        policy = copy.copy(self.policy)
        if batch_size > 1 and policy.uses_draft and policy.free_hardware_options():
            policy.fit(self.hardware_costs(), self.budget_factor, rows=batch_size)
        return policy

    def _decode(
        self,
        call: PreparedRequest | dict | Callable[[], dict],
        policy: TreePolicy,
        index: int,
        models: Callable[[VLMAdapter, int], Any],
        prefixes: PrefixCache | None = None,
    ) -> SpecOutput:
        """One request: prepare it if needed, decode (streaming each step's tokens when asked), then detokenize.

        ``models(adapter, order)`` gives the adapter as this request sees it (a :class:`RowAdapter` of a batch;
        ``order``: :data:`DRAFT_FIRST` or :data:`TARGET`); ``prefixes``: the prefix cache it reuses and feeds.
        """
        if not isinstance(call, PreparedRequest):
            call = self._prepare(request_kwargs(call() if callable(call) else call, index))
        turn = prefixes.turn(call.inputs, self.target_adapter, models) if prefixes is not None else None
        models = models if turn is None else turn.models(models)
        # 3. Decode: the target and the draft as this request sees them.
        draft = call.draft
        if draft is not None:
            draft = dataclasses.replace(draft, adapter=models(draft.adapter, DRAFT_FIRST))
        streamer, on_tokens = call.streamer, None
        if streamer is not None:
            streamer.put(call.inputs["input_ids"].cpu())
            on_tokens = lambda ids: streamer.put(torch.tensor(ids))  # noqa: E731
        scores = call.scores() if call.scores is not None else None
        token_ids, stats = speculative_generate(
            models(self.target_adapter, TARGET),
            call.inputs,
            copy.copy(policy),  # per-request state (the engine resets it); config and costs are shared
            call.stop,
            draft=draft,
            sampling=call.sampling,
            on_tokens=on_tokens,
            processing=call.processing,
            scores=scores,
            grammar=call.grammar,
        )
        if turn is not None:
            turn.end(token_ids)
        if streamer is not None:
            streamer.end()
        # 4. Decode the text (and a thinking model's reasoning and answer apart).
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        logs = None if scores is None else scores.result()
        return SpecOutput(text, token_ids, stats, logs, *split_reply(call.reasoning, text))

    def chat(self, system: str | None = None, **options: Any) -> Chat:
        """A conversation that keeps both models' KV caches between turns (:mod:`vlmspec.chat`).

            chat = pipe.chat(system="You describe pictures.", max_new_tokens=256)
            reply = chat.send("What is in it?", images=image)
            reply = chat.send("And its colour?")   # prefills only this turn's tokens

        Each reply equals ``generate()`` on ``chat.messages`` (greedy), as ``pipe(messages=chat.messages)`` does.

        Args:
            system: the system prompt, if any.
            **options: default keyword arguments of :meth:`__call__` for every turn (``max_new_tokens``,
                ``do_sample``, ``seed``, ``stop_strings``, ...).
        """
        return Chat(self, system=system, **options)

    def stream(
        self,
        image: ImageInput | Sequence[ImageInput] | None = None,
        prompt: str | None = None,
        **kwargs: Any,
    ) -> Iterator[StreamPiece]:
        """Like :meth:`__call__`, yielding :class:`~vlmspec.streaming.StreamPiece` objects as each verification
        step accepts tokens; the last one carries the statistics, and the pieces' texts join to the reply (their
        ``reasoning`` and ``content`` to a thinking model's reasoning and answer).

        ``kwargs`` are :meth:`__call__`'s (``video``, ``max_new_tokens``, ``do_sample``, ``messages``, ``inputs``,
        ...), ``streamer`` aside: ``pipe.stream(messages=[...])`` streams a conversation's reply.
        """
        check_stream_kwargs(kwargs)
        return stream_call(self, image, prompt, kwargs)

    @torch.no_grad()  # the ids it returns are ordinary tensors, as generate()'s (the decoding runs in inference mode)
    def generate(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        """``target.generate(**inputs, ...)`` with speculative decoding, a drop-in for code that already calls it:
        the same ``[B, L + T]`` ids (or output object), each row the target's own greedy output alone (see
        :func:`vlmspec.hf_compat.generate`, which documents the arguments). Keyword arguments that are neither
        generation options nor inputs the model takes are refused by name."""
        return hf_compat.generate(self, input_ids, **kwargs)

    def _vocab_size(self) -> int:
        """How many token ids both models embed: prompt ids must be below it."""
        models = [self.target] if self.draft is None else [self.target, self.draft]
        return min(model.get_input_embeddings().weight.shape[0] for model in models)


_CALL_SIGNATURE = inspect.signature(VLMSpecPipeline.__call__)
