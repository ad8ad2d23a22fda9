"""Text metrics for the local tasks, implemented here (no downloads, no NLTK data).

* :func:`exact_match`: 1.0 when the normalized answer equals the normalized reference.
* :func:`token_f1`: SQuAD-style bag-of-tokens F1.
* :func:`rouge_l`: ROUGE-L F1 (longest common subsequence of tokens; beta = 1).

Normalization (:func:`normalize`): lower case, punctuation removed, articles ``a``/``an``/``the`` dropped,
whitespace collapsed.
"""

from __future__ import annotations

import re
import string
from collections import Counter

__all__ = ["exact_match", "normalize", "rouge_l", "token_f1", "tokens"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans({c: " " for c in string.punctuation})


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def tokens(text: str) -> list[str]:
    """The normalized words of ``text``."""
    return normalize(text).split()


def exact_match(prediction: str, reference: str) -> float:
    """1.0 if the normalized texts are equal, else 0.0."""
    return float(normalize(prediction) == normalize(reference))


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the normalized word multisets (1.0 when both are empty)."""
    pred, ref = tokens(prediction), tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) time, O(len(b)) memory)."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 over normalized words (1.0 when both are empty)."""
    pred, ref = tokens(prediction), tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    lcs = _lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)
