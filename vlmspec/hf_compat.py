"""transformers' ``generate()`` conventions that :meth:`vlmspec.VLMSpecPipeline.generate` keeps: which keyword
arguments are generation options and which are processor outputs, the defaults it takes from the model's
``generation_config``, the pad token and the ``[B, L + T]`` output layout."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Collection, Sequence
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils.generic import TransformersKwargs

from .errors import InputTypeError, InvalidInputError
from .inputs import check_token_ids
from .requests import naming_request
from .sampling import check_seed
from .stopping import eos_token_ids, token_ids
from .validation import did_you_mean

GENERATE_OPTIONS: tuple[str, ...] = (
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stop_strings", "prune_ratio", "streamer",
    "eos_token_id", "repetition_penalty", "min_new_tokens",
)  # fmt: skip
"""The keyword arguments of :meth:`~vlmspec.VLMSpecPipeline.__call__` that ``generate()`` takes as options."""


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
            ``pipe(...)`` takes them (``streamer``: one prompt only); ``use_cache`` (speed only: ignored),
            ``num_beams`` and ``num_return_sequences`` (1 only); ``tokenizer`` (which ``generate()`` needs with
            ``stop_strings``: ignored, the pipeline decodes with its own processor's tokenizer); ``batch_size``
            (rows decoding at once; default: all), ``pad_token_id`` (what rows that stop early are padded with)
            and ``return_dict_in_generate``. Options are resolved over the target's ``generation_config`` as
            ``generate()`` resolves them (:func:`resolve_options`): an option given as ``None`` turns the config's
            setting off, and with no ``max_new_tokens`` the config's ``max_length`` (or 20 new tokens) applies.

    Returns:
        ``[B, L + T]``: the prompts as given, then each row's new ids (EOS included when produced), rows that
        stopped early padded with the pad token, ``T`` the longest row's: what ``generate()`` returns for a
        decoder-only model; in a ``GenerateDecoderOnlyOutput`` (``.sequences``) with ``return_dict_in_generate``
        (the call's, else the config's).

    Raises:
        TypeError: an argument this method does not take (``num_beams``, ``assistant_model``, a tensor the model
            does not take, a mistyped option, ...), refused by name as ``generate()`` refuses unused
            ``model_kwargs``.
        ValueError: an option out of range, ids that are not the models' token ids.
    """
    batch_size, pad = kwargs.pop("batch_size", None), kwargs.pop("pad_token_id", None)
    kwargs.pop("tokenizer", None)  # generate() needs one to read stop_strings; the pipeline has its own
    config = pipe.target.generation_config
    as_dict = returns_dict(kwargs.pop("return_dict_in_generate", None), config)
    given, tensors = split_generate_kwargs(kwargs, GENERATE_OPTIONS, model_inputs(pipe.target))
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise InputTypeError(
            "pipe.generate() needs input_ids, a [B, L] tensor of prompt ids (processor outputs)"
        )
    check_token_ids(input_ids, pipe._vocab_size())
    options = resolve_options(given, config, input_ids.shape[1])
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, numbers.Integral)):
        raise InputTypeError(
            f"pad_token_id={pad!r:.80} is invalid: use one token id (an integer), what rows that stop early are "
            "padded with, or leave it out (the target's generation_config's)"
        )
    seed = check_seed(options.pop("seed", None))
    rows = pipe._target_adapter.split_rows({"input_ids": input_ids, **tensors})  # each prompt alone, unpadded
    if len(rows) > 1 and options.get("streamer") is not None:
        raise InvalidInputError("pipe.generate(streamer=...) streams one prompt; give one row of input_ids")
    calls = []
    for b, row in enumerate(rows):  # every row checked before any decodes
        try:
            calls.append(
                pipe._prepare({"inputs": row, "seed": None if seed is None else seed + b, **options})
            )
        except (TypeError, ValueError, OSError) as err:
            raise naming_request(err, b, "pipe.generate: row") from err
    outs: dict[int, Any] = {}
    results = pipe.batch_iter(calls, len(rows) if batch_size is None else batch_size)
    try:
        for b, out in results:
            if isinstance(out, Exception):  # the rows still decoding stop here
                raise naming_request(out, b, "pipe.generate: row") from out
            outs[b] = out
    finally:
        results.close()
    pad = pad_token_id(pipe.target, options.get("eos_token_id")) if pad is None else int(pad)
    ids = generate_layout(input_ids, [outs[b].token_ids for b in range(len(rows))], pad)
    return GenerateDecoderOnlyOutput(sequences=ids) if as_dict else ids


