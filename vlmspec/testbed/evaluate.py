"""Quality figures of a testbed pair on held-out scenes (seeds below the training offset).

* ``caption_accuracy`` / ``video_accuracy``: share of scene-determined caption facts (count, background, and
  per shape size, colour, kind, event, positions) a greedy caption gets right (see
  :func:`vlmspec.testbed.world.fact_accuracy`).
* ``qa_exact_match``: greedy answers equal to the reference.
* ``entropy_autocorr``: lag-1 Pearson correlation of the target's per-token entropy along its greedy image and
  video captions (pairs pooled over captions), the property SAGE relies on.
* ``draft_agreement``: share of the target's greedy caption tokens the draft predicts (teacher-forced argmax),
  i.e. roughly the per-token acceptance rate of greedy speculative decoding; split by the target's entropy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .data import encode
from .world import Example, fact_accuracy, sample

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch
    from transformers import PreTrainedModel, ProcessorMixin

__all__ = ["HIGH_ENTROPY", "evaluate_pair", "greedy", "lag_autocorr"]

HIGH_ENTROPY = 0.5  # nats: target tokens above this count as "uncertain" in the agreement split
_MAX_NEW = {"image_caption": 96, "video_caption": 96, "image_qa": 8}
_EVAL_BATCH = 32


def greedy(
    model: PreTrainedModel, processor: ProcessorMixin, examples: Sequence[Example], max_new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy replies and the per-token entropies of the model's distributions along them.

    Args:
        model: A testbed model.
        processor: Its processor.
        examples: Examples of one modality.
        max_new_tokens: Longest reply.

    Returns:
        ``(tokens, entropies)``: per example the reply token ids (without the closing EOS) and a float32
        ``[len(tokens)]`` tensor of entropies (nats) of the distributions they were chosen from.
    """
    from ..scores import greedy_logits

    eos = set(model.generation_config.eos_token_id)
    tokens: list[list[int]] = []
    entropies: list[torch.Tensor] = []
    for start in range(0, len(examples), _EVAL_BATCH):
        batch = encode(processor, examples[start : start + _EVAL_BATCH], with_reply=False)
        new, logits = greedy_logits(model, batch, max_new_tokens)  # [B, T], [B, T, V]
        logp = logits.log_softmax(-1)
        entropy = -(logp.exp() * logp).sum(-1)  # [B, T]
        for row in range(new.shape[0]):
            ids = new[row].tolist()
            end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
            tokens.append(ids[:end])
            entropies.append(entropy[row, :end])
    return tokens, entropies


def lag_autocorr(series: Sequence[Sequence[float] | torch.Tensor], lag: int = 1) -> float:
    """Pearson correlation of ``(s[t], s[t + lag])`` pairs pooled over several sequences (``nan`` if undefined).

    The one implementation of the pooled lag autocorrelation; :func:`vlmspec_eval.analysis.lagged_autocorrelation`
    wraps it. Sequences no longer than ``lag`` add no pairs; ``lag = 0`` pairs each value with itself.

    Args:
        series: 1-D tensors or sequences of floats (e.g. per-caption entropies).
        lag: the offset ``k >= 0``.

    Returns:
        The correlation, or ``nan`` with fewer than 3 pooled pairs or when either side is constant.

    Raises:
        ValueError: a negative ``lag``.
    """
    import torch

    if lag < 0:
        raise ValueError(f"lag={lag!r} is invalid: use an integer >= 0")
    values = [torch.as_tensor(s, dtype=torch.float64).detach().cpu().reshape(-1) for s in series]
    long_enough = [v for v in values if len(v) > lag]
    if not long_enough:
        return float("nan")
    x = torch.cat([v[: len(v) - lag] for v in long_enough])
    y = torch.cat([v[lag:] for v in long_enough])
    if len(x) < 3 or bool(x.min() == x.max()) or bool(y.min() == y.max()):
        return float("nan")
    x, y = x - x.mean(), y - y.mean()
    r = (x * y).sum() / ((x * x).sum() * (y * y).sum()).sqrt()
    return float(r.clamp(-1.0, 1.0))  # rounding can step past +-1; nan (a nan input) stays nan


