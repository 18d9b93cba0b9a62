"""LongBench-v2 (Bai et al., 2024): 503 long multiple-choice questions, prompted, cut and scored as THUDM's ``pred.py``
and ``result.py`` (the ``THUDM/LongBench`` repository, LongBench-v2's code).

The prompt (``task.prompt``) is ``prompts/0shot.txt`` with the record's context, question and four choices, each
stripped, sent as one user turn (``pred.py`` sends it to a chat endpoint: here the model's chat template). A prompt
longer than ``max_length`` tokens (counted with the special tokens) keeps its first and last ``max_length // 2``
tokens, decoded together. The answer is up to 128 new tokens; its letter is the one ``extract_answer`` finds ("The
correct answer is (X)"), right when it is the record's. ``result.py``'s table: accuracy overall, on the easy and hard
questions and on the short, medium and long ones.
"""

from __future__ import annotations

from typing import Any

from kvbench.domains import choice
from kvbench.tasks.base import TableLayout
from kvbench.tasks.qa import QATask

CHOICES = ("choice_A", "choice_B", "choice_C", "choice_D")
SPLITS = {"difficulty": ("easy", "hard"), "length": ("short", "medium", "long")}


class LongBenchV2Task(QATask):
    """``task=longbench_v2``: :class:`QATask` over LongBench-v2's records (``task.path``: its ``data.json``, else the
    hub), the official prompt in ``task.prompt``, its fields stripped, cut as ``pred.py`` cuts, scored by splits."""

    name = "longbench_v2"
    table = TableLayout(title="LongBench-v2", order=("overall", *SPLITS["difficulty"], *SPLITS["length"]))
    record_fields = ("difficulty", "length", "domain")
    kvpress_rows = False
    domains = {**QATask.domains, "empty_answers": choice("wrong", "skipped")}
    joined_cut = odd_to_tail = True  # pred.py's query_llm: input_ids[:max_len//2] + input_ids[-max_len//2:]

    def how_to_provide(self) -> str:
        return f"download data.json of {self.settings.hub} and set task.path=FILE (or KVBENCH_LONGBENCH_V2_PATH)"

    def fields(self, record: dict[str, Any]) -> dict[str, Any]:
        """The record's context, question and choices stripped, as ``pred.py`` fills the template: by a chain of
        ``str.replace`` (line 93 at 2e00731: ``$DOC$``, then ``$Q$``, then ``$C_A$``..``$C_D$``), so a later field's
        placeholder written inside an earlier field's text is replaced too (a document quoting ``$Q$`` gets the
        question); each field here is the text that chain leaves in its place."""
        values = [str(record[key]).strip() for key in ("context", "question", *CHOICES)]
        placeholders = ("$Q$", "$C_A$", "$C_B$", "$C_C$", "$C_D$")  # what follows each field in the chain
        for index in range(len(values)):
            for placeholder, later in zip(placeholders[index:], values[index + 1 :]):
                values[index] = values[index].replace(placeholder, later)
        return dict(zip(("context", "question", *CHOICES), values))

    def aggregate(self, records: list[dict]) -> dict[str, float]:
        """Accuracy (0-100) over every record and over each difficulty and length (the splits with records); with
        ``task.empty_answers=skipped`` the questions answered with nothing are left out, as ``pred.py`` (line 98 at
        2e00731: ``if output == '': continue``) writes no record for them."""
        if self.settings.get("empty_answers") == "skipped":
            records = [record for record in records if record["prediction"] != ""]
        groups: dict[str, list[float]] = {"overall": [record["score"] for record in records]}
        for field, names in SPLITS.items():
            for name in names:
                scores = [record["score"] for record in records if record.get(field) == name]
                if scores:
                    groups[name] = scores
        return {name: 100.0 * sum(scores) / len(scores) for name, scores in groups.items() if scores}
