"""NeedleBench (OpenCompass, v1 -- "Can LLMs do retrieval and reasoning in 1 million context window?")
per-sample scores, on 0-1 (OpenCompass reports them x100).

* :func:`single_needle_score` -- ``NeedleBenchOriginEvaluator`` (``use_trim=False``): 1 when the
  keyword occurs in the raw prediction; otherwise 0.2 x the Levenshtein similarity
  ``1 - distance / max(len)`` between the prediction and the needle with all whitespace removed
  (1 when both are empty).
* :func:`multi_retrieval_score` -- ``NeedleBenchParallelEvaluator``: the fraction of the needles'
  keywords found (case-sensitive substrings) in the prediction; OpenCompass averages it per depth,
  which over a whole dataset equals the mean of these per-sample fractions.
* :func:`multi_reasoning_score` -- ``NeedleBenchMultiEvaluator``: the fraction of the answer's
  whitespace-separated lower-cased words found in the lower-cased prediction (0 without words).
"""

from __future__ import annotations

import re

_WHITESPACE = re.compile(r"\s+")


def levenshtein(first: str, second: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(first) < len(second):
        first, second = second, first
    if not second:
        return len(first)
    previous = list(range(len(second) + 1))
    for i, a in enumerate(first, start=1):
        current = [i]
        for j, b in enumerate(second, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (a != b)))
        previous = current
    return previous[-1]


def single_needle_score(prediction: str, needle: str, keyword: str) -> float:
    """The single-needle retrieval score of one prediction, 0-1."""
    if keyword in prediction:
        return 1.0
    pred, ref = _WHITESPACE.sub("", prediction), _WHITESPACE.sub("", needle)
    longest = max(len(pred), len(ref))
    similarity = 1.0 - levenshtein(pred, ref) / longest if longest else 1.0
    return 0.2 * similarity


def multi_retrieval_score(prediction: str, keywords: list[str]) -> float:
    """Fraction of the keywords found in the prediction, 0-1 (0 without keywords)."""
    return sum(keyword in prediction for keyword in keywords) / len(keywords) if keywords else 0.0


def multi_reasoning_score(prediction: str, answer: str) -> float:
    """Fraction of the answer's lower-cased words found in the lower-cased prediction, 0-1."""
    words = answer.lower().split()
    text = prediction.lower()
    return sum(word in text for word in words) / len(words) if words else 0.0
