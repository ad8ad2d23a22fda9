"""The ``vlmspec`` lmms-eval model: any lmms-eval image/video benchmark through :class:`vlmspec.VLMSpecPipeline`.

Two classes share one implementation (lmms-eval 0.7.3 resolves a model id to its chat class unless
``--force_simple`` is given; see :mod:`vlmspec_eval.lmms.manifest`):

* :class:`VLMSpecChat` (default, ``is_simple = False``): requests ``(ctx, doc_to_messages, gen_kwargs, doc_id,
  task, split)``; the task's messages (lmms-eval builds them from ``doc_to_visual``/``doc_to_text`` when the task
  has no ``doc_to_messages``) go through the target's chat template as they are (system turns, interleaved text).
* :class:`VLMSpec` (``--force_simple``, ``is_simple = True``): requests ``(ctx, gen_kwargs, doc_to_visual,
  doc_id, task, split)``; media first, then the context (``<image>`` placeholders removed), the pipeline's layout.

Both paths answer ``generate_until_multi_round`` requests (lmms-eval's multi-round protocol, e.g.
``ovo_forward``: see ``VLMSpec.generate_until_multi_round``) and ``loglikelihood`` requests (tasks with
``output_type: loglikelihood`` or ``multiple_choice``), the latter thanks to two workarounds for lmms-eval 0.7.3. Its chat tasks build no such requests
(``ConfigurableMessagesTask.construct_requests`` asserts "Currently messages is used for generation only"), so
the chat model has them built as the simple path builds them and scores them the same way
(:func:`refer_loglikelihood_to_simple_requests`). Its evaluator turns a model output that is neither a string nor
a ``GenerationResult`` into ``str(output)``, so a plain ``(value, is_greedy)`` pair reaches the task as a string
("too many values to unpack"; lmms-eval's own ``dummy`` model fails the same way): the pair travels as a
``GenerationResult``'s ``text``. The value is the continuation's negative log-likelihood, because lmms-eval 0.7.3
picks the lowest (see ``VLMSpec.loglikelihood``).

Lifecycle: ``__init__`` validates ``--model_args`` (before loading anything), builds/loads the pair (rank 0
first under ``accelerate launch``, so a testbed pair is trained once) and one pipeline per process on that
process's device; lmms-eval shards the documents over the processes. ``generate_until`` records each request's
speed stats. ``clean()``, which lmms-eval's evaluator calls on every rank once all requests are answered, gathers
the records onto rank 0, which writes ``vlmspec_speed_<task>.json`` into ``speed_dir`` (default: the CLI's
``--output_path``, next to lmms-eval's ``*_results.json``), adds ``vlmspec_*`` figures to the results'
``throughput`` section, and prints the summary table when the process exits, after lmms-eval has written its
scores (accuracy and speed side by side); without an output folder it prints the speed table at once.
"""

from __future__ import annotations

import atexit
import gc
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from lmms_eval.api.instance import GenerationResult, Instance, TokenCounts
from lmms_eval.api.model import lmms
from loguru import logger
from tqdm import tqdm

from vlmspec import PrefixCache, VLMSpecPipeline
from vlmspec.errors import InvalidInputError, VLMSpecError
from vlmspec.named_pairs import ResolvedPair
from vlmspec.pruning import PruningConfig
from vlmspec.requests import naming_request
from vlmspec.scores import continuation_logits

from .generation import check_policy_decoding, generation_settings, sampling_only, truncate_at_stops
from .media import chat_messages, simple_messages
from .options import ModelOptions, parse_model_args, resolve_pair
from .runtime import lmms_eval_output_path, user_error
from .speed import (
    SampleSpeed,
    accuracy_by_task,
    check_reference,
    check_speed_dir,
    find_results,
    format_summary,
    load_reference,
    shared_wall_seconds,
    task_reports,
    write_reports,
)

