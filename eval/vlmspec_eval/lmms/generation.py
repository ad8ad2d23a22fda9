"""A request's ``generation_kwargs`` (task YAML, overridden by ``--gen_kwargs``) as pipeline call settings.

* ``until``: stop strings (a string or a list); the reply is cut before the first one, as lmms-eval's own models do.
* ``max_new_tokens`` (or lm-eval's ``max_gen_toks``): default 128; capped by the model's ``max_new_tokens``.
* ``temperature`` 0 / unset, or ``do_sample`` false: greedy decoding (lossless: token-for-token the target's own
  greedy output). ``temperature`` > 0 with ``do_sample`` unset or true: sampling, with ``top_p``/``top_k``.
* ``repetition_penalty``: as ``generate()`` applies it, greedy or sampled (default: the target's
  ``generation_config``'s).
* ``min_new_tokens``: as ``generate()`` applies it (EOS banned before it).
* ``num_beams`` > 1 is refused (speculative decoding reproduces greedy or sampled decoding, not beam search).
* A policy with no greedy form (``dsbd``) needs sampling kwargs; a greedy task is refused with the ones to pass.

Other keys lmms-eval tasks carry (``image_aspect_ratio``, ``use_cache``, ...) do not apply and are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "GenerationSettings",
    "check_policy_decoding",
    "generation_settings",
    "sampling_only",
    "truncate_at_stops",
]

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass(frozen=True)
class GenerationSettings:
    """How one request is decoded (arguments of ``VLMSpecPipeline.__call__``)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_strings: tuple[str, ...] = ()
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None


def generation_settings(gen_kwargs: Mapping[str, Any] | None, cap: int | None = None) -> GenerationSettings:
    """Settings for one request.

    Args:
        gen_kwargs: the request's generation kwargs (may be ``None``).
        cap: the model's ``max_new_tokens`` option (an upper bound), or ``None``.

    Raises:
        ValueError: a bad ``until``/``max_new_tokens``/``temperature`` value, naming it.
        NotImplementedError: ``num_beams`` > 1.
    """
    kwargs = dict(gen_kwargs or {})
    beams = kwargs.get("num_beams")
    if beams not in (None, 1):
        raise NotImplementedError(
            f"num_beams={beams!r}: the vlmspec model decodes greedily (or samples); beam search is not supported"
        )
    max_new = _max_new_tokens(kwargs)
    if cap is not None:
        max_new = min(max_new, cap)
    temperature = _temperature(kwargs.get("temperature"))
    do_sample = _do_sample(kwargs.get("do_sample"), temperature)
    return GenerationSettings(
        max_new_tokens=max_new,
        do_sample=do_sample,
        temperature=temperature if do_sample else None,
        top_p=kwargs.get("top_p") if do_sample else None,
        top_k=kwargs.get("top_k") if do_sample else None,
        stop_strings=_stop_strings(kwargs.get("until")),
        repetition_penalty=_repetition_penalty(kwargs.get("repetition_penalty")),
        min_new_tokens=_min_new_tokens(kwargs.get("min_new_tokens")),
    )


def sampling_only(policy: Any) -> dict[str, Any] | None:
    """For a policy with no greedy form (``policy.sampling_only``), the sampling arguments that suit it (its own
    ``top_k``/``top_p`` where its config sets them); ``None`` for every other policy."""
    if not policy.sampling_only:
        return None
    config = policy.config
    return {
        "do_sample": True,
        "top_k": getattr(config, "top_k", None),
        "top_p": getattr(config, "top_p", None),
    }


def check_policy_decoding(policy: Any, settings: GenerationSettings) -> None:
    """Refuse greedy settings for a policy with no greedy form, saying which ``--gen_kwargs`` to pass.

    Raises:
        ValueError: naming the policy and the kwargs.
    """
    wanted = sampling_only(policy)
    if wanted is None or settings.do_sample:
        return
    kwargs = ",".join(
        f"{k}={str(v).lower()}" for k, v in {"temperature": 1, **wanted}.items() if v is not None
    )
    raise ValueError(
        f"policy={policy.name} samples and has no greedy form, but this task decodes greedily; run it with "
        f"--gen_kwargs {kwargs}, or pick a lossless policy such as sage"
    )


def _min_new_tokens(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"generation kwarg min_new_tokens={value!r} is invalid: expected an integer >= 0")
    return value


def _repetition_penalty(value: Any) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError(f"generation kwarg repetition_penalty={value!r} is invalid: expected a number > 0")
    return value


def _max_new_tokens(kwargs: Mapping[str, Any]) -> int:
    value = kwargs.get("max_new_tokens", kwargs.get("max_gen_toks", DEFAULT_MAX_NEW_TOKENS))
    if value is None:
        return DEFAULT_MAX_NEW_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"generation kwarg max_new_tokens={value!r} is invalid: expected an integer >= 1")
    return value


def _temperature(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"generation kwarg temperature={value!r} is invalid: expected a number >= 0")
    return float(value)


def _do_sample(value: Any, temperature: float | None) -> bool:
    """Greedy unless sampling is asked for and the temperature is not 0."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"generation kwarg do_sample={value!r} is invalid: expected true or false")
    if value is False or temperature == 0:
        return False
    return bool(value) or (temperature is not None and temperature > 0)


def _stop_strings(until: Any) -> tuple[str, ...]:
    if until is None:
        return ()
    if isinstance(until, str):
        until = [until]
    if not isinstance(until, (list, tuple)) or not all(isinstance(u, str) for u in until):
        raise ValueError(
            f"generation kwarg until={until!r} is invalid: expected a string or a list of strings"
        )
    return tuple(u for u in until if u)


def truncate_at_stops(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to (excluding) the earliest stop string."""
    cut = len(text)
    for stop in stops:
        index = text.find(stop)
        if index != -1:
            cut = min(cut, index)
    return text[:cut]
