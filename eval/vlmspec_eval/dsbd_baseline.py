"""DSBD's benchmark pieces (paper section 4.2): the baseline it is measured against, the target's own beam
sampling, and the quality measure, the perplexity of a generation under the target. The algorithm itself is
:mod:`vlmspec.policies.dsbd`; its acceptance maths :mod:`vlmspec.verify`."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlmspec.errors import InvalidInputError
from vlmspec.policies.base import is_int
from vlmspec.policies.dsbd import PAPER_TOP_K, PAPER_TOP_P
from vlmspec.probe import sync
from vlmspec.scores import continuation_logits
from vlmspec.stopping import eos_token_ids, until_eos


@dataclass
class BeamSamplingOutput:
    """The target's own beam sampling on one input.

    Attributes:
        token_ids: generated tokens (EOS included when produced, as ``generate()`` and the pipeline count them).
        text: the decoded generation (special tokens skipped).
        seconds: wall time of ``generate()`` (device synchronised).
    """

    token_ids: list[int]
    text: str
    seconds: float


@torch.inference_mode()
def beam_sampling_baseline(
    pipe: Any,
    image: Any,
    prompt: str,
    width: int,
    max_new_tokens: int = 128,
    seed: int = 0,
    *,
    video: Any = None,
    temperature: float = 1.0,
    top_k: int = PAPER_TOP_K,
    top_p: float = PAPER_TOP_P,
) -> BeamSamplingOutput:
    """Beam sampling with the target alone: ``target.generate(num_beams=width, do_sample=True, top_k, top_p)``.

    The paper's baseline (section 4.2; ``width = 1`` is multinomial sampling). The same prompt as ``pipe(...)``
    builds; transformers' sampling draws from torch's global generator, seeded with ``seed`` inside a forked RNG
    state so the caller's is untouched. Note that transformers' beam sampling draws ``2 * width`` candidates
    without replacement and keeps the best ``width`` by score, not ``width`` i.i.d. draws.

    Args:
        pipe: a :class:`~vlmspec.pipeline.VLMSpecPipeline` (its target and processor are used).
        image, prompt, video: as for ``pipe(...)``.
        width: ``num_beams`` (>= 1).
        max_new_tokens: the most tokens to generate.
        seed: seeds the sampling.
        temperature, top_k, top_p: the warping (paper section 4: 1.0, 10, 0.8).
    """
    if not (is_int(width) and width >= 1):
        raise InvalidInputError(f"width={width!r} is invalid: use an integer >= 1 (num_beams)")
    inputs = pipe.prepare_inputs(image, prompt, video)
    prompt_len = inputs["input_ids"].shape[1]
    device = inputs["input_ids"].device
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        sync(device)
        t0 = time.perf_counter()
        out = pipe.target.generate(
            **inputs,
            num_beams=width,
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            num_return_sequences=1,
        )
        sync(device)
        seconds = time.perf_counter() - t0
    tokens = until_eos(out[0, prompt_len:].tolist(), eos_token_ids(pipe.target))
    text = pipe.tokenizer.decode(tokens, skip_special_tokens=True)
    return BeamSamplingOutput(tokens, text, seconds)


@torch.inference_mode()
def perplexity(pipe: Any, inputs: dict[str, Any], token_ids: Sequence[int]) -> float:
    """Perplexity of ``token_ids`` (a generation) under the target, given the prompt ``inputs``: one forward.

    ``exp(-mean_i log p_target(y_i | prompt, y_<i))`` with the target's raw (unwarped) distribution, over every
    generated token (EOS included when present), the measure of the paper's PPL columns.

    Args:
        pipe: a :class:`~vlmspec.pipeline.VLMSpecPipeline`.
        inputs: the prompt's processor outputs (``pipe.prepare_inputs(...)``).
        token_ids: the generated tokens (at least one).
    """
    logits = continuation_logits(pipe.target, inputs, token_ids).double()  # [n, V]: the new tokens' rows
    chosen = torch.tensor(list(token_ids), device=logits.device)
    nll = -logits.log_softmax(-1).gather(-1, chosen[:, None]).mean()
    return float(math.exp(float(nll)))
