"""The metrics a question-answering table names per dataset (``task=qa``'s ``task.metric``), each 0-1 per sample.

* ``exact_match``: the prediction equals an answer after SQuAD's normalisation (:func:`normalize_answer`);
* ``contains``: an answer is a case-insensitive substring of the prediction (RULER's ``string_match_part``);
  ``contains_all``: the share of the answers found (RULER's ``string_match_all``);
* ``choice``: the option letter LongBench-v2's ``extract_answer`` finds ("The correct answer is (X)", A-D) is the
  answer's; ``letter``: the same, or else a letter standing alone at the prediction's start (:func:`chosen_letter`);
* ``f1``: LongBench's token F1 (``qa_f1``); ``rouge``: LongBench's ROUGE-L (``rouge_l``), each the best over the
  answers;
* ``gsm8k``: the trace's final answer (last ``\\boxed{}``, else last number) equals the solution's ``#### N``;
  ``math_verify``: math-verify finds the trace's answer equivalent to the row's (:mod:`kvbench.metrics.math`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvbench.errors import choose
from kvbench.metrics.longbench import normalize_answer, qa_f1, rouge_l
from kvbench.metrics.math import gsm8k_match, math_verify_match
from kvbench.metrics.ruler import string_match_all, string_match_part

#: LongBench-v2's ``extract_answer`` (``pred.py``): "The correct answer is (X)", then without the parentheses
CORRECT_ANSWER = (re.compile(r"The correct answer is \(([A-D])\)"), re.compile(r"The correct answer is ([A-D])"))
#: an option letter standing alone at the start of a prediction: "B", "(B)", "B." or "B)"
LEADING_LETTER = re.compile(r"^\s*\(?([A-Z])(?:[).:]|\s|$)")


def chosen_letter(prediction: str, leading: bool = False) -> str | None:
    """The option letter of ``prediction`` as LongBench-v2's ``extract_answer`` finds it (``*`` removed first), or
    with ``leading`` else a letter standing alone at its start; None where it gives none."""
    text = prediction.replace("*", "")
    for pattern in (*CORRECT_ANSWER, LEADING_LETTER) if leading else CORRECT_ANSWER:
        if match := pattern.search(text):
            return match.group(1)
    return None


def exact_match(prediction: str, answers: list[str]) -> float:
    return float(any(normalize_answer(prediction) == normalize_answer(answer) for answer in answers))


def letter_choice(prediction: str, answers: list[str], leading: bool = False) -> float:
    letter = chosen_letter(prediction, leading)
    return float(letter is not None and any(letter == answer.strip().strip("()").upper() for answer in answers))


def best_of(metric: Callable[[str, str], float]) -> Callable[[str, list[str]], float]:
    """A per-answer metric as the best over the answers (0 with none)."""
    return lambda prediction, answers: max((metric(prediction, answer) for answer in answers), default=0.0)


METRICS: dict[str, Callable[[str, list[str]], float]] = {
    "exact_match": exact_match,
    "contains": string_match_part,
    "contains_all": string_match_all,
    "choice": letter_choice,
    "letter": lambda prediction, answers: letter_choice(prediction, answers, leading=True),
    "f1": best_of(qa_f1),
    "rouge": best_of(rouge_l),
    "gsm8k": gsm8k_match,
    "math_verify": math_verify_match,
}


def qa_score(metric: str, prediction: str, answers: list[str]) -> float:
    """``metric`` (one of :data:`METRICS`) of ``prediction`` against the accepted ``answers``, 0-1."""
    choose("QA metric (task.metric)", metric, METRICS)
    return METRICS[metric](prediction, answers)
