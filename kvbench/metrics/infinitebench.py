"""InfiniteBench's scorers (OpenBMB/InfiniteBench ``src/compute_scores.py``), each 0-1 for one prediction against the
record's labels: its answers, and for the multiple-choice subset the correct option's text and letter (``get_answer``
of the evaluation scripts)."""

from __future__ import annotations

import re
from collections.abc import Callable

from kvbench.metrics.longbench import qa_f1

#: what ``get_score_one_kv_retrieval`` (and the choice scorer, without ``:``) turn into spaces before splitting words
RETRIEVAL_SEPARATORS = ("\n", ":", '"', "'", ".", ",", "?", "!", "{", "}")
CHOICE_SEPARATORS = ("\n", '"', "'", ".", ",", "?", "!", "{", "}")
CHOICE_PREFIXES = ("answer is:", "answer:", "answer is", "option is")


def first_int(prediction: str) -> str:
    """``first_int_match``: the first run of digits in the prediction ("" without one)."""
    return next((item for item in re.split("[^0-9]", prediction) if item), "")


def spaced(prediction: str, separators: tuple[str, ...]) -> str:
    for separator in separators:
        prediction = prediction.replace(separator, " ")
    return prediction


def first_integer_match(prediction: str, labels: list[str]) -> float:
    """passkey and number_string: the first integer of the prediction is the answer."""
    return float(first_int(prediction) in labels)


def kv_retrieval(prediction: str, labels: list[str]) -> float:
    """Retrieve.KV: the value is one of the prediction's words (split at the separators)."""
    words = spaced(prediction, RETRIEVAL_SEPARATORS).split()
    return float(any(label in words for label in labels))


def longbook_choice(prediction: str, labels: list[str]) -> float:
    """En.MC (``get_score_one_longbook_choice_eng``, compute_scores.py lines 249-255 at 88b3daa): the prediction
    stripped (empty: wrong); its first character if it is an option letter; right if it is one of the labels (the
    option's text); else :func:`choice_in_text`."""
    prediction = prediction.strip()
    if not prediction:
        return 0.0
    if prediction[0] in "ABCD":
        return float(prediction[0] in labels)
    if prediction in labels:
        return 1.0
    return choice_in_text(prediction, labels)


def choice_in_text(prediction: str, labels: list[str]) -> float:
    """The rest of the choice scorers: the text after the first answer prefix ("answer is:", …) starting with a
    label, else the first word that is one of A, B, C, D (or a substring of "ABCD", as there)."""
    prediction = spaced(prediction, CHOICE_SEPARATORS)
    while "  " in prediction:
        prediction = prediction.replace("  ", " ")
    for prefix in CHOICE_PREFIXES:
        index = prediction.find(prefix)
        if index == -1:
            continue
        if len(prediction) < index + len(prefix) + 1:
            return 0.0
        after = prediction[index + len(prefix) + 1 :]
        return float(any(after.startswith(label) for label in labels))
    for word in prediction.split():
        if word in "ABCD":
            return float(word in labels)
    return 0.0


def longbook_qa(prediction: str, labels: list[str]) -> float:
    """En.QA: the best token F1 over the answers (SQuAD's normalisation, as LongBench's ``qa_f1``)."""
    return max((qa_f1(prediction, label) for label in labels), default=0.0)


SCORERS: dict[str, Callable[[str, list[str]], float]] = {
    "passkey": first_integer_match,
    "number_string": first_integer_match,
    "kv_retrieval": kv_retrieval,
    "longbook_choice_eng": longbook_choice,
    "longbook_qa_eng": longbook_qa,
}
