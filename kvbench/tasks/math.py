"""Math reasoning (``task=gsm8k``, ``math500``, ``aime24``, ``aime25``): problems answered by a reasoning trace, the
tasks on which the decode-time compression papers (R-KV, kvpress's decoding presses) measure eviction while a model
writes.

Each row's question (``task.columns``: MATH-500's and AIME's ``problem``) goes in one user turn of the model's chat
template with the instruction to reason step by step and put the final answer within ``\\boxed{}`` (``task.prompt``).
The score (``task.metric``, :mod:`kvbench.metrics.math`): GSM8K's numeric match against the solution's ``#### N``, or
math-verify's equivalence of the trace's answer with the row's. Rows come from the hub or a file of rows in the
dataset's format (``task.path``). There is no context: the whole prompt is the question, so eviction acts on the
trace (``engine.regime=streaming`` evicts while it decodes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvbench.domains import Domain
from kvbench.tasks.base import TableLayout
from kvbench.tasks.qa import QATask


class MathTask(QATask):
    """:class:`QATask`'s settings, its ``prompt`` a text with ``{question}``."""

    name = "math"
    table = TableLayout(title="Math reasoning")
    domains = {
        **QATask.domains,
        "prompt": Domain("a text with {question}", lambda value: isinstance(value, str) and "{question}" in value),
    }
    kvpress_rows = False  # the question templated whole, as the reasoning papers prompt it
    splits_prompts = False  # no context before the question: task.query_mode=agnostic has nothing to compress

    def rows(self) -> Iterator[dict[str, Any]]:
        """The table's rows, each with an empty context (the prompt is its question)."""
        for row in super().rows():
            yield {"context": "", **row}

    def how_to_provide(self) -> str:
        question, answer = self.columns["question"], self.columns["answer"]
        return f"save its rows ({question}, {answer}) as jsonl or parquet and set task.path=FILE"