__all__ = [
    "VLMSpec",
    "VLMSpecChat",
    "load_pipeline",
    "refer_loglikelihood_to_simple_requests",
    "score_continuation",
    "warm_up",
]


class VLMSpec(lmms):
    """lmms-eval model running lossless tree speculative decoding (simple request path).

    Args:
        **kwargs: ``--model_args`` (see :data:`vlmspec_eval.lmms.options.MODEL_ARGS`) plus lmms-eval's
            ``batch_size``/``max_batch_size``/``device``.

    Raises:
        SystemExit: under lmms-eval's command line, an unknown ``--model_args`` key, a bad value, a missing model or
            an unwritable ``speed_dir``, with the message (:mod:`.runtime`); called from Python, the error itself.
    """

    is_simple = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        try:
            self.options: ModelOptions = parse_model_args(kwargs)
            if self.options.ar_reference is not None:
                check_reference(self.options.ar_reference)
            self.accelerator = Accelerator()
            self._rank = self.accelerator.process_index
            self._world_size = self.accelerator.num_processes
            if self._world_size > 1:  # gloo's threads outliving the interpreter abort the process at exit
                atexit.register(self.accelerator.state.destroy_process_group)
            with self.accelerator.main_process_first():
                self.pair: ResolvedPair = resolve_pair(self.options)
            self.pipe: VLMSpecPipeline | None = load_pipeline(self.options, self.pair, self._device_map())
            self.pipe.mm_processor_kwargs = self.pipe.check_mm_processor_kwargs(
                self.options.mm_processor_kwargs
            )
            self._speed_dir = self.options.speed_dir or lmms_eval_output_path()
            if (
                self._speed_dir is not None
            ):  # on every rank: one that stopped alone would leave the others waiting
                check_speed_dir(self._speed_dir)
        except (
            ValueError,
            OSError,
        ) as err:  # OSError: a folder or hub id that cannot be read, an unwritable folder
            raise user_error(err) from err
        self._device = self.pipe.target.get_input_embeddings().weight.device
        if self.options.warmup:
            warm_up(self.pipe)
        if self.options.prefix_cache_gb:
            self.pipe.prefix_cache = PrefixCache(max_bytes=int(self.options.prefix_cache_gb * 2**30))
        self.pipe.reasoning_parser = self.options.reasoning_parser
        self._samples: list[SampleSpeed] = []
        self._generate_seconds = 0.0  # wall time in generate_until (requests overlap at batch_size > 1)
        self._reports: dict[str, dict[str, Any]] = {}
        self._started = time.time()
        self._cleaned = False
        if self.rank == 0:
            self._announce()

    gen_kwargs_at = 1
    """Where a ``generate_until`` request's ``args`` hold its generation kwargs (simple path: 1, chat path: 2)."""

    # ---- lmms-eval interface ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The target's (input embeddings') device; lmms-eval puts its rank-sync tensors there."""
        return self._device

    @property
    def batch_size(self) -> int:
        """Requests decoded together: ``--batch_size`` (``auto``: the pipeline's choice from its cost probe)."""
        if self.options.batch_size is None:
            return self._pipeline().default_batch_size()
        return self.options.batch_size

    @property
    def tokenizer(self) -> Any:
        return self._pipeline().tokenizer

    def generate_until(self, requests: list[Instance]) -> list[GenerationResult]:
        """Generate a reply per request (greedy unless the request samples; see :mod:`.generation`), ``batch_size``
        requests decoding together (:meth:`VLMSpecPipeline.batch_iter`)."""
        self._check_generation_kwargs(requests)
        results = [GenerationResult(text="")] * len(requests)  # lmms-eval's rank padding stays empty
        todo = [i for i, request in enumerate(requests) if not _is_padding(request)]
        calls = [partial(self._call, requests[i]) for i in todo]  # a list: no batch rows beyond them
        start = time.perf_counter()
        with tqdm(total=len(todo), disable=self.rank != 0, desc="vlmspec generate") as bar:
            for k, out in self._decode(calls, [requests[i] for i in todo]):
                results[todo[k]] = self._result(requests[todo[k]], out)
                bar.update(1)
        self._generate_seconds += time.perf_counter() - start
        return results

    def generate_until_multi_round(self, requests: list[Instance]) -> list[list[str]]:
        """Each request's replies, one per round, for ``generate_until_multi_round`` tasks (e.g. ``ovo_forward``).

        lmms-eval's multi-round protocol (its ``llava_onevision`` model on the simple path, its chat ``vllm``
        model on the chat path): round 0 is the request's own prompt; before round ``k >= 1`` the task is asked
        for that round's prompt with ``round_idx=k``, the replies so far (``previous_output``) and what it
        returned last (``previous_round_info``), and says when to stop (:meth:`_next_round`). Each round is a
        fresh single-turn prompt, as in those models: a round sees earlier replies only through the prompt the
        task builds. Replies are stripped (as ``llava_onevision`` does; lmms-eval strips ``generate_until`` replies
        itself). Rounds run in lock step over the requests, ``batch_size`` requests decoding together.
        """
        self._check_generation_kwargs(requests)
        replies: list[list[str]] = [[] for _ in requests]  # lmms-eval's rank padding gets none
        info: dict[int, Any] = {}
        prompts = {i: self._prompt(r) for i, r in enumerate(requests) if not _is_padding(r)}
        round_idx, start = 0, time.perf_counter()
        while prompts:
            live = list(prompts)
            calls = [partial(self._call, requests[i], prompts[i]) for i in live]
            for k, out in self._decode(calls, [requests[i] for i in live]):
                replies[live[k]].append(self._result(requests[live[k]], out, round_idx).text.strip())
            round_idx += 1
            prompts = {}
            for i in live:
                payload = self._next_round(requests[i], round_idx, list(replies[i]), info.get(i))
                if payload is not None:
                    prompts[i], info[i] = payload
        self._generate_seconds += time.perf_counter() - start
        return replies

    def loglikelihood(self, requests: list[Instance]) -> list[GenerationResult]:
        """Score each request's continuation under the target: ``GenerationResult(text=(nll, is_greedy))``.

        The context (with the request's images/video) goes through the chat template with the generation
        prompt; the continuation's tokens follow it and are scored in one target forward (no draft, so every
        policy gives the same scores). ``nll`` is ``-log p(continuation | context)``, summed over its tokens;
        ``is_greedy`` says whether greedy decoding would produce the continuation.

        Two departures from the ``(logprob, is_greedy)`` pairs that lmms-eval's base class documents, both for
        lmms-eval 0.7.3:

        * the sign: lmms-eval 0.7.3 ranks choices by the *lowest* value (``ConfigurableTask.process_results``
          takes ``argmin`` for ``multiple_choice``, and tasks' own ``process_results`` such as egoschema's do the
          same) because its models return a loss; a log-probability would pick the least likely choice. With
          the summed negative log-likelihood, ``acc`` and ``acc_norm`` are lm-evaluation-harness's (``argmax``
          of the log-likelihood, raw and per character). (``acc_mutual_info`` takes ``argmax`` and is not
          supported; no task lmms-eval 0.7.3 ships uses it.)
        * the wrapper: lmms-eval 0.7.3's evaluator (``unwrap_generation_output``) replaces an output that is
          neither a string nor a ``GenerationResult`` by ``str(output)``, so a plain pair reaches the task as a
          string; inside a ``GenerationResult``'s ``text`` it reaches the task as the pair.
        """
        try:
            return [
                GenerationResult(text=self._score(r))  # type: ignore[arg-type]  # the pair, see above
                for r in tqdm(requests, disable=self.rank != 0, desc="vlmspec loglikelihood")
            ]
        except (VLMSpecError, NotImplementedError) as err:
            raise user_error(err) from err

    def clean(self) -> None:
        """End of generation (lmms-eval calls it on every rank): gather and write speed metrics, free the models."""
        if self._cleaned:
            return
        self._cleaned = True
        self._finish_speed()
        self.pipe = None
        gc.collect()
        super().clean()

    # ---- requests ---------------------------------------------------------------------------------------------
    def _prompt(self, request: Instance) -> dict[str, Any]:
        """The pipeline arguments of a request's prompt (simple path: the context and ``doc_to_visual``)."""
        context, doc_to_visual = request.args[0], request.args[2]
        return {
            "messages": simple_messages(context, doc_to_visual(self._doc(request)) if doc_to_visual else None)
        }

    def _next_round(
        self, request: Instance, round_idx: int, replies: list[str], info: Any
    ) -> tuple[dict[str, Any], Any] | None:
        """Round ``round_idx``'s prompt (as :meth:`_prompt`) and the task's round info, or ``None`` when it stops.

        Simple path: the request's ``doc_to_text`` (its 4th argument) returns ``(visuals, context, terminal,
        previous_output, previous_round_info)``.
        """
        doc_to_text = request.args[3]
        payload = doc_to_text(
            self._doc(request), previous_output=replies, round_idx=round_idx, previous_round_info=info
        )
        if not (isinstance(payload, tuple) and len(payload) == 5):
            raise InvalidInputError(
                f"task {request.args[-2]!r}: its doc_to_text returned {type(payload).__name__} for round "
                f"{round_idx}; a generate_until_multi_round task returns (visuals, context, terminal, "
                "previous_output, previous_round_info) for round_idx >= 1 (lmms-eval's multi-round protocol)"
            )
        visuals, context, terminal, _replies, info = payload
        if terminal:
            return None
        return {"messages": simple_messages(context, visuals)}, info

    def _check_generation_kwargs(self, requests: list[Instance]) -> None:
        """Every request's generation kwargs, before any generation: a bad task YAML fails at once, naming the
        task, not after the requests before its first one have run (their replies would be lost)."""
        for request in requests:
            if _is_padding(request):
                continue
            try:
                settings = generation_settings(
                    request.args[self.gen_kwargs_at], cap=self.options.max_new_tokens
                )
                check_policy_decoding(self._pipeline().policy, settings)
            except (ValueError, NotImplementedError) as err:
                raise user_error(InvalidInputError(f"task {request.args[-2]!r}: {err}")) from None

    def _call(self, request: Instance, prompt: dict[str, Any] | None = None) -> dict[str, Any]:
        """The pipeline call for a request (built when its turn in the batch comes), for its own prompt or the
        given round's (:meth:`_prompt`)."""
        doc_id = request.args[-3]
        settings = generation_settings(request.args[self.gen_kwargs_at], cap=self.options.max_new_tokens)
        return {
            **(prompt or self._prompt(request)),
            "max_new_tokens": settings.max_new_tokens,
            "do_sample": settings.do_sample,
            "temperature": settings.temperature,
            "top_k": settings.top_k,
            "top_p": settings.top_p,
            "repetition_penalty": settings.repetition_penalty,
            "min_new_tokens": settings.min_new_tokens,
            "seed": self.options.seed + int(doc_id) if settings.do_sample else None,
            "stop_strings": settings.stop_strings or None,
            "num_frames": self.options.num_frames,
        }

    def _decode(
        self, calls: Iterable[Callable[[], Any]], requests: list[Instance]
    ) -> Iterator[tuple[int, Any]]:
        """``batch_iter`` over ``calls`` (of ``requests``; each output recorded by :meth:`_result` before the next is
        drawn), raising a failed request's error (a user mistake naming the task and document); then the requests'
        speed records get their share of the wall time, since at ``batch_size`` > 1 they ran side by side
        (:func:`~vlmspec_eval.lmms.speed.shared_wall_seconds`)."""
        first, spans = len(self._samples), []
        for k, out in self._pipeline().batch_iter(calls, self.batch_size):
            if isinstance(
                out, (VLMSpecError, ValueError, TypeError, NotImplementedError, OSError)
            ):  # the inputs'
                doc_id, task, _split = requests[k].args[-3:]
                raise user_error(naming_request(out, doc_id, f"task {task!r}, document")) from out
            if isinstance(out, BaseException):
                raise out
            end = time.perf_counter()
            spans.append((end - out.stats.total_seconds, end))
            yield k, out
        records = zip(self._samples[first:], shared_wall_seconds(spans), strict=True)
        self._samples[first:] = [replace(sample, wall_seconds=share) for sample, share in records]

    def _result(self, request: Instance, out: Any, round_idx: int = 0) -> GenerationResult:
        """The reply of a request (of its round ``round_idx``) from its pipeline output; records its speed."""
        doc_id, task, split = request.args[-3:]
        settings = generation_settings(request.args[self.gen_kwargs_at], cap=self.options.max_new_tokens)
        self._samples.append(
            SampleSpeed.from_stats(task, split, doc_id, out.stats, out.token_ids, round_idx, settings)
        )
        text = truncate_at_stops(out.content, settings.stop_strings)  # the answer, after any reasoning
        return GenerationResult(text=text, token_counts=TokenCounts(output_tokens=len(out.token_ids)))

    def _score(self, request: Instance) -> tuple[float, bool]:
        if _is_padding(request):
            return 0.0, False
        if len(request.args) != 6:  # lmms-eval's unconditional (context, choice) requests of acc_mutual_info
            raise NotImplementedError(
                "the vlmspec model scores (ctx, continuation, doc_to_visual, doc_id, task, split) loglikelihood "
                f"requests; got {len(request.args)} arguments (acc_mutual_info is not supported)"
            )
        context, continuation, doc_to_visual = request.args[:3]
        doc = self._doc(request)
        if callable(continuation):
            continuation = continuation(doc)
        if not isinstance(continuation, str):
            raise TypeError(f"loglikelihood continuation must be a string, got {type(continuation).__name__}")
        messages = simple_messages(context, doc_to_visual(doc) if doc_to_visual else None)
        pipe = self._pipeline()
        inputs = pipe.prepare_messages(messages, self.options.num_frames)
        logprob, greedy = score_continuation(pipe.target, pipe.tokenizer, inputs, continuation)
        return -logprob, greedy

    def _doc(self, request: Instance) -> Any:
        """The request's document (its last three arguments are ``doc_id, task, split`` in every request form)."""
        doc_id, task, split = request.args[-3:]
        return self.task_dict[task][split][doc_id]

    def _pipeline(self) -> VLMSpecPipeline:
        if self.pipe is None:
            raise RuntimeError("the vlmspec model was cleaned up (lmms-eval's clean()); create a new one")
        return self.pipe

    def _device_map(self) -> str | None:
        """``device_map`` for this process: the option, else lmms-eval's ``--device``, else this rank's device."""
        if self.options.device_map is not None:
            return self.options.device_map
        if self.options.device is not None:
            return self.options.device
        if self._world_size > 1:
            return str(self.accelerator.device)
        return None

    def _announce(self) -> None:
        """Log what runs (rank 0)."""
        logger.info(
            "vlmspec: policy {} on {} processes; target {}, draft {} ({})",
            self.options.policy,
            self._world_size,
            self.pair.target,
            self.pair.draft,
            self.pair.source,
        )

    # ---- speed metrics ----------------------------------------------------------------------------------------
    def _finish_speed(self) -> None:
        samples = self._gather(self._samples)
        wall = max(self._gather([self._generate_seconds]))  # the ranks run side by side
        if self.rank != 0 or not samples:
            return
        tasks = sorted({s.task for s in samples})
        reference = load_reference(self.options.ar_reference, tasks) if self.options.ar_reference else None
        self._reports = task_reports(samples, self._run_info(), reference)
        _log_throughput(samples, wall)
        if self._speed_dir is None:
            print(f"\nvlmspec speed summary\n{format_summary(self._reports)}", flush=True)
            return
        paths = write_reports(self._reports, self._speed_dir)
        logger.info("vlmspec: speed metrics written to {}", ", ".join(str(p) for p in paths))
        atexit.register(self._print_summary)

    def _gather(self, samples: list[SampleSpeed]) -> list[SampleSpeed]:
        if self._world_size <= 1:
            return list(samples)
        return list(gather_object(list(samples)))

    def _print_summary(self) -> None:
        results = find_results(self._speed_dir, self._started) if self._speed_dir else None
        print(
            f"\nvlmspec summary ({self.options.policy}; speed files in {self._speed_dir})\n"
            f"{format_summary(self._reports, accuracy_by_task(results))}",
            flush=True,
        )

    def _run_info(self) -> dict[str, Any]:
        return {
            "policy": self.options.policy,
            "target": self.pair.target,
            "draft": self.pair.draft,
            "pair_source": self.pair.source,
            "world_size": self._world_size,
            "device": str(self._device),
            "options": self.options.to_dict(),
        }


