"""RULER's metrics: case-insensitive substring matches of the references in the prediction.

Same definitions as RULER's ``scripts/eval/synthetic/constants.py``, per sample (0-1); the benchmark
score is their mean over samples.
"""

from __future__ import annotations


def _found(prediction: str, references: list[str]) -> list[float]:
    text = prediction.lower()
    return [1.0 if reference.lower() in text else 0.0 for reference in references]


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of the references found in the prediction (NIAH, vt, cwe, fwe); 0 without references."""
    return sum(_found(prediction, references)) / len(references) if references else 0.0


def string_match_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is found in the prediction, else 0 (RULER's QA tasks)."""
    return max(_found(prediction, references), default=0.0)