def model_inputs(model: Any) -> frozenset[str]:
    """The keyword arguments ``model.generate()`` passes on to the model, found as transformers finds them when it
    refuses unused ``model_kwargs``: ``prepare_inputs_for_generation``'s parameters, its ``forward()``'s when the
    former takes ``**kwargs``, and transformers' model-agnostic ones (``position_ids``, ...)."""
    names = set(inspect.signature(model.prepare_inputs_for_generation).parameters)
    if "kwargs" in names or "model_kwargs" in names:
        names |= set(inspect.signature(model.forward).parameters)
    return frozenset(names | set(TransformersKwargs.__optional_keys__))


def split_generate_kwargs(
    kwargs: dict[str, Any], options: Sequence[str], inputs: Collection[str] | None = None
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
    for name in ("num_beams", "num_return_sequences"):  # 1 is what vlmspec does; more is not
        if kwargs.get(name, 1) not in (None, 1):
            raise InputTypeError(
                f"pipe.generate({name}={kwargs[name]!r}): vlmspec decodes one sequence per prompt, greedily or by "
                f"sampling (repeat a prompt's rows for several samples); leave {name} at 1"
            )
    ignored = ("num_beams", "num_return_sequences", "use_cache")  # use_cache: the speed, never the tokens
    chosen = {k: v for k, v in kwargs.items() if k in options}
    tensors = {k: v for k, v in kwargs.items() if k not in options and k not in ignored and v is not None}
    unknown = sorted(
        k for k, v in tensors.items() if not torch.is_tensor(v) or (inputs is not None and k not in inputs)
    )
    if unknown:
        taken = [*options, "batch_size", "pad_token_id", "tokenizer", "return_dict_in_generate"]
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
    the config's), else the config's ``max_length`` less the ``prompt_length`` (padded, as ``generate()`` counts),
    else 20 new tokens.

    Raises:
        InvalidInputError: a ``max_length`` that leaves no room for a new token after the prompt.
    """
    config = generation_config
    options = {name: value for name, value in given.items() if value is not None}
    off = {name for name, value in given.items() if value is None}
    sampling = options.setdefault("do_sample", False if "do_sample" in off else bool(config.do_sample))
    for name in off:
        if name in _OFF or (sampling and name in _OFF_WHEN_SAMPLING):
            options[name] = {**_OFF, **_OFF_WHEN_SAMPLING}[name]
    if (
        "min_new_tokens" in off and config.min_new_tokens is not None
    ):  # generate() keeps the config's min_length
        options["min_new_tokens"] = max(0, (config.min_length or 0) - prompt_length)
    if "max_new_tokens" not in options:
        options["max_new_tokens"] = _new_tokens(config, prompt_length, "max_new_tokens" not in off)
    return options


def _new_tokens(config: Any, prompt_length: int, config_new_tokens: bool) -> int:
    if config_new_tokens and config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    if config.max_length is None:
        return _DEFAULT_NEW_TOKENS
    if config.max_length <= prompt_length:
        raise InvalidInputError(
            f"the target's generation_config sets max_length={config.max_length}, which leaves no new token after "
            f"the {prompt_length}-token prompt (generate() refuses it too); pass max_new_tokens"
        )
    return int(config.max_length) - prompt_length


def returns_dict(given: Any, generation_config: Any) -> bool:
    """Whether ``generate()`` would return a ``GenerateDecoderOnlyOutput`` (``return_dict_in_generate``, the
    call's over the config's), holding ``sequences`` only: the scores, logits, attentions and hidden states a
    speculative run never computes for the output are refused.

    Raises:
        InvalidInputError: ``return_dict_in_generate`` with one of the config's ``output_*`` settings on.
    """
    as_dict = bool(generation_config.return_dict_in_generate if given is None else given)
    wanted = [
        name
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
        if getattr(generation_config, name, False)
    ]
    if as_dict and wanted:
        raise InvalidInputError(
            f"the target's generation_config sets {', '.join(wanted)}: vlmspec returns sequences only (the target "
            "never scores the output token by token); set them to False, or return_dict_in_generate=False"
        )
    return as_dict


def pad_token_id(model: Any, eos_token_id: Any = None) -> int:
    """What ``generate()`` pads finished rows with: the generation config's pad token, else the first EOS (the
    call's ``eos_token_id`` where given, else the model's)."""
    pad = model.generation_config.pad_token_id
    if pad is not None:
        return int(pad)
    eos = eos_token_ids(model) if eos_token_id is None else token_ids(eos_token_id, empty_ok=True)
    return next(iter(eos), 0)


def generate_layout(input_ids: torch.Tensor, rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """``[B, L + T]``: the prompts ``input_ids`` ``[B, L]`` as given, then each row's new ids, rows shorter than the
    longest (``T``) padded with ``pad``, as ``generate()`` returns them for a decoder-only model."""
    width = max((len(row) for row in rows), default=0)
    new = torch.full((len(rows), width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for b, row in enumerate(rows):
        new[b, : len(row)] = torch.tensor(list(row), dtype=input_ids.dtype)
    return torch.cat([input_ids, new], dim=1)
