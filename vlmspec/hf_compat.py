"""transformers' ``generate()`` conventions that :meth:`vlmspec.VLMSpecPipeline.generate` keeps: which keyword
arguments are generation options and which are processor outputs, the defaults it takes from the model's
``generation_config``, the pad token and the ``[B, L + T]`` output layout."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Collection, Sequence
from typing import Any

import torch
from transformers.utils.generic import TransformersKwargs

from .errors import InputTypeError, InvalidInputError
from .inputs import check_token_ids
from .requests import naming_request
from .sampling import check_seed
from .stopping import eos_token_ids
from .validation import did_you_mean

GENERATE_OPTIONS: tuple[str, ...] = (
    "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stop_strings", "prune_ratio", "streamer",
    "eos_token_id", "repetition_penalty", "min_new_tokens",
)  # fmt: skip
"""The keyword arguments of :meth:`~vlmspec.VLMSpecPipeline.__call__` that ``generate()`` takes as options."""


def generate(pipe: Any, input_ids: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
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
            (rows decoding at once; default: all) and ``pad_token_id`` (what rows that stop early are padded with).
            As in ``generate()``, ``do_sample`` and ``max_new_tokens`` default to the target's
            ``generation_config`` (``max_new_tokens``: 128 when it sets none, as ``pipe(...)``).

    Returns:
        ``[B, L + T]``: the prompts as given, then each row's new ids (EOS included when produced), rows that
        stopped early padded with the pad token, ``T`` the longest row's: what ``generate()`` returns for a
        decoder-only model.

    Raises:
        TypeError: an argument this method does not take (``num_beams``, ``assistant_model``, a tensor the model
            does not take, a mistyped option, ...), refused by name as ``generate()`` refuses unused
            ``model_kwargs``.
        ValueError: an option out of range, ids that are not the models' token ids.
    """
    batch_size, pad = kwargs.pop("batch_size", None), kwargs.pop("pad_token_id", None)
    kwargs.pop("tokenizer", None)  # generate() needs one to read stop_strings; the pipeline has its own
    options, tensors = split_generate_kwargs(
        kwargs, GENERATE_OPTIONS, pipe.target.generation_config, model_inputs(pipe.target)
    )
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
    seed = check_seed(options.pop("seed", None))
    rows = pipe._target_adapter.split_rows({"input_ids": input_ids, **tensors})  # each prompt alone, unpadded
    if len(rows) > 1 and options.get("streamer") is not None:
        raise InvalidInputError("pipe.generate(streamer=...) streams one prompt; give one row of input_ids")
    requests = [
        {"inputs": row, "seed": None if seed is None else seed + b, **options} for b, row in enumerate(rows)
    ]
    outs = pipe.batch(
        requests, batch_size=len(rows) if batch_size is None else batch_size, return_exceptions=True
    )
    for b, out in enumerate(outs):
        if isinstance(out, Exception):
            raise naming_request(out, b, "pipe.generate: row") from out
    pad = pad_token_id(pipe.target) if pad is None else int(pad)
    return generate_layout(input_ids, [out.token_ids for out in outs], pad)


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
    generation_config: Any,
    inputs: Collection[str] | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(generation options, processor outputs)`` of ``generate(**kwargs)``'s keyword arguments.

    ``do_sample`` and ``max_new_tokens`` default to ``generation_config``'s, as in ``generate()`` (``max_new_tokens``
    only where it sets one).

    Args:
        kwargs: the keyword arguments.
        options: the generation options taken.
        generation_config: the model's, for the defaults.
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
        taken = [*options, "batch_size", "pad_token_id", "tokenizer"]
        hint = did_you_mean(unknown[0], taken) if len(unknown) == 1 else ""
        raise InputTypeError(
            f"pipe.generate() does not take {', '.join(unknown)}: it takes processor outputs (tensors the "
            f"target's forward() takes: attention_mask, pixel_values, ...) and {', '.join(taken)}{hint}"
        )
    chosen.setdefault("do_sample", bool(generation_config.do_sample))
    if generation_config.max_new_tokens is not None:
        chosen.setdefault("max_new_tokens", int(generation_config.max_new_tokens))
    return chosen, tensors


def pad_token_id(model: Any) -> int:
    """What ``generate()`` pads finished rows with: the generation config's pad token, else its first EOS."""
    pad = model.generation_config.pad_token_id
    return int(pad) if pad is not None else next(iter(eos_token_ids(model)), 0)


def generate_layout(input_ids: torch.Tensor, rows: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """``[B, L + T]``: the prompts ``input_ids`` ``[B, L]`` as given, then each row's new ids, rows shorter than the
    longest (``T``) padded with ``pad``, as ``generate()`` returns them for a decoder-only model."""
    width = max((len(row) for row in rows), default=0)
    new = torch.full((len(rows), width), pad, dtype=input_ids.dtype, device=input_ids.device)
    for b, row in enumerate(rows):
        new[b, : len(row)] = torch.tensor(list(row), dtype=input_ids.dtype)
    return torch.cat([input_ids, new], dim=1)
