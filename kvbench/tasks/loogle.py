"""LooGLE (Li et al., 2024): questions over long documents, prompted and cut as bigai-nlco/LooGLE's
``Prediction/pred_opensource_models.py`` and scored by its automatic metrics (:mod:`kvbench.metrics.loogle`).

Subsets (``task.subtasks``): ``shortdep_qa``, ``longdep_qa``, ``shortdep_cloze`` and ``longdep_summarization``, from
the hub dataset ``bigainlco/LooGLE`` or the repository's ``LooGLE-testdata/<subset>.jsonl`` (``task.data_dir``). A
document's questions (its ``qa_pairs``; a summary has none) are records with one ``context_id``, so a query-agnostic
run compresses each document once for its questions. The prompt is ``config/task2prompt.json``'s, cut in the middle to
``task.max_length`` tokens as LongBench's ``pred.py`` cuts (each half decoded alone), sent raw as there; each subset
generates ``config/task2maxlen.json``'s tokens (greedy: the repository's ``repetition_penalty=2`` is not applied).
A record's score is ROUGE-L recall (the cloze: the share of its masks filled exactly); its record also carries BLEU-1/4
and ROUGE-1/2 (the cloze: its exact, partial and mask counts), and a cloze subset's score is the exact matches over all
its masks, as ``automatic_eval.py`` sums them.
"""

from __future__ import annotations

import ast
import json
from itertools import islice
from typing import Any

from kvbench.hub import hub_rows
from kvbench.metrics.loogle import cloze_matches, text_metrics
from kvbench.tasks.base import Sample, TableLayout
from kvbench.tasks.qa import SubsetsTask, subset_domains

HUB_REPO = "bigainlco/LooGLE"
#: ``config/task2prompt.json``
PROMPTS = {
    "shortdep_qa": "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: ",
    "longdep_qa": "Please answer the question based on the long texts below. \n{input}\nQuestion: {Q}\nAnswer: ",
    "longdep_summarization": "Please generate a summary of the below paper. \n{input}\n Summarization: ",
    "shortdep_cloze": "Please fill in the clozes based on the given long texts below. Each of the placeholder "
    "'<mask-n>' in the question could be an entity of Person, Location or Organiocation. The same masks represent the "
    "same entity. Output a json format answer, for example: {{'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion Magazine',"
    "'<mask-2>': 'Bethel Horizon'}}\n{input}\n Question: {Q} What are the masked entities? \nAnswer:",
}
#: ``config/task2maxlen.json``
MAX_NEW_TOKENS = {"shortdep_qa": 300, "longdep_qa": 500, "longdep_summarization": 500, "shortdep_cloze": 50}
SUBSETS = tuple(MAX_NEW_TOKENS)
HUB_CONFIGS = {"longdep_summarization": "summarization"}  # the hub's name of a subset, where it differs
CLOZE = "shortdep_cloze"


class LooGLETask(SubsetsTask):
    """``task=loogle``: each document's questions through :class:`QATask`'s sampling, with LooGLE's prompts, cut,
    answer lengths and automatic metrics."""

    title = "LooGLE"
    name = "loogle"
    new_tokens = MAX_NEW_TOKENS

    table = TableLayout(title="LooGLE", order=SUBSETS)
    hub_repo = HUB_REPO
    domains = subset_domains(SUBSETS, HUB_REPO, "document")

    def how_to_provide(self) -> str:
        folder = "set task.data_dir=FOLDER (or KVBENCH_LOOGLE_DIR)"
        return f"put LooGLE-testdata/<subset>.jsonl of bigai-nlco/LooGLE in a folder and {folder}"

    def documents(self, subset: str) -> list[dict[str, Any]]:
        """The subset's first ``num_samples`` documents, from ``data_dir`` or streamed from the hub."""
        if self.data_dir is not None:
            return self.subset_rows(subset)
        rows = hub_rows(HUB_REPO, "test", self.how_to_provide(), HUB_CONFIGS.get(subset, subset))
        return list(islice(rows, self.limit))

    def records(self) -> list[dict[str, Any]]:
        """One record per question of each document (:func:`questions`); answers as LooGLE scores them (a cloze's: its
        masks' entities as a JSON mapping)."""
        records = []
        for subset in self.subsets:
            for index, document in enumerate(self.documents(subset)):
                for number, pair in enumerate(questions(document)):
                    answer = pair["A"]
                    if subset == CLOZE and isinstance(answer, list):
                        answer = {f"<mask-{slot}>": entity for slot, entity in enumerate(answer)}
                    records.append(
                        {
                            "id": f"{subset}-{document.get('id', index)}-{number}",
                            "subtask": subset,
                            "context": document.get("input", document.get("context")),
                            "question": pair["Q"],
                            "answer": json.dumps(answer, ensure_ascii=False) if isinstance(answer, dict) else answer,
                            "max_new_tokens": MAX_NEW_TOKENS[subset],
                        }
                    )
        return records

    def prompt_of(self, record: dict[str, Any]) -> str:
        """The subset's prompt, its ``{input}`` (the document) as ``{context}``."""
        return PROMPTS[record["subtask"]].replace("{input}", "{context}", 1)

    def fields(self, record: dict[str, Any]) -> dict[str, Any]:
        return {"context": record["context"], "Q": record["question"]}

    def evaluate(self, sample: Sample, output: Any) -> dict[str, Any]:
        """The prediction, its score and every metric of its subset; an empty prediction is scored as the text
        ``None`` (``Evaluation/automatic_eval.py`` lines 23-24 at 6734382: ``if hyp == '': hyp = 'None'``)."""
        answer, scored = sample.answers[0], output if output != "" else "None"
        if sample.subtask == CLOZE:
            matches = cloze_matches(json.loads(answer), scored)
            return {"prediction": output, "score": matches["exact"] / max(matches["count"], 1), **matches}
        metrics = text_metrics(answer, scored)
        return {"prediction": output, "score": metrics["rougeL"], **metrics}

    def score(self, sample: Sample, prediction: str) -> float:
        return float(self.evaluate(sample, prediction)["score"])

    def aggregate(self, records: list[dict]) -> dict[str, float]:
        """Each subset's mean score (0-100); the cloze's exact matches over all its masks."""
        scores = super().aggregate(records)
        cloze = [record for record in records if record["subtask"] == CLOZE]
        if cloze:
            masks = sum(record["count"] for record in cloze)
            scores[CLOZE] = 100.0 * sum(record["exact"] for record in cloze) / max(masks, 1)
        return scores


def questions(row: dict[str, Any]) -> list[dict[str, Any]]:
    """A row's questions ``{"Q", "A"}``: the repository's rows hold a document (``input``) with its ``qa_pairs`` (a
    Python literal; ``"none"`` for a summary, whose answer is ``output``), the hub's one question each (``context``,
    ``question``, ``answer``)."""
    if "qa_pairs" not in row:
        return [{"Q": row["question"], "A": row["answer"]}]
    if row["qa_pairs"] == "none":
        return [{"Q": "", "A": row["output"]}]
    return list(ast.literal_eval(str(row["qa_pairs"])))
