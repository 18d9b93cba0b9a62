"""GSM8K (``task=gsm8k``): grade-school math word problems answered by a reasoning trace, the task on which the
decode-time compression papers (R-KV, kvpress's decoding presses) measure eviction while a model writes.

Each row's ``question`` goes in one user turn of the model's chat template with the instruction to reason step by
step and put the final answer within ``\\boxed{}`` (``task.prompt``); the row's ``answer`` is GSM8K's solution ending
``#### N``, and the score is :func:`kvbench.metrics.math.gsm8k_match`. Rows come from the hub (``openai/gsm8k``, its
``main`` configuration's test split) or a file of rows in its format (``task.path``). There is no context: the whole
prompt is the question, so eviction acts on the trace (``engine.regime=streaming`` evicts while it decodes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvbench.domains import Domain
from kvbench.tasks.base import TableLayout
from kvbench.tasks.qa import QATask


class GSM8KTask(QATask):
    """:class:`QATask`'s settings, its ``prompt`` a text with ``{question}``."""

    name = "gsm8k"
    table = TableLayout(title="Math reasoning")
    domains = {
        **QATask.domains,
        "prompt": Domain("a text with {question}", lambda value: isinstance(value, str) and "{question}" in value),
    }
    kvpress_rows = False  # the question templated whole, as the reasoning papers prompt it

    def rows(self) -> Iterator[dict[str, Any]]:
        """The table's rows, each with an empty context (the prompt is its question)."""
        for row in super().rows():
            yield {"context": "", **row}

    def how_to_provide(self) -> str:
        return "save its rows (question, answer ending '#### N') as jsonl or parquet and set task.path=FILE"