class VLMSpecChat(VLMSpec):
    """The chat request path: the task's ``doc_to_messages`` (or lmms-eval's default messages) per request.

    ``loglikelihood`` requests (``loglikelihood``/``multiple_choice`` tasks) come in the simple path's form and
    are scored as there: see :func:`refer_loglikelihood_to_simple_requests`.
    """

    is_simple = False

    gen_kwargs_at = 2

    def __init__(self, **kwargs: Any) -> None:
        refer_loglikelihood_to_simple_requests()
        super().__init__(**kwargs)

    def _prompt(self, request: Instance) -> dict[str, Any]:
        from lmms_eval.protocol import ChatMessages

        doc_to_messages = request.args[1]
        return {"messages": chat_messages(ChatMessages(messages=doc_to_messages(self._doc(request))))}

    def _next_round(
        self, request: Instance, round_idx: int, replies: list[str], info: Any
    ) -> tuple[dict[str, Any], Any] | None:
        """Chat path: the request's ``doc_to_messages`` returns ``(messages, terminal, previous_output,
        previous_round_info)``; anything else ends the rounds (as lmms-eval's chat ``vllm`` model does)."""
        from lmms_eval.protocol import ChatMessages

        doc_to_messages = request.args[1]
        payload = doc_to_messages(
            self._doc(request), round_idx=round_idx, previous_output=replies, previous_round_info=info
        )
        if not (isinstance(payload, tuple) and len(payload) == 4) or payload[1]:
            return None
        raw, _terminal, _replies, info = payload
        return {"messages": chat_messages(ChatMessages(messages=raw))}, info


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------
_LOGLIKELIHOOD_OUTPUT_TYPES = ("loglikelihood", "multiple_choice")


