"""Sampling settings and the target's warped next-token distribution, exactly as ``generate()`` builds it.

``generate(do_sample=True)`` turns logits into a distribution with transformers' logits warpers, in this
order and under these conditions (transformers 5.x ``GenerationMixin._get_logits_processor``): temperature
(when != 1), top-h (when set), top-k (when set and != 0), top-p (when < 1), min-p (when set), typical-p (when
< 1), epsilon and eta cutoffs (when in (0, 1)), each keeping at least one token. Unset values come from the
model's ``generation_config`` and then transformers' global defaults (temperature 1.0, top_k 50, top_p 1.0; the
others off). Every warper acts on each row alone, so a tree node's distribution is the one ``generate()`` would
sample from at that point. The processors ``generate()`` runs before them, greedy or sampled (repetition penalty, minimum
length, ``suppress_tokens``: a calibrated pair's padded vocabulary rows), are applied to the target's logits by
:mod:`vlmspec.processors`. :class:`SamplingParams` reproduces that resolution and applies the same public classes,
so speculative sampling targets exactly the distribution the target alone would sample from.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .errors import InvalidInputError, user_stacklevel

_GLOBAL_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
_CONFIG_WARPERS = ("top_h", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
"""Warpers set in the ``generation_config`` only (off when unset)."""
_SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_seed(seed: Any) -> int | None:
    """``seed`` (``None`` or an integer torch can seed a generator with) as an int.

    Raises:
        ValueError: anything else, named.
    """
    if seed is None:
        return None
    if not _is_integer(seed) or not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
        raise InvalidInputError(
            f"seed={seed!r} is invalid: use an integer (e.g. seed=0) or None (an unseeded draw each call)"
        )
    return int(seed)


def _check_setting(name: str, value: Any, source: str = "") -> None:
    """Refuse a sampling setting out of range (``None``: unset, always fine); ``source`` says where it came from."""
    ok = {
        "temperature": lambda v: _is_number(v) and v > 0,
        "top_k": lambda v: _is_integer(v) and v >= 0,
        "top_p": lambda v: _is_number(v) and 0 < v <= 1,
    }.get(name, lambda v: _is_number(v) and 0 <= v <= 1)
    if value is None or ok(value):
        return
    use = {
        "temperature": "a number > 0 (or do_sample=False)",
        "top_k": "an integer >= 0 (0 disables top-k)",
        "top_p": "a number in (0, 1]",
    }.get(name, "a number in [0, 1] or None (off)")
    raise InvalidInputError(f"{name}={value!r} is invalid: use {use}" + (f" ({source})" if source else ""))


@dataclass(frozen=True)
class SamplingParams:
    """Args:
    temperature: > 0.
    top_k: keep the k most likely tokens (0 or None: no top-k).
    top_p: nucleus mass in (0, 1] (1 or None: no top-p).
    seed: seeds the sampling generator; the same seed gives the same output.
    top_h, min_p, typical_p, epsilon_cutoff, eta_cutoff: the ``generation_config``'s other warpers (``None``: off).
    """

    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float | None = 1.0
    seed: int | None = None
    top_h: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None

    def __post_init__(self) -> None:
        for name in (*_GLOBAL_DEFAULTS, *_CONFIG_WARPERS):
            _check_setting(name, getattr(self, name))
        check_seed(self.seed)

    @classmethod
    def resolve(cls, generation_config: Any = None, **overrides: Any) -> SamplingParams:
        """Call arguments over the model's ``generation_config`` over transformers' global defaults.

        Raises:
            InvalidInputError: a value out of range; one that comes from the config says so.
        """
        values = {}
        for name in (*_GLOBAL_DEFAULTS, *_CONFIG_WARPERS):
            value = overrides.get(name) if name in _GLOBAL_DEFAULTS else None
            if value is None and generation_config is not None:
                value = getattr(generation_config, name, None)
                fix = f"pipe.target.generation_config.{name}, or pass {name}=... with the call"
                _check_setting(name, value, f"the target's generation_config sets it: change {fix}")
            values[name] = _GLOBAL_DEFAULTS.get(name) if value is None else value
        return cls(seed=overrides.get("seed"), **values)

    @classmethod
    def for_call(
        cls, do_sample: Any, generation_config: Any = None, **overrides: Any
    ) -> SamplingParams | None:
        """A call's sampling settings (:meth:`resolve`), or ``None`` for greedy decoding (``do_sample=False``).

        Raises:
            ValueError: ``do_sample`` is not ``True`` or ``False``, the seed is not an integer, or a setting of the
                wrong type or out of range (the warpers' settings are checked when sampling only: greedy decoding
                ignores them, as ``generate()`` does, with a ``UserWarning`` naming the ones given).
        """
        if not isinstance(do_sample, bool):
            raise InvalidInputError(
                f"do_sample={do_sample!r} is invalid: use True (sample from the target's distribution) or False "
                "(greedy decoding)"
            )
        check_seed(overrides.get("seed"))
        if do_sample:
            return cls.resolve(generation_config, **overrides)
        ignored = [
            f"{name}={overrides[name]!r}" for name in _GLOBAL_DEFAULTS if overrides.get(name) is not None
        ]
        if ignored:
            warnings.warn(
                f"do_sample=False: greedy decoding ignores {', '.join(ignored)}; pass do_sample=True to sample "
                "with them (as generate() does)",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
        return None

    def warpers(self) -> LogitsProcessorList:
        """transformers' warpers in ``generate()``'s order and conditions."""
        out = LogitsProcessorList()
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_h is not None:
            out.append(transformers.TopHLogitsWarper(top_h=self.top_h))  # newer transformers only
        if self.top_k:
            out.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p is not None and self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        if self.min_p is not None:
            out.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        if self.typical_p is not None and self.typical_p < 1.0:
            out.append(TypicalLogitsWarper(mass=self.typical_p, min_tokens_to_keep=1))
        if self.epsilon_cutoff is not None and 0.0 < self.epsilon_cutoff < 1.0:
            out.append(EpsilonLogitsWarper(epsilon=self.epsilon_cutoff, min_tokens_to_keep=1))
        if self.eta_cutoff is not None and 0.0 < self.eta_cutoff < 1.0:
            out.append(EtaLogitsWarper(epsilon=self.eta_cutoff, min_tokens_to_keep=1))
        return out

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped next-token distributions.

        Args:
            logits: ``[n, V]`` raw logits.

        Returns:
            ``[n, V]`` float32 probabilities.
        """
        warped = self.warpers()(None, logits.float())
        return torch.softmax(warped, dim=-1)

    def generator(self, device: torch.device) -> torch.Generator:
        """A generator on ``device``, seeded with ``seed`` (or from torch's global RNG when unseeded)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return gen


def draw(probs: torch.Tensor, generator: torch.Generator | None, n: int = 1) -> torch.Tensor:
    """``n`` independent draws from each distribution of ``probs`` ``[..., V]`` (non-negative, not necessarily
    normalised): ``[..., n]`` token ids, each ``v`` with probability ``probs[..., v] / probs.sum(-1)``.

    Inverse transform sampling: one uniform ``u`` per draw, scaled to the row's total, and the first token whose
    cumulative mass exceeds it (``searchsorted``; a token with no mass is never the first to exceed anything). The
    cumulative sums are float64, so the law is the distribution's to ~1e-12. Why not ``torch.multinomial``: on a CPU
    it spends an exponential draw on every vocabulary entry, ~4x this for 13 rows of Qwen's 152k-token vocabulary
    (57 ms against 17 ms a verification step) and ~7x for the fixtures' 1k; the law is the same.
    """
    cdf = probs.double().cumsum(-1)  # [..., V]
    if cdf.device.type == "cpu" and not bool((cdf[..., -1] > 0).all() & cdf[..., -1].isfinite().all()):
        raise ValueError(f"cannot sample from a distribution without mass or with inf/nan entries: {probs}")
    u = torch.rand((*probs.shape[:-1], n), dtype=torch.float64, generator=generator, device=probs.device)
    # u * total < total (u < 1); the clamp only guards the rounding of that product, a ~1e-16 event
    return torch.searchsorted(cdf, u * cdf[..., -1:], right=True).clamp_(max=probs.shape[-1] - 1)


@dataclass
class Sampler:
    """A request's sampling state: the settings and the seeded generator on the target's device."""

    params: SamplingParams
    generator: torch.Generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, V]`` warped distributions of ``[n, V]`` logits."""
        return self.params.probs(logits)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token ``[]`` from the warped distribution of ``[V]`` logits."""
        return draw(self.probs(logits[None]), self.generator).reshape(())
