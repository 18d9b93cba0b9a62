"""Needle-in-a-haystack scorers (Kamradt's test as the KV-cache eviction repositories run it).

* :func:`substring_match` -- the original tester's ``evaluate_response_substring_match``: 1 when
  every key phrase ("sandwich", "dolores") occurs in the lower-cased response, else 0.
* :func:`rouge1` -- ``rouge_score``'s ROUGE-1 with the Porter stemmer between the needle (reference)
  and the stripped response (0 for an empty response). KVCache-Factory's ``run_needle_in_haystack.py``
  (and NVIDIA kvpress's needle scorer) report ``fmeasure * 10``; ``stat="recall"`` gives the recall.
  Scores here stay on 0-1; multiply by 10 for those repositories' heatmap scale.
"""

from __future__ import annotations

import functools

ROUGE_STATS = ("fmeasure", "recall", "precision")


def substring_match(prediction: str, keys: list[str]) -> float:
    """1.0 when every key occurs in the prediction (case-insensitive), else 0.0 (0.0 without keys)."""
    text = prediction.lower()
    return float(bool(keys) and all(key.lower() in text for key in keys))


@functools.lru_cache(maxsize=1)
def _scorer():
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)


def rouge1(reference: str, prediction: str, stat: str = "fmeasure") -> float:
    """ROUGE-1 ``stat`` (fmeasure, recall or precision) of the stripped prediction against the reference."""
    if stat not in ROUGE_STATS:
        raise ValueError(f"unknown ROUGE statistic {stat!r}; valid: {', '.join(ROUGE_STATS)}")
    response = prediction.strip()
    if not response:
        return 0.0
    return float(getattr(_scorer().score(reference, response)["rouge1"], stat))