def refer_loglikelihood_to_simple_requests() -> None:
    """Let lmms-eval's chat tasks build ``loglikelihood`` requests as its simple tasks do (lmms-eval 0.7.3).

    lmms-eval 0.7.3 loads every task of a run as a ``ConfigurableMessagesTask`` when the model is a chat model
    (the default for ``--model vlmspec``), and that class's ``construct_requests`` refuses every output type but
    generation ("Currently messages is used for generation only"), so a ``multiple_choice`` or ``loglikelihood``
    task fails before a request is made. This wraps it (once per process): for those two output types it builds
    the requests of its parent, ``ConfigurableTask`` (``(ctx, continuation, doc_to_visual, doc_id, task,
    split)``, from the same context), which :meth:`VLMSpec.loglikelihood` scores; every other output type goes to
    the original method as before. Called by :class:`VLMSpecChat` before lmms-eval loads the tasks.
    """
    from lmms_eval.api.task import ConfigurableMessagesTask, ConfigurableTask

    original = ConfigurableMessagesTask.construct_requests
    if getattr(original, "_vlmspec_refers_loglikelihood", False):
        return

    def construct_requests(self: Any, doc_id: int, ctx: str, **kwargs: Any) -> Any:
        if self.OUTPUT_TYPE in _LOGLIKELIHOOD_OUTPUT_TYPES:
            return ConfigurableTask.construct_requests(self, doc_id, ctx, **kwargs)
        return original(self, doc_id, ctx, **kwargs)

    construct_requests._vlmspec_refers_loglikelihood = True  # type: ignore[attr-defined]
    ConfigurableMessagesTask.construct_requests = construct_requests  # type: ignore[method-assign]