def _agreement(
    draft: PreTrainedModel, processor: ProcessorMixin, examples: Sequence[Example], replies: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced draft argmax == the given replies' tokens, per reply token (flattened ``[N]`` bool)."""
    import torch

    from .data import IGNORE

    forced = [
        Example(e.task, e.seed, e.prompt, r, image=e.image, video=e.video, scene=e.scene)
        for e, r in zip(examples, replies, strict=True)
    ]
    hits, kept = [], []
    for start in range(0, len(forced), _EVAL_BATCH):
        batch = encode(processor, forced[start : start + _EVAL_BATCH])
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = draft(**batch).logits[:, :-1]
        target = labels[:, 1:]
        mask = target != IGNORE
        eos = processor.tokenizer.eos_token_id
        mask &= target != eos  # the closing EOS is not part of the reply text
        hits.append((logits.argmax(-1) == target)[mask])
        kept.append(mask.sum(1))
    return torch.cat(hits), torch.cat(kept)


def evaluate_pair(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    processor: ProcessorMixin,
    examples_per_task: int,
    first_seed: int = 0,
) -> dict[str, Any]:
    """Scores a pair on held-out seeds ``first_seed .. first_seed + examples_per_task - 1`` of every task.

    Returns:
        ``{"target": {...}, "draft": {...}, "entropy_autocorr": float, "entropy_autocorr_lag2": float,
        "draft_agreement": float, "draft_agreement_confident": float, "draft_agreement_uncertain": float,
        "mean_caption_tokens": float}``; each model's dict has ``caption_accuracy``, ``video_accuracy`` and
        ``qa_exact_match``.
    """
    import torch

    tokenizer = processor.tokenizer
    sets = {task: [sample(task, first_seed + i) for i in range(examples_per_task)] for task in _MAX_NEW}
    figures: dict[str, Any] = {}
    target_captions: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
    for role, model in (("target", target), ("draft", draft)):
        model.eval()
        scores: dict[str, float] = {}
        for task, examples in sets.items():
            ids, entropies = greedy(model, processor, examples, _MAX_NEW[task])
            texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in ids]
            if task == "image_qa":
                scores["qa_exact_match"] = sum(
                    t == e.reference for t, e in zip(texts, examples, strict=True)
                ) / len(examples)
                continue
            correct = total = 0
            for text, example in zip(texts, examples, strict=True):
                c, n = fact_accuracy(text, example.reference)
                correct, total = correct + c, total + n
            scores["caption_accuracy" if task == "image_caption" else "video_accuracy"] = correct / total
            if role == "target":
                target_captions[task] = (texts, entropies)
        figures[role] = {k: round(v, 4) for k, v in scores.items()}
    entropies = [h for task in target_captions for h in target_captions[task][1]]
    figures["entropy_autocorr"] = round(lag_autocorr(entropies, 1), 4)
    figures["entropy_autocorr_lag2"] = round(lag_autocorr(entropies, 2), 4)
    figures["mean_caption_tokens"] = round(sum(len(h) for h in entropies) / max(len(entropies), 1), 1)
    hits, flat_entropy = [], []
    for task, (texts, ents) in target_captions.items():
        agree, lengths = _agreement(draft, processor, sets[task], texts)
        hits.append(agree)
        # Re-tokenised replies equal the generated ids for world text; fall back to no split otherwise.
        if int(lengths.sum()) == sum(len(h) for h in ents):
            flat_entropy.append(torch.cat(ents))
    agree = torch.cat(hits).float()
    figures["draft_agreement"] = round(float(agree.mean()), 4)
    if len(flat_entropy) == len(hits):
        uncertain = torch.cat(flat_entropy) > HIGH_ENTROPY
        figures["draft_agreement_confident"] = round(float(agree[~uncertain].mean()), 4)
        figures["draft_agreement_uncertain"] = round(float(agree[uncertain].mean()), 4)
        figures["target_uncertain_share"] = round(float(uncertain.float().mean()), 4)
    return figures
