"""Analyses behind SAGE's figures: the target's entropy autocorrelation (Fig. 2) and tau vs length (Fig. 3).

* **Entropy autocorrelation**: the target's next-token entropy at every position of a generated caption
  (teacher-forced: one prefill plus one causal forward over the generated tokens), and the Pearson correlation
  between ``H_t`` and ``H_{t+k}`` for lags ``k = 1..5``, pairs pooled over the captions of a task. A high value
  is what lets SAGE use this step's confidence to shape the next tree.
* **Tau vs generation length**: from each run's per-step acceptance trace, the running mean of accepted tokens
  per step after the step that reached ``x`` generated tokens, i.e. the tau a run stopped at ``x`` tokens
  would report, averaged over inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vlmspec.inputs import on_device
from vlmspec.models import adapter_for
from vlmspec.testbed.evaluate import lag_autocorr
from vlmspec.tree import tree_attention_bias

LAGS: tuple[int, ...] = (1, 2, 3, 4, 5)


@torch.inference_mode()
def token_entropies(
    model: torch.nn.Module, inputs: dict[str, torch.Tensor], token_ids: Sequence[int]
) -> list[float]:
    """The target's entropy (nats) of its next-token distribution at each generated position.

    Args:
        model: the target VLM.
        inputs: processor outputs of the prompt (batch 1).
        token_ids: the generated tokens (``n``).

    Returns:
        ``n`` entropies: ``H_0`` from the prefill (predicting ``token_ids[0]``), then one per fed token.
    """
    if not token_ids:
        return []
    adapter = adapter_for(model)
    inputs = on_device(inputs, adapter.device)
    prefill = adapter.prefill(inputs)
    logits = [prefill.logits[None].float()]  # [1, V]
    fed = torch.tensor(list(token_ids[:-1]), dtype=torch.long, device=adapter.device)
    if fed.numel():
        n = fed.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=adapter.device).tril()
        bias = tree_attention_bias(causal, prefill.state.length, adapter.dtype)
        start = inputs["input_ids"].shape[1]
        positions = torch.arange(start, start + n, device=adapter.device)
        logits.append(adapter.forward(prefill.state, fed, positions, bias).float())  # [n, V]
    logp = torch.log_softmax(torch.cat(logits), dim=-1)
    return (-(logp.exp() * logp).sum(-1)).tolist()


def pearson(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Pearson correlation, or ``None`` with fewer than 3 pairs or a constant series."""
    if len(x) < 3:
        return None
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def lagged_autocorrelation(
    series: Sequence[Sequence[float]], lags: Sequence[int] = LAGS
) -> dict[int, float | None]:
    """Pearson correlation of ``(s[t], s[t + k])`` pairs pooled over all ``series``, per lag ``k``.

    :func:`vlmspec.testbed.evaluate.lag_autocorr` per lag, ``None`` where it is undefined (fewer than 3 pairs or a
    constant side).
    """
    out: dict[int, float | None] = {}
    for lag in lags:
        value = lag_autocorr(series, lag)
        out[lag] = None if math.isnan(value) else value
    return out


def entropy_report(entropies: dict[str, list[list[float]]], lags: Sequence[int] = LAGS) -> dict[str, Any]:
    """Per task (plus ``"all"``): mean entropy, token count and autocorrelation per lag."""
    tasks = dict(entropies)
    tasks["all"] = [s for series in entropies.values() for s in series]
    report = {}
    for task, series in tasks.items():
        values = [v for s in series for v in s]
        report[task] = {
            "mean_entropy": float(np.mean(values)) if values else None,
            "tokens": len(values),
            "autocorr": {str(k): v for k, v in lagged_autocorrelation(series, lags).items()},
        }
    return report


def running_tau(accepted: Sequence[int], max_new_tokens: int) -> list[float | None]:
    """Running tau after the step that reached each generation length ``x = 1..max_new_tokens``.

    ``None`` where the run had not taken a step yet (the prefill's token) or had already stopped.
    """
    out: list[float | None] = [None] * max_new_tokens
    produced, total = 1, 0  # the prefill emits the first token
    x = 2  # next generation length to fill
    for step, acc in enumerate(accepted, start=1):
        total += acc
        produced += acc + 1
        while x <= min(produced, max_new_tokens):
            out[x - 1] = total / step
            x += 1
    return out


def tau_vs_length(runs: dict[str, list[Sequence[int]]], max_new_tokens: int) -> dict[str, dict[str, list]]:
    """Per method: generation lengths and the mean running tau over its runs (see :func:`running_tau`)."""
    out = {}
    for method, traces in runs.items():
        curves = [running_tau(t, max_new_tokens) for t in traces if t]
        if not curves:
            continue
        lengths, taus = [], []
        for x in range(max_new_tokens):
            values = [c[x] for c in curves if c[x] is not None]
            if values:
                lengths.append(x + 1)
                taus.append(sum(values) / len(values))
        out[method] = {"lengths": lengths, "tau": taus}
    return out
