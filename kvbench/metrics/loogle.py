"""LooGLE's automatic metrics (bigai-nlco/LooGLE ``Evaluation/automatic_metrics.py``) that run offline: BLEU-1/4
(nltk), ROUGE-1/2/L recall (the ``rouge`` package) and the cloze's exact and partial matches. METEOR (WordNet's data)
and BERTScore (a model from the hub) are not computed."""

from __future__ import annotations

import ast
import warnings
from typing import Any

from nltk.translate.bleu_score import sentence_bleu
from rouge import Rouge


def text_metrics(reference: str, hypothesis: str) -> dict[str, float]:
    """``get_bleu_score`` and ``get_rouge_score`` (recall) of one answer; 0 where ``rouge`` refuses an empty text."""
    words, predicted = reference.replace("\n", " ").split(), hypothesis.replace("\n", " ").split()
    with warnings.catch_warnings():  # nltk warns when a hypothesis shares no n-gram of an order
        warnings.simplefilter("ignore")
        scores = {
            "bleu1": float(sentence_bleu([words], predicted, weights=(1, 0, 0, 0))),
            "bleu4": float(sentence_bleu([words], predicted, weights=(0, 0, 0, 1))),
        }
    try:
        rouge = Rouge().get_scores(hyps=[hypothesis], refs=[reference])[0]
    except ValueError:  # an empty hypothesis or reference
        rouge = {name: {"r": 0.0} for name in ("rouge-1", "rouge-2", "rouge-l")}
    return {**scores, "rouge1": rouge["rouge-1"]["r"], "rouge2": rouge["rouge-2"]["r"], "rougeL": rouge["rouge-l"]["r"]}


def cloze_matches(reference: dict[str, str], hypothesis: str) -> dict[str, int]:
    """``get_exact_match`` and ``get_partial_match``: of the reference's masks, how many the prediction (a dict
    literal) fills exactly, and how many it fills with a word of the entity; ``count`` the masks."""
    count = len(reference)
    try:
        predicted: Any = ast.literal_eval(hypothesis.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        predicted = None
    if not isinstance(predicted, dict):
        return {"exact": 0, "partial": 0, "count": count}
    exact = sum(key in predicted and predicted[key] == value for key, value in reference.items())
    partial = sum(
        key in predicted and bool(set(value.split()) & set(str(predicted[key]).split()))
        for key, value in reference.items()
    )
    return {"exact": exact, "partial": partial, "count": count}
