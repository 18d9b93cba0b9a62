"""InfiniteBench (Zhang et al., 2024): 100k+-token retrieval and book tasks, prompted, cut and scored as OpenBMB's
``src/eval_utils.py``, ``src/prompt.py`` and ``src/compute_scores.py``.

Subsets (``task.subtasks``): ``passkey`` and ``number_string`` (Retrieve.PassKey/Number), ``kv_retrieval``
(Retrieve.KV), ``longbook_choice_eng`` (En.MC) and ``longbook_qa_eng`` (En.QA), each ``<subset>.jsonl`` of the hub
dataset ``xinrongzhang2022/InfiniteBench`` or of ``task.data_dir``. Prompts: ``task.templates`` names the repository's
template family — ``gpt4`` (instructions, sent by ``create_msgs`` after the system message "You are a helpful
assistant": here the model's chat template) or ``yarn_mistral`` (completions ending "The pass key is", …, sent raw).
The record's ``input`` is the question; the options fill ``OPTION_A``…``OPTION_D``. A prompt longer than
``task.max_length`` tokens keeps the first and last halves of its token ids, decoded together (``truncate_input``,
"middle"); each subset generates its ``DATA_NAME_TO_MAX_NEW_TOKENS``. Scores: :mod:`kvbench.metrics.infinitebench`,
against the record's answers (En.MC: the correct option's text and letter, ``get_answer``).
"""

from __future__ import annotations

from typing import Any

from kvbench.domains import choice
from kvbench.errors import KVBenchError
from kvbench.metrics.infinitebench import SCORERS
from kvbench.tasks.base import Sample, TableLayout
from kvbench.tasks.qa import SubsetsTask, subset_domains

HUB_REPO = "xinrongzhang2022/InfiniteBench"
#: ``src/prompt.py``'s templates of the subsets, by family
TEMPLATES = {
    "gpt4": {
        "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I "
        "will quiz you about the important information there.\n\n{context}\n\n{input}",
        "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you "
        "about the important information there.\n\n{context}\n\n{input}",
        "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}"
        "\n\n{input}",
        "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {input}\n\nOnly one "
        "of the following options is correct, tell me the answer using one single letter (A, B, C, or D). Don't say "
        "anything else.\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}",
        "longbook_qa_eng": "Read the book below and answer a question.\n\n{context}\n\nQuestion: {input}\n\nBe very "
        "concise.",
    },
    "yarn_mistral": {  # at 88b3daa, after c27d624 "Fix prompt template error" (passkey: "memorize it. ...information.")
        "passkey": "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I "
        "will quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is",
        "number_string": "There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you "
        "about the important information there.\n\n{context}\n\n{input}\n\nThe sequence of digits is",
        "kv_retrieval": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}"
        "\n\n{input}",
        "longbook_choice_eng": "Read the book and answer the question.\n\n{context}\n\nQuestion: {input}\nA. "
        "{OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\nThe letter of the correct answer is",
        "longbook_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}\n\n"
        "Question: {input}\nAnswer:",
    },
}
#: ``DATA_NAME_TO_MAX_NEW_TOKENS``
MAX_NEW_TOKENS = {
    "passkey": 6, "number_string": 12, "kv_retrieval": 50, "longbook_choice_eng": 40, "longbook_qa_eng": 40,
}  # fmt: skip
SUBSETS = tuple(MAX_NEW_TOKENS)
SYSTEM = "You are a helpful assistant"  # create_msgs' system message
HEADERS = {
    "passkey": "Retr.PassKey",
    "number_string": "Retr.Num",
    "kv_retrieval": "Retr.KV",
    "longbook_choice_eng": "En.MC",
    "longbook_qa_eng": "En.QA",
}


class InfiniteBenchTask(SubsetsTask):
    """``task=infinitebench``: the subsets' records through :class:`QATask`'s sampling, with the official templates,
    cut and scorers."""

    title = "InfiniteBench"
    name = "infinitebench"
    new_tokens = MAX_NEW_TOKENS

    table = TableLayout(title="InfiniteBench", order=SUBSETS, headers=HEADERS)
    hub_repo = HUB_REPO
    hub_path = "{subset}.jsonl"
    joined_cut = True  # truncate_input's "middle"
    domains = {**subset_domains(SUBSETS, HUB_REPO, "record"), "templates": choice(*TEMPLATES)}

    def how_to_provide(self) -> str:
        folder = "set task.data_dir=FOLDER (or KVBENCH_INFINITEBENCH_DIR)"
        return f"download <subset>.jsonl of {HUB_REPO} into a folder and {folder}"

    def records(self) -> list[dict[str, Any]]:
        """The first ``num_samples`` records of each subset, in the subsets' order."""
        records = []
        for subset in self.subsets:
            for index, row in enumerate(self.subset_rows(subset)):
                options = list(row.get("options") or [])
                labels = list(row["answer"]) if isinstance(row["answer"], list) else [row["answer"]]
                if subset == "longbook_choice_eng":  # get_answer: the option's text and its letter
                    if labels[0] not in options:
                        raise KVBenchError(f"{subset} record {row.get('id', index)}: its answer is not an option")
                    labels = [labels[0], "ABCD"[options.index(labels[0])]]
                record = {
                    "id": f"{subset}-{row.get('id', index)}",
                    "subtask": subset,
                    "context": row["context"],
                    "question": row["input"],
                    "answer": [str(label) for label in labels],
                    "max_new_tokens": MAX_NEW_TOKENS[subset],
                    **{f"OPTION_{letter}": option for letter, option in zip("ABCD", options)},
                }
                records.append(record)
        return records

    @property
    def odd_to_tail(self) -> bool:  # type: ignore[override]
        """The gpt4 path cuts with ``eval_utils.py``'s ``truncate_input`` (``input[-max_length // 2:]``: an odd
        length's extra token at the tail); ``eval_yarn_mistral.py``'s own cuts ``max_length // 2`` from each end."""
        return self.settings.templates == "gpt4"

    def fields(self, record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "input": record["question"]}

    def prompt_of(self, record: dict[str, Any]) -> str:
        return TEMPLATES[self.settings.templates][record["subtask"]]

    def messages(self, text: str) -> list[dict[str, str]] | None:
        """``create_msgs``' turns for the chat template (``gpt4`` templates): the system message, then the prompt."""
        if self.settings.templates != "gpt4" or self.template != "hf_chat":
            return None
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]

    def score(self, sample: Sample, prediction: str) -> float:
        """The subset's scorer (``compute_scores.py``), 0-1."""
        return SCORERS[sample.subtask](prediction, sample.answers)
