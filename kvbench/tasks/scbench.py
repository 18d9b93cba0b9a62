"""SCBench (Li et al., 2024), shared-context mode: several queries about one context, each answered from the one
compression of the context (``task.query_mode=agnostic``, the default), as microsoft/MInference's
``scbench/run_scbench.py --same_context_different_query`` runs them (``create_scdq_prompt``, ``test_scdq``).

Subsets (``task.subtasks``): ``scbench_kv``, ``scbench_prefix_suffix``, ``scbench_vt``, ``scbench_qa_eng`` and
``scbench_choice_eng``, each ``data/<subset>.jsonl`` of the hub dataset ``microsoft/SCBench`` or of ``task.data_dir``;
a row is a context and its ``multi_turns``, one sample each, sharing the row's ``context_id``. The context prompt
(``multiturn_templates_scdq``) and each turn's query (``multiturn_follow_up_templates_in_chat_tempate``) are
tokenized apart, as there: in the chat template the context closes the user turn's start (split at a delimiter) and a
query is the rest of a user turn after an empty system turn; the context's ids (special tokens added) are cut to
``task.max_length`` by ``truncate_input`` ("middle"), the query's follow them. Each subset generates
``DATA_NAME_TO_MAX_NEW_TOKENS``; scores: :mod:`kvbench.metrics.scbench`. (SCBench's multi-turn mode — the first
query compressed with the context, later turns after the golden answers of the earlier ones — is not built.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvbench.metrics.scbench import SCORERS
from kvbench.tasks.base import Sample, TableLayout, middle_cut
from kvbench.tasks.qa import SubsetsTask, subset_domains

HUB_REPO = "microsoft/SCBench"
#: ``multiturn_templates_scdq`` (context) and ``multiturn_follow_up_templates_in_chat_tempate`` (query)
CONTEXT_TEMPLATES = {
    "scbench_kv": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}",
    "scbench_prefix_suffix": "{context}",
    "scbench_vt": "{context}",
    "scbench_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}",
    "scbench_choice_eng": "Read the book and answer the question.\n\n{context}",
}
QUERY_TEMPLATES = {
    "scbench_kv": "{input}",
    "scbench_prefix_suffix": "{input}",
    "scbench_vt": "{input}",
    "scbench_qa_eng": "Question: {input}\nAnswer:",
    "scbench_choice_eng": "Question: {input}\nA. {OPTION_A}\nB. {OPTION_B}\nC. {OPTION_C}\nD. {OPTION_D}\n\n"
    "The the correct answer is",
}
MAX_NEW_TOKENS = {"scbench_kv": 150, "scbench_prefix_suffix": 150, "scbench_vt": 30, "scbench_qa_eng": 40,
                  "scbench_choice_eng": 40}  # fmt: skip
SUBSETS = tuple(MAX_NEW_TOKENS)
DELIMITER = "[SEPSEPSEP]"  # create_scdq_prompt's special_delimiter


class SCBenchTask(SubsetsTask):
    """``task=scbench``: each row's turns as samples of one context, tokenized as ``create_scdq_prompt``."""

    title = "SCBench"
    name = "scbench"
    new_tokens = MAX_NEW_TOKENS

    table = TableLayout(title="SCBench", order=SUBSETS)
    hub_repo = HUB_REPO
    hub_path = "data/{subset}.jsonl"
    domains = subset_domains(SUBSETS, HUB_REPO, "context")

    def how_to_provide(self) -> str:
        folder = "set task.data_dir=FOLDER (or KVBENCH_SCBENCH_DIR)"
        return f"download data/<subset>.jsonl of {HUB_REPO} into a folder and {folder}"

    def samples(self) -> Iterator[Sample]:
        """Each row's turns in order (rows in file order, the first ``num_samples`` of each subset)."""
        for subset in self.subsets:
            for index, row in enumerate(self.subset_rows(subset)):
                row_id = row.get("id", index)
                queries = [self.query_ids(subset, turn) for turn in row["multi_turns"]]
                limit = self.max_length(MAX_NEW_TOKENS[subset])
                if self.cut_limit() is None:  # the default: the longest turn and its answer fit the window
                    limit -= max(map(len, queries), default=0)
                context = self.context_ids(subset, str(row.get("context", row.get("input", ""))), limit)
                for turn_index, (turn, query) in enumerate(zip(row["multi_turns"], queries)):
                    yield Sample(
                        id=f"{subset}-{row_id}-{turn_index}",
                        subtask=subset,
                        input_ids=context + query,
                        answers=labels(subset, turn),
                        max_new_tokens=MAX_NEW_TOKENS[subset],
                        question_start=len(context) if self.agnostic else None,
                        context_id=f"{subset}-{row_id}",
                    )

    def context_ids(self, subset: str, context: str, limit: int) -> list[int]:
        """The context prompt's ids (special tokens added), cut to ``limit`` as ``truncate_input`` ("middle")."""
        text = CONTEXT_TEMPLATES[subset].format(context=context)
        if self.template == "hf_chat":
            text = self.chat([{"role": "user", "content": text + DELIMITER}]).split(DELIMITER)[0]
        ids = list(self.model.tokenizer(text, verbose=False)["input_ids"])
        return middle_cut(ids, limit)

    def query_ids(self, subset: str, turn: dict[str, Any]) -> list[int]:
        """A turn's query ids (no special tokens added): in the chat template, a user turn after an empty system turn,
        from the delimiter on."""
        options = {f"OPTION_{letter}": option for letter, option in zip("ABCD", turn.get("options") or [])}
        text = QUERY_TEMPLATES[subset].format(input=turn["input"], **options)
        if self.template == "hf_chat":
            messages = [{"role": "system", "content": ""}, {"role": "user", "content": DELIMITER + text}]
            text = self.chat(messages).split(DELIMITER)[1]
        return list(self.model.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def chat(self, messages: list[dict[str, str]]) -> str:
        return str(self.model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    def score(self, sample: Sample, prediction: str) -> float:
        """The subset's scorer (``compute_scores.py``), 0-1."""
        return SCORERS[sample.subtask](prediction, sample.answers)


def labels(subset: str, turn: dict[str, Any]) -> list[str]:
    """``get_ground_truth``: a choice's option text and letter, else the answer (a list kept as it is)."""
    answer = turn["answer"]
    if subset == "scbench_choice_eng":
        return [str(answer), "ABCD"[list(turn["options"]).index(answer)]]
    return [str(item) for item in answer] if isinstance(answer, list) else [str(answer)]