def load_pipeline(options: ModelOptions, pair: ResolvedPair, device_map: str | None) -> VLMSpecPipeline:
    """The pipeline for ``pair`` with the options' policy, pruning, dtype and device."""
    pruning = PruningConfig(
        method=options.pruning, image_ratio=options.image_prune_ratio, video_ratio=options.video_prune_ratio
    )
    return VLMSpecPipeline.from_pretrained(
        pair.target,
        pair.draft,
        policy=options.policy,
        torch_dtype=options.dtype,
        device_map=device_map,
        trust_remote_code=options.trust_remote_code,
        pruning=pruning,
        calibration=pair.calibration,
        quantization_config=options.quantization,
        draft_quantization_config=options.draft_quantization,
        **options.policy_options,
    )


def warm_up(pipe: VLMSpecPipeline) -> None:
    """One short generation on a blank picture (first-call costs stay out of the first request's timing), greedy
    unless the policy only samples (DSBD: then with its own warping)."""
    from PIL import Image

    sampling = sampling_only(pipe.policy)
    pipe(
        Image.new("RGB", (56, 56), (128, 128, 128)),
        "Describe this image.",
        max_new_tokens=8,
        **(sampling or {}),
    )


@torch.inference_mode()
def score_continuation(
    model: torch.nn.Module, tokenizer: Any, inputs: dict[str, Any], continuation: str
) -> tuple[float, bool]:
    """``(log p(continuation | inputs), continuation is the greedy reply)`` from one forward of ``model``.

    Args:
        model: a ``*ForConditionalGeneration`` model.
        tokenizer: its tokenizer (the continuation is tokenized without special tokens).
        inputs: processor outputs for the context (batch 1).
        continuation: the text to score.
    """
    ids = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    if not ids:
        return 0.0, True
    logits = continuation_logits(model, inputs, ids)  # [n, V]
    target = torch.tensor(ids, device=logits.device)
    total = torch.log_softmax(logits, dim=-1).gather(-1, target[:, None]).sum().item()
    return float(total), bool((logits.argmax(-1) == target).all().item())


def _is_padding(request: Instance) -> bool:
    return bool((request.metadata or {}).get("__padding_only__"))


def _log_throughput(samples: list[SampleSpeed], wall_seconds: float) -> None:
    """Pooled figures into lmms-eval's own ``throughput`` section of the results file (rank 0).

    Elapsed time and tokens/s are the run's wall time in ``generate_until`` (the slowest rank's): at a batch size
    above 1 requests overlap, and their own times add up to more than the run took.
    """
    from lmms_eval.models.model_utils.gen_metrics import log_metrics

    from .speed import dedupe, summarize

    metrics = summarize(dedupe(samples))
    log_metrics(
        total_elapsed_time=wall_seconds,
        total_gen_tokens=metrics["new_tokens"],
        avg_speed=metrics["new_tokens"] / max(wall_seconds, 1e-9),
        additional_metrics={
            "vlmspec_tau": metrics["tau"],
            "vlmspec_tokens_per_step": metrics["tokens_per_step"],
            "vlmspec_speedup_est": metrics["speedup_est"],
        },
    )
