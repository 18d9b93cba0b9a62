"""Math answers: a reasoning trace's final answer, GSM8K's numeric match and math-verify's equivalence, each 0-1 per
sample.

A trace's final answer is the content of its last ``\\boxed{...}`` (nested braces kept), else its last number —
lm-evaluation-harness's ``gsm8k`` "flexible-extract" where no box is written. GSM8K's reference solution ends
``#### N``. Two answers match as numbers after ``,`` thousands separators, a leading ``$`` and a trailing ``.`` are
dropped (``18`` = ``18.0`` = ``$18``); a boxed answer with no number matches nothing. MATH-500's and AIME's answers
(LaTeX) are compared by HF's math-verify (:func:`math_verify_match`), as the reasoning papers and kvpress score them.
"""

from __future__ import annotations

import re

#: a number as written in a trace: optional sign, thousands separators, decimals
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
BOXED = "\\boxed"


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` (its braces balanced, nested ones kept), or None."""
    start = text.rfind(BOXED + "{")
    if start < 0:
        return None
    depth, begin = 0, start + len(BOXED)
    for place in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[place], 0)
        if depth == 0:
            return text[begin + 1 : place]
    return None  # unclosed: the trace was cut inside its box


def final_answer(prediction: str) -> str | None:
    """The trace's final answer: its last box's content, else its last number (None where it has neither)."""
    boxed = last_boxed(prediction)
    if boxed is not None:
        return boxed
    numbers = NUMBER.findall(prediction)
    return numbers[-1] if numbers else None


def number_of(text: str) -> float | None:
    """The first number written in ``text`` (``$1,234.50`` is 1234.5), or None."""
    match = NUMBER.search(text.replace("$", ""))
    return None if match is None else float(match.group(0).replace(",", "").rstrip("."))


def reference_answer(solution: str) -> str:
    """GSM8K's answer: what follows the solution's ``####`` (the whole text where there is none)."""
    return solution.rsplit("####", 1)[-1].strip()


def gsm8k_match(prediction: str, answers: list[str]) -> float:
    """1 where the trace's final answer equals an answer's ``#### N`` as a number."""
    final = final_answer(prediction)
    value = None if final is None else number_of(final)
    if value is None:
        return 0.0
    return float(any(number_of(reference_answer(answer)) == value for answer in answers))


def math_verify_match(prediction: str, answers: list[str]) -> float:
    """1 where math-verify finds the trace's answer equivalent to an answer (LaTeX, as MATH-500 and AIME give it,
    read as ``$answer$``): its ``parse`` of the prediction (a ``\\boxed{}`` first, else the last LaTeX or plain
    expression; several boxes make one set) and ``verify`` (numbers, fractions, sets, intervals, symbolic
    equality)."""
    from math_verify import parse, verify

    guessed = parse(prediction)
    return float(bool(guessed) and any(verify(parse(f"${answer}$"), guessed) for answer in answers))
