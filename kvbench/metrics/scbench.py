"""SCBench's scorers (microsoft/MInference ``scbench/compute_scores.py``), each 0-1 for one turn's prediction against
its labels (``get_ground_truth``: the answer, as a list)."""

from __future__ import annotations

from collections.abc import Callable

from kvbench.metrics.infinitebench import choice_in_text


def value_in_prediction(prediction: str, labels: list[str]) -> float:
    """``get_score_one_kv_retrieval`` (scbench_kv, scbench_prefix_suffix): the value is in the prediction."""
    return float(any(label in prediction for label in labels))


def named(prediction: str, labels: list[str]) -> float:
    """``get_score_one_longdialogue_qa_eng`` (scbench_qa_eng): a label is in the prediction, case ignored."""
    text = prediction.strip().upper()
    return float(any(label.upper() in text for label in labels))


def option_choice(prediction: str, labels: list[str]) -> float:
    """``get_score_one_longbook_choice_eng`` (scbench_choice_eng; labels: the option's text and letter): the first
    character if an option letter, the whole prediction if a label, else InfiniteBench's rules on its text."""
    prediction = prediction.strip()
    if not prediction:
        return 0.0
    if prediction[0] in "ABCD":
        return float(prediction[0] in labels)
    return 1.0 if prediction in labels else choice_in_text(prediction, labels)


def labels_share(prediction: str, labels: list[str]) -> float:
    """``string_match_all`` (scbench_vt): the share of the labels in the prediction, case ignored, to 2 decimals."""
    return round(sum(label.lower() in prediction.lower() for label in labels) / len(labels), 2) if labels else 0.0


SCORERS: dict[str, Callable[[str, list[str]], float]] = {
    "scbench_kv": value_in_prediction,
    "scbench_prefix_suffix": value_in_prediction,
    "scbench_vt": labels_share,
    "scbench_qa_eng": named,
    "scbench_choice_eng": option_choice,
}
