"""transformers' ``generate()`` conventions that :meth:`vlmspec.VLMSpecPipeline.generate` keeps: which keyword
arguments are generation options and which are processor outputs, the defaults it takes from the model's
``generation_config``, the pad token and the ``[B, L + T]`` output layout."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import numbers
import time
from collections.abc import Collection, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils.generic import TransformersKwargs

from .errors import InputTypeError, InvalidInputError
from .inputs import check_token_ids
from .node_processors import TRANSFORMERS_PROCESSORS, setting_is_on
from .processors import REFUSED_SETTINGS
from .reasoning import reply_reasoning
from .requests import CallHooks, naming_request
from .sampling import check_seed
from .scores import generate_steps
from .stopping import eos_token_ids, token_ids
from .structured import generate_processor
from .validation import did_you_mean

GENERATE_OPTIONS: tuple[str, ...] = (
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stop_strings", "prune_ratio", "streamer",
    "eos_token_id", "repetition_penalty", "min_new_tokens",
)  # fmt: skip
"""The keyword arguments of :meth:`~vlmspec.VLMSpecPipeline.__call__` that ``generate()`` takes as options."""


def reference_generate(
    pipe: Any, inputs: dict[str, torch.Tensor], max_new_tokens: int, structured_outputs: Any = None
) -> list[int]:
    """:meth:`~vlmspec.VLMSpecPipeline.reference_generate`: the target's own greedy ``generate()``, under
    xgrammar's processor for ``structured_outputs`` (after the reasoning, as ``pipe.reasoning_parser`` says)."""
    options = dict(do_sample=False, max_new_tokens=max_new_tokens, tokenizer=pipe.tokenizer)
    if structured_outputs is not None:
        reasoning = reply_reasoning(pipe.reasoning_parser, pipe.tokenizer, inputs["input_ids"][0])
        options["logits_processor"] = [
            generate_processor(structured_outputs, pipe.tokenizer, pipe.target, reasoning)
        ]
    out = pipe.target.generate(**inputs, **options)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _checked_ids_and_pad(pipe: Any, input_ids: Any, pad: Any) -> int | None:
    """Refuses ``input_ids`` that are not a ``[B, L]`` tensor of the models' token ids, and a pad token that is not
    one token id; returns the pad token (``None``: none set)."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise InputTypeError(
            "pipe.generate() needs input_ids, a [B, L] tensor of prompt ids (processor outputs)"
        )
    check_token_ids(input_ids, pipe._vocab_size())
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, numbers.Integral)):
        raise InputTypeError(
            f"pad_token_id={pad!r:.80} is invalid: use one token id (an integer), what rows that stop early are "
            "padded with, or leave it out (the target's generation_config's)"
        )
    return pad


def generate(
    pipe: Any, input_ids: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """``target.generate(**inputs, ...)`` with speculative decoding: a drop-in for code that already calls it.

        inputs = processor(text=texts, images=images, padding=True, return_tensors="pt")
        ids = pipe.generate(**inputs, max_new_tokens=128)   # was: target.generate(**inputs, ...)

    Each row's new tokens are the target's own greedy ``generate()``'s for that prompt alone, token for token
    (sampling: drawn from its distribution, row ``b`` with its own generator seeded with ``seed + b``, so
    repeated rows give different draws and a rerun the same ones). A batch of prompts is split into its rows
    (:meth:`~vlmspec.models.VLMAdapter.split_rows`) and decoded together, each with its own tree
    (:meth:`~vlmspec.VLMSpecPipeline.batch`).

    Args:
        input_ids: ``[B, L]`` prompt ids (padded as the processor pads them, ``attention_mask`` saying where).
        **kwargs: the other processor outputs (tensors the target's ``forward()`` takes: ``attention_mask``,
            ``pixel_values``, ``image_grid_thw``, ...); the generation options of :data:`GENERATE_OPTIONS`, as
            ``pipe(...)`` takes them (``streamer``: one prompt only); ``use_cache``, ``cache_implementation``,
            ``disable_compile`` (speed only: ignored), ``num_beams`` (1 only), ``num_return_sequences`` (with
            sampling); ``tokenizer`` (which ``generate()`` needs with ``stop_strings``: ignored, the pipeline
            decodes with its own processor's tokenizer); ``batch_size``
            (rows decoding at once; default: all), ``pad_token_id`` (what rows that stop early are padded with),
            ``max_length``, ``generation_config`` (merged over the target's, as ``generate()`` merges it),
            ``return_dict_in_generate``, ``output_scores`` and ``output_logits``. Options are resolved over the
            ``generation_config`` as ``generate()`` resolves them (:func:`call_config`, :func:`resolve_options`):
            ``None`` turns the config's setting off, and with no ``max_new_tokens`` the ``max_length`` (or 20 new
            tokens) applies, counted for each prompt alone.

    Returns:
        ``[B, L + T]``: the prompts as given, then each row's new ids (EOS included when produced), rows that
        stopped early padded with the pad token, ``T`` the longest row's: what ``generate()`` returns for a
        decoder-only model. With ``return_dict_in_generate`` (the call's, else the config's), in a
        ``GenerateDecoderOnlyOutput``: ``.sequences``, and with ``output_scores``/``output_logits`` a tuple of
        ``T`` ``[B, V]`` float32 tensors each, the target's scores/logits behind each new token, read off its
        verification forwards (:mod:`vlmspec.scores`; a row's positions after its end hold ``-inf`` with 0 at
        the pad token).

    Raises:
        TypeError: an argument this method does not take (``num_beams``, ``assistant_model``, a tensor the model
            does not take, a mistyped option, ...), refused by name as ``generate()`` refuses unused
            ``model_kwargs``.
        ValueError: an option out of range, ids that are not the models' token ids.
    """
    settings = {name: kwargs.pop(name) for name in _CALL_SETTINGS if name in kwargs}
    config = call_config(pipe.target, settings, kwargs)
    fields = returned_fields(config)
    given, tensors = split_generate_kwargs(kwargs, GENERATE_OPTIONS, model_inputs(pipe.target))
    pad = _checked_ids_and_pad(pipe, input_ids, config.pad_token_id)
    if "max_length" in settings:
        given["max_length"] = settings["max_length"]
    seed = check_seed(given.pop("seed", None))
    rows = pipe.target_adapter.split_rows({"input_ids": input_ids, **tensors})  # each prompt alone, unpadded
    copies = return_sequences(config, given)
    if len(rows) * copies > 1 and given.get("streamer") is not None:
        raise InvalidInputError(
            "pipe.generate(streamer=...) streams one sequence; give one row of input_ids and num_return_sequences=1"
        )
    rows, input_ids = [row for row in rows for _ in range(copies)], input_ids.repeat_interleave(copies, dim=0)
    custom = CallHooks(
        settings.get("logits_processor") or (),
        settings.get("prefix_allowed_tokens_fn"),
        settings.get("stopping_criteria") or (),
        started=time.time(),  # max_time counts from the call, as in generate()
        scores_to_criteria=fields is not None and "scores" in fields,  # as generate() hands them over
    )
    call = SimpleNamespace(
        given=given, seed=seed, config=config, scores=bool(fields), custom=custom, copies=copies
    )
    calls = [_row_call(pipe, b, row, call) for b, row in enumerate(rows)]  # all checked before decoding
    outs = _decode_rows(pipe, calls, settings.get("batch_size", len(rows)))
    if pad is None:  # as generate(): the EOS (the call's, else the config's) where there is no pad token
        eos = () if "eos_token_id" in given and given["eos_token_id"] is None else given.get("eos_token_id")
        pad = pad_token_id(pipe.target, eos, config)
    ids = generate_layout(input_ids, [out.token_ids for out in outs], int(pad))
    if fields is None:
        return ids
    width = ids.shape[1] - input_ids.shape[1]
    steps = {field: generate_steps([out.scores for out in outs], field, width, int(pad)) for field in fields}
    return GenerateDecoderOnlyOutput(sequences=ids, **steps)


_CALL_SETTINGS = (
    "batch_size", "pad_token_id", "tokenizer", "return_dict_in_generate", "max_length", "generation_config",
    "output_scores", "output_logits", "output_attentions", "output_hidden_states", "logits_processor",
    "prefix_allowed_tokens_fn", "stopping_criteria",
)  # fmt: skip
"""What :func:`generate` takes besides the options of ``pipe(...)`` (``tokenizer``: ignored)."""
_CONFIG_ONLY = (
    "max_time", "num_return_sequences", "min_length", "suppress_tokens", "begin_suppress_tokens",
    "renormalize_logits", "forced_bos_token_id", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h",
)  # fmt: skip
"""``generate()`` settings ``pipe(...)`` takes from the ``generation_config`` only: a ``pipe.generate`` call's
are written into its config."""
_OUTPUT_SETTINGS = (
    "pad_token_id", "return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
    "output_hidden_states",
)  # fmt: skip
"""The call's settings :func:`call_config` writes into the call's ``generation_config``."""


def _row_call(pipe: Any, b: int, row: dict[str, Any], call: SimpleNamespace) -> Any:
    """Row ``b``'s prepared request: the ``call``'s options (``given``) resolved over its ``config`` with the row's
    own prompt length (each row is decoded as its prompt alone), its seed ``seed + b``, the target's scores kept
    if ``scores``, the call's own callables (``custom``) told the row; an error names the row."""
    try:
        options = resolve_options(call.given, call.config, row["input_ids"].shape[1])
        seed = None if call.seed is None else call.seed + b
        request = {"inputs": row, "seed": seed, "output_scores": call.scores, **options}
        custom = dataclasses.replace(call.custom, row=b // call.copies)  # generate()'s batch_id: the prompt's
        return pipe._prepare(request, call.config, custom)
    except (TypeError, ValueError, OSError) as err:
        raise naming_request(err, b, "pipe.generate: row") from err


def generation_config(target: Any, given: Any = None) -> Any:
    """The ``generation_config`` a call decodes with, a copy the call may change: the target's, or ``given`` with the
    settings it leaves unset (``None``) taken from the target's, as ``generate(generation_config=...)`` merges them.

    Raises:
        TypeError: ``given`` is not a ``transformers.GenerationConfig``.
    """
    if given is None:
        return copy.deepcopy(target.generation_config)
    if not isinstance(given, GenerationConfig):
        raise InputTypeError(
            f"generation_config={given!r:.80} is invalid: use a transformers.GenerationConfig, or leave it out (the "
            "target's)"
        )
    merged = copy.deepcopy(given)
    for name, value in target.generation_config.to_dict().items():
        if hasattr(merged, name) and getattr(merged, name) is None:
            setattr(merged, name, value)
    return merged


def call_config(target: Any, settings: dict[str, Any], kwargs: dict[str, Any]) -> Any:
    """The ``generation_config`` a ``generate()`` call decodes with, built as ``generate()`` builds it: the call's
    ``generation_config`` merged over the target's (:func:`generation_config`), or a copy of the target's; then
    the call's ``pad_token_id``, ``return_dict_in_generate`` and ``output_*`` settings from ``settings``, and,
    taken out of ``kwargs``, a ``None`` for any other of its settings (``generate()`` turns that setting off), an
    off value for a setting vlmspec does not apply (``num_beams=1``, ``guidance_scale=None``), and the settings
    of transformers' processors vlmspec runs node by node (``no_repeat_ngram_size``, ...), ``max_time`` and
    ``num_return_sequences``.
    """
    config = generation_config(target, settings.get("generation_config"))
    options = set(GENERATE_OPTIONS)
    for name in [name for name, value in kwargs.items() if value is None and name not in options]:
        if hasattr(config, name):
            setattr(config, name, kwargs.pop(name))
    for name, is_on in REFUSED_SETTINGS.items():
        if name in kwargs and not setting_is_on(name, is_on, kwargs[name]):
            setattr(config, name, kwargs.pop(name))
    for name in (*TRANSFORMERS_PROCESSORS, *_CONFIG_ONLY):  # applied from the config (see generate)
        if name in kwargs:
            setattr(config, name, kwargs.pop(name))
    for name in _OUTPUT_SETTINGS:
        if name in settings:
            setattr(config, name, settings[name])
    return config


def _decode_rows(pipe: Any, calls: list[Any], batch_size: Any) -> list[Any]:
    """The rows' outputs, in order; a row's decoding error is raised at once, naming it (the rows still decoding
    stop there)."""
    outs: dict[int, Any] = {}
    results = pipe.batch_iter(calls, batch_size)
    try:
        for b, out in results:
            if isinstance(out, Exception):
                raise naming_request(out, b, "pipe.generate: row") from out
            outs[b] = out
    finally:
        results.close()
    return [outs[b] for b in range(len(calls))]


def model_inputs(model: Any) -> frozenset[str]:
    """The keyword arguments ``model.generate()`` passes on to the model, found as transformers finds them when it
    refuses unused ``model_kwargs``: ``prepare_inputs_for_generation``'s parameters, its ``forward()``'s when the
    former takes ``**kwargs``, and transformers' model-agnostic ones (``position_ids``, ...)."""
    names = set(inspect.signature(model.prepare_inputs_for_generation).parameters)
    if "kwargs" in names or "model_kwargs" in names:
        names |= set(inspect.signature(model.forward).parameters)
    return frozenset(names | set(TransformersKwargs.__optional_keys__))


def split_generate_kwargs(
    kwargs: dict[str, Any],
    options: Sequence[str],
    inputs: Collection[str] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(generation options, processor outputs)`` of ``generate(**kwargs)``'s keyword arguments (options given as
    ``None`` kept: :func:`resolve_options` reads them as ``generate()`` does).

    Args:
        kwargs: the keyword arguments.
        options: the generation options taken.
        inputs: the model inputs taken (:func:`model_inputs`); ``None``: any tensor.

    Raises:
        TypeError: an argument that is neither one of ``options`` nor a tensor of ``inputs`` (``num_beams``,
            ``assistant_model``, a mistyped option, a tensor the model does not take), named with what is taken.
    """
    if kwargs.get("num_beams", 1) not in (None, 1):
        raise InputTypeError(
            f"pipe.generate(num_beams={kwargs['num_beams']!r}): vlmspec decodes greedily or by sampling, not by "
            "beam search; leave num_beams at 1 (num_return_sequences with do_sample=True draws several samples)"
        )
    ignored = (
        "num_beams",
        "use_cache",
        "cache_implementation",
        "disable_compile",
    )  # the speed, never the tokens
    chosen = {k: v for k, v in kwargs.items() if k in options}
    tensors = {k: v for k, v in kwargs.items() if k not in options and k not in ignored and v is not None}
    unknown = sorted(
        k for k, v in tensors.items() if not torch.is_tensor(v) or (inputs is not None and k not in inputs)
    )
    if unknown:
        taken = [*options, *_CALL_SETTINGS]
        hint = did_you_mean(unknown[0], taken) if len(unknown) == 1 else ""
        raise InputTypeError(
            f"pipe.generate() does not take {', '.join(unknown)}: it takes processor outputs (tensors the "
            f"target's forward() takes: attention_mask, pixel_values, ...) and {', '.join(taken)}{hint}"
        )
    return chosen, tensors


_OFF = {"do_sample": False, "repetition_penalty": 1.0, "stop_strings": (), "eos_token_id": ()}
"""What a ``generate()`` option given as ``None`` turns the ``generation_config``'s setting into."""
_OFF_WHEN_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
"""The same for the sampling warpers (greedy decoding ignores them)."""
_DEFAULT_NEW_TOKENS = 20
"""``generate()``'s length when neither ``max_new_tokens`` nor ``max_length`` is set anywhere."""


def resolve_options(given: dict[str, Any], generation_config: Any, prompt_length: int) -> dict[str, Any]:
    """``pipe(...)``'s options for a ``generate()`` call's ``given`` options, resolved as ``generate()`` resolves them.

    ``generate()`` applies its keyword arguments over the model's ``generation_config``, ``None`` included: an
    option given as ``None`` turns the config's setting off (``top_k=None``: no top-k; ``eos_token_id=None``: no
    EOS), where ``pipe(...)`` reads ``None`` as "the config's". The length is ``max_new_tokens`` (the call's, else
    the config's), else ``max_length`` (``given``'s, else the config's) less the ``prompt_length``, else 20 new
    tokens. Lengths count one prompt alone (each row of a batch is decoded as its prompt alone).

    Raises:
        InvalidInputError: a ``max_length`` that leaves no room for a new token after the prompt.
    """
    config = generation_config
    options = {name: value for name, value in given.items() if value is not None and name != "max_length"}
    off = {name for name, value in given.items() if value is None}
    sampling = options.setdefault("do_sample", False if "do_sample" in off else bool(config.do_sample))
    for name in off:
        if name in _OFF or (sampling and name in _OFF_WHEN_SAMPLING):
            options[name] = {**_OFF, **_OFF_WHEN_SAMPLING}[name]
    if "min_new_tokens" in off and config.min_new_tokens is not None:  # the config's min_length still counts
        options["min_new_tokens"] = max(0, (config.min_length or 0) - prompt_length)
    if "max_new_tokens" not in options:
        options["max_new_tokens"] = _new_tokens(given, off, config, prompt_length)
    return options


def _new_tokens(given: dict[str, Any], off: set[str], config: Any, prompt_length: int) -> int:
    """``generate()``'s new-token count with no ``max_new_tokens`` in the call: the config's ``max_new_tokens``
    (unless the call gave ``None``), else ``max_length`` less the prompt, else 20."""
    if "max_new_tokens" not in off and config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    max_length = given.get("max_length", config.max_length)
    if max_length is None:
        return _DEFAULT_NEW_TOKENS
    where = "max_length" if "max_length" in given else "the target's generation_config's max_length"
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral):
        raise InputTypeError(f"{where}={max_length!r} is invalid: use an integer (prompt plus new tokens)")
    if max_length <= prompt_length:
        raise InvalidInputError(
            f"{where}={max_length} leaves no new token after the {prompt_length}-token prompt (generate() "
            "refuses it too); pass max_new_tokens"
        )
    return int(max_length) - prompt_length


def return_sequences(config: Any, given: dict[str, Any]) -> int:
    """How many sequences each prompt gets (``num_return_sequences``, the call's over the config's): each its own
    row, drawn with its own seed, in ``generate()``'s order (a prompt's sequences next to each other); the config
    is left with 1 for the rows.

    Raises:
        InvalidInputError: more than one without sampling (``generate()`` refuses it too: greedy decoding has one
            answer).
    """
    copies = config.num_return_sequences or 1
    if isinstance(copies, bool) or not isinstance(copies, numbers.Integral) or copies < 1:
        raise InputTypeError(f"num_return_sequences={copies!r} is invalid: use an integer >= 1")
    sampling = bool(given["do_sample"]) if "do_sample" in given else bool(config.do_sample)
    if copies > 1 and not sampling:
        raise InvalidInputError(
            f"num_return_sequences={copies} without sampling: greedy decoding gives one sequence per prompt (so "
            "does generate()); pass do_sample=True to draw several"
        )
    config.num_return_sequences = 1
    return int(copies)


def returned_fields(generation_config: Any) -> tuple[str, ...] | None:
    """What ``generate()`` returns under ``generation_config`` (the call's, :func:`call_config`): ``None`` for the
    ids alone, else the fields of a ``GenerateDecoderOnlyOutput`` beside ``sequences`` (``return_dict_in_generate``):
    ``scores`` with ``output_scores``, ``logits`` with ``output_logits``, read off each verification
    (:mod:`vlmspec.scores`).

    Raises:
        InvalidInputError: ``output_attentions`` or ``output_hidden_states`` with ``return_dict_in_generate``: a
            speculative run never computes them for the output tokens alone.
    """
    if not generation_config.return_dict_in_generate:
        return None
    unsupported = [
        name
        for name in ("output_attentions", "output_hidden_states")
        if getattr(generation_config, name, False)
    ]
    if unsupported:
        raise InvalidInputError(
            f"generate() settings {', '.join(unsupported)}: vlmspec returns sequences, scores and logits only (its "
            "target forwards attend over whole trees, not the output alone); set them to False or None"
        )
    fields = {"scores": "output_scores", "logits": "output_logits"}
    return tuple(field for field, name in fields.items() if getattr(generation_config, name, False))


def pad_token_id(model: Any, eos_token_id: Any = None, generation_config: Any = None) -> int:
    """What ``generate()`` pads finished rows with: the pad token of ``generation_config`` (default: the model's),
    else the first EOS (``eos_token_id`` where given, ``()`` for none, else the config's), else 0."""
    config = model.generation_config if generation_config is None else generation_config
    if config.pad_token_id is not None:
        return int(config.pad_token_id)
    eos = eos_token_ids(model, config) if eos_token_id is None else token_ids(eos_token_id, empty_ok=True)
    return next(iter(eos), 0)


def generate_layout(input_ids: torch.Tensor, rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """``[B, L + T]``: the prompts ``input_ids`` ``[B, L]`` as given, then each row's new ids, rows shorter than the
    longest (``T``) padded with ``pad``, as ``generate()`` returns them for a decoder-only model."""
    width = max((len(row) for row in rows), default=0)
    new = torch.full((len(rows), width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for b, row in enumerate(rows):
        new[b, : len(row)] = torch.tensor(list(row), dtype=input_ids.dtype)
    return torch.cat([input_ids, new], dim=1)
