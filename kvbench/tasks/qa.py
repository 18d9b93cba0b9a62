"""Questions over contexts from any table of rows (``task=qa``): kvpress's dataset format, so that a new dataset in
that shape runs with no code.

A row holds ``context``, ``question`` and ``answer`` (a string, or a list of the accepted strings), and may hold
``answer_prefix`` (written after the generation prompt), ``max_new_tokens`` and ``id``; ``task.columns`` maps these
names to a table's own. Rows come from ``task.path`` (jsonl, json or parquet) or a hub dataset (``task.hub``,
``task.hub_config``, ``task.split``) through ``datasets``.

The prompt is ``task.prompt`` filled with the row (default ``{context}{question}``, kvpress's: the question
right after the context, in one user turn) in ``task.prompt_format`` (the model's chat template, or the raw text with
the tokenizer's BOS, as kvpress without a chat template), then the row's ``answer_prefix``. A prompt longer than
``task.max_length`` tokens (default: the model's window less the row's answer) is cut in the middle as LongBench's
``pred.py`` cuts it. The context/question boundary is where the prompt's text after ``{context}`` begins, so
``task.query_mode=agnostic`` compresses each context alone, once for all the rows that ask about it (rows with
identical contexts share a ``context_id``). Each dataset names its metric (``task.metric``,
:mod:`kvbench.metrics.qa`).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

from kvbench import resolve_path
from kvbench.domains import PATH, SAMPLES, TEXT, Domain, choice, integer, mapping, name_list, optional
from kvbench.errors import KVBenchError
from kvbench.hub import check_hub_file, hub_file, hub_online, hub_rows
from kvbench.metrics.qa import METRICS, qa_score
from kvbench.tasks.base import ModelInfo, Sample, TableLayout, Task, context_id, contexts_together
from kvbench.tasks.prompts import after_context

#: the row fields (kvpress's column names) a table must have, then those it may have
REQUIRED = ("context", "question", "answer")
OPTIONAL = ("answer_prefix", "max_new_tokens", "id")
SUFFIXES = (".jsonl", ".json", ".parquet")


def jsonl_rows(path: Path, text: str) -> list[Any]:
    """The objects of a jsonl file's lines (blank ones skipped), a malformed one named by its line in the file."""
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 is text in a row
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                where = f"column {error.colno}" if error.lineno == 1 else f"line {error.lineno} of it"
                raise KVBenchError(f"{path} is not valid jsonl ({error.msg}, line {number}, {where})") from None
    return rows


PROMPT_FORMATS = ("hf_chat", "raw")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a jsonl file (an object a line), a json file (a list of objects) or a parquet file."""
    if path.suffix == ".parquet":
        import pandas

        return list(pandas.read_parquet(path).to_dict("records"))
    if path.suffix not in SUFFIXES:
        raise KVBenchError(f"task.path {path} is not a table; valid suffixes: {', '.join(SUFFIXES)}")
    text = path.read_text(encoding="utf-8")
    try:
        rows = json.loads(text) if path.suffix == ".json" else jsonl_rows(path, text)
    except json.JSONDecodeError as error:
        raise KVBenchError(f"{path} is not valid {path.suffix[1:]} ({error.msg}, line {error.lineno})") from None
    if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
        raise KVBenchError(f"{path} must hold one object per row (a list of objects in a .json file)")
    return rows


def answers_of(value: Any) -> list[str]:
    """A row's accepted answers: a string or a number (its text), or a list (or array) of them."""
    if isinstance(value, (str, int, float)):
        return [str(value)]
    try:
        return [str(answer) for answer in value]
    except TypeError:
        raise KVBenchError(f"a row's answer {value!r} is not text, a number or a list of them") from None


class QATask(Task):
    """Options: ``path`` or ``hub`` (``hub_config``, ``split``), ``columns``, ``subtask_column``, ``dataset``,
    ``prompt``, ``prompt_format``, ``metric``, ``max_new_tokens``, ``max_length``, ``num_samples``, ``query_mode``."""

    name = "qa"
    splits_prompts = True
    table = TableLayout(title="Question answering")
    domains = {
        "path": optional(PATH, "the hub dataset task.hub"),
        "hub": optional(TEXT, "task.path"),
        "hub_config": optional(TEXT, "the dataset's default configuration"),
        "split": TEXT,
        "columns": mapping(
            f"a mapping of row fields ({', '.join(REQUIRED + OPTIONAL)}) to column names",
            lambda key, value: key in REQUIRED + OPTIONAL and isinstance(value, str),
        ),
        "subtask_column": optional(TEXT, "every row in the dataset's own subtask"),
        "dataset": optional(TEXT, "the file's stem or the hub dataset's name"),
        "prompt": Domain(
            "a text with {context} before {question}",
            lambda value: isinstance(value, str) and 0 <= value.find("{context}") < value.find("{question}"),
        ),
        "prompt_format": choice(*PROMPT_FORMATS),
        "metric": choice(*METRICS),
        "max_new_tokens": integer(1, "a token count"),
        "max_length": optional(integer(2, "a token count"), "the model's window less the row's answer"),
        "num_samples": optional(SAMPLES, "every row"),
    }

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        super().__init__(settings, model)
        settings = self.settings  # read once, plain values
        self.path = None if settings.get("path") is None else resolve_path(settings.path)
        if self.path is None and settings.get("hub") is None:
            raise KVBenchError("task=qa reads rows from task.path=FILE (jsonl, json, parquet) or task.hub=DATASET_ID")
        if self.path is not None and not self.path.is_file():
            raise KVBenchError(f"task.path {self.path} is not a file; set task.path=FILE (jsonl, json or parquet)")
        self.columns = {field: str(settings.columns.get(field, field)) for field in REQUIRED + OPTIONAL}
        self.template = model.template(settings.prompt_format, PROMPT_FORMATS)
        self.agnostic = settings.get("query_mode") == "agnostic"

    @property
    def dataset(self) -> str:
        """The dataset's name: ``task.dataset``, else the file's stem or the hub dataset's last part."""
        return str(
            self.settings.get("dataset") or (self.path.stem if self.path else str(self.settings.hub).split("/")[-1])
        )

    def how_to_provide(self) -> str:
        """The end of the one-line error where the rows are neither here nor downloadable."""
        return "save its rows as jsonl or parquet and set task.path=FILE (or KVBENCH_QA_PATH)"

    def check_data(self) -> None:
        """The hub reachable when the rows come from it (the constructor checked ``task.path``)."""
        if self.path is None and not hub_online():
            raise KVBenchError(
                f"the hub dataset {self.settings.hub} ({self.settings.split} split) is not here and the hub is "
                "unreachable; "
                f"{self.how_to_provide()}"
            )

    def rows(self) -> Iterator[dict[str, Any]]:
        """The table's rows in order, read from ``path`` or streamed from the hub."""
        if self.path is not None:
            yield from read_rows(self.path)
        else:
            settings = self.settings
            yield from hub_rows(
                str(settings.hub), str(settings.split), self.how_to_provide(), settings.get("hub_config")
            )

    def records(self) -> list[dict[str, Any]]:
        """The first ``num_samples`` rows in kvpress's field names, each checked for the required ones."""
        limit, records = self.settings.get("num_samples"), []
        for index, row in enumerate(self.rows()):
            if limit is not None and index >= int(limit):
                break
            missing = [field for field in REQUIRED if self.columns[field] not in row]
            if missing:
                column = self.columns[missing[0]]
                raise KVBenchError(
                    f"row {index} of {self.dataset} has no column {column!r} (columns: {', '.join(map(str, row))}); "
                    f"name the one that holds the {missing[0]} with task.columns.{missing[0]}=COLUMN"
                )
            record = {**row, **{field: row[column] for field, column in self.columns.items() if column in row}}
            subtask = self.settings.get("subtask_column")
            record["subtask"] = str(row[subtask]) if subtask else self.dataset
            record.setdefault("id", f"{record['subtask']}-{index}")
            records.append(record)
        return records

    def samples(self) -> Iterator[Sample]:
        """The rows in order; in ``query_mode=agnostic`` the rows of one context follow one another (contexts in the
        order they first appear), to be answered from one compression."""
        records = self.records()
        repeats = Counter(record["context"] for record in records)  # no context (a math problem's) is not shared
        samples = [
            self.sample(record, bool(record["context"]) and repeats[record["context"]] > 1) for record in records
        ]
        return iter(contexts_together(samples) if self.agnostic else samples)

    def sample(self, record: dict[str, Any], shared_context: bool) -> Sample:
        """The engine's sample for one row (``shared_context``: other rows ask about the same context)."""
        new_tokens = int(record.get("max_new_tokens") or self.settings.max_new_tokens)
        prefix = str(record.get("answer_prefix") or "")
        if self.kvpress_rows:
            ids, context_end = self.kvpress_ids(record, prefix, new_tokens)
            question_start: int | None = context_end if self.agnostic else None
            return self.made_sample(record, ids, new_tokens, question_start, shared_context)

        def prompt(limit: int) -> tuple[list[int], int | None]:
            text = self.prompt_text(record, limit)
            messages = self.messages(text)
            if self.agnostic:
                question = after_context(self.prompt_of(record), **self.fields(record))
                return self.model.prompt_split(self.template, text, question, prefix, messages)
            return self.model.prompt_ids(self.template, text, prefix, messages), None

        limit = self.max_length(new_tokens)
        if self.cut_limit() is None:  # the default: what the model sees and the answer fit its window
            ids, question_start = self.fitted(prompt, lambda built: len(built[0]), limit, new_tokens)
        else:
            ids, question_start = prompt(limit)
        return self.made_sample(record, ids, new_tokens, question_start, shared_context)

    def kvpress_ids(self, record: dict[str, Any], answer_prefix: str, new_tokens: int) -> tuple[list[int], int]:
        """A row's ids as kvpress's ``KVPressTextGenerationPipeline.preprocess`` makes them (pipeline.py at 8bb29b9),
        and where its context ends: the context (the prompt's text before its question) in a user turn of the chat
        template, split off at a separator (no chat template, ``raw``: the BOS text before it and a newline after the
        question), and the question with the template's suffix and the answer prefix, each tokenized alone and
        joined; the context's ids kept to their first ``task.max_length`` (kvpress's ``max_context_length``; null:
        what leaves the question and the answer room in the window)."""
        text = self.prompt_of(record).format(**self.fields(record))
        question = after_context(self.prompt_of(record), **self.fields(record))
        context = text[: len(text) - len(question)]
        tokenizer = self.model.tokenizer
        if self.template == "hf_chat":
            separator = "#" * (len(context) + 10)
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": context + separator}], add_generation_prompt=True, tokenize=False
            )
            context, suffix = chat.split(separator)
        else:
            context, suffix = (getattr(tokenizer, "bos_token", None) or "") + context, "\n"
        question_ids = self.model.encode(question + suffix + answer_prefix)
        context_ids = self.model.encode(context)
        limit = self.cut_limit()
        if limit is None:
            limit = self.model.context_window - len(question_ids) - new_tokens
        context_ids = context_ids[: max(limit, 0)]
        return context_ids + question_ids, len(context_ids)

    def made_sample(
        self,
        record: dict[str, Any],
        ids: list[int],
        new_tokens: int,
        question_start: int | None,
        shared_context: bool,
    ) -> Sample:
        """The engine's sample of a row whose prompt is ``ids``."""
        return Sample(
            id=str(record["id"]),
            subtask=record["subtask"],
            input_ids=ids,
            answers=answers_of(record["answer"]),
            max_new_tokens=new_tokens,
            question_start=question_start,
            context_id=context_id(record["subtask"], str(record["context"])) if shared_context else None,
            metadata={key: record[key] for key in self.record_fields if key in record},
        )

    def prompt_of(self, record: dict[str, Any]) -> str:
        """The template of the row's user turn (``task.prompt``): ``{context}`` first, then ``{question}``."""
        return str(self.settings.prompt)

    def messages(self, text: str) -> list[dict[str, str]] | None:
        """The chat turns of a prompt ``text`` (None: ``text`` as the one user turn)."""
        return None

    #: row fields a record keeps beside the prediction and score (:meth:`evaluate`)
    record_fields: tuple[str, ...] = ()
    #: rows built as kvpress builds them (:meth:`kvpress_ids`: ``task=qa``); a benchmark's own task (a subclass) builds
    #: its prompt as its code does: the whole prompt cut in the middle, then templated
    kvpress_rows: bool = True
    #: a long prompt's halves decoded as one (:meth:`ModelInfo.cut_halves`), else each alone as LongBench's ``pred.py``
    joined_cut: bool = False
    #: with :attr:`joined_cut`, an odd cut length's extra token kept at the tail (:func:`.base.middle_cut`)
    odd_to_tail: bool = False

    def fields(self, record: dict[str, Any]) -> dict[str, Any]:
        """What :attr:`prompt` is filled with: the row's fields, under kvpress's names too."""
        return record

    def prompt_text(self, record: dict[str, Any], limit: int) -> str:
        """The row's template filled with it, cut in the middle to ``limit`` tokens (:attr:`joined_cut`)."""
        text = self.prompt_of(record).format(**self.fields(record))
        if self.joined_cut:
            return self.model.cut_halves(text, limit, self.odd_to_tail)
        return self.model.cut_middle(text, limit)

    def max_length(self, new_tokens: int) -> int:
        """The prompt's token limit: ``task.max_length``, else the model's window less the answer's tokens (and,
        in :meth:`sample`, less the template's tokens: :meth:`Task.fitted`)."""
        limit = self.cut_limit()
        return self.model.context_window - new_tokens if limit is None else limit

    def answer_tokens(self) -> int:
        """The most tokens a row may generate (``task.max_new_tokens``; a row's own column aside)."""
        return int(self.settings.max_new_tokens)

    def cut_limit(self) -> int | None:
        limit = self.settings.get("max_length")
        return None if limit is None else int(limit)

    def evaluate(self, sample: Sample, output: Any) -> dict[str, Any]:
        """Prediction and score, and the row's :attr:`record_fields`."""
        return {**super().evaluate(sample, output), **sample.metadata}

    def score(self, sample: Sample, prediction: str) -> float:
        """The dataset's metric (``task.metric``), 0-1."""
        return qa_score(self.settings.metric, prediction, sample.answers)


def subset_domains(subsets: tuple[str, ...], hub_repo: str, counted: str) -> dict[str, Domain]:
    """The settings every :class:`SubsetsTask` has: ``subtasks``, ``data_dir``, ``prompt_format``, ``max_length`` and
    ``num_samples`` (the first ``counted`` of each subset)."""
    return {
        "subtasks": name_list(subsets),
        "data_dir": optional(PATH, f"the hub dataset {hub_repo}"),
        "prompt_format": choice(*PROMPT_FORMATS),
        "max_length": optional(integer(2, "a token count"), "the model's window less the subset's answer"),
        "num_samples": optional(SAMPLES, f"every {counted}"),
    }


class SubsetsTask(QATask):
    """A named dataset on :class:`QATask` whose subsets (``task.subtasks``) are ``<subset>.jsonl`` files of a folder
    (``task.data_dir``) or of the hub, rather than one table at ``task.path`` or ``task.hub``."""

    #: the dataset's name in errors
    title: str = ""
    hub_repo: str = ""
    #: a subset's file in the hub repository (``{subset}`` filled), or "" where the subsets stream through ``datasets``
    hub_path: str = ""

    kvpress_rows = False
    #: each subset's generation length (the dataset's own table)
    new_tokens: ClassVar[Mapping[str, int]] = {}

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        Task.__init__(self, settings, model)
        settings = self.settings  # read once, plain values
        names = settings.subtasks
        self.subsets = [names] if isinstance(names, str) else list(names)
        self.data_dir = None if settings.get("data_dir") is None else resolve_path(settings.data_dir)
        self.template = model.template(settings.prompt_format, PROMPT_FORMATS)
        self.agnostic = settings.get("query_mode") == "agnostic"

    def answer_tokens(self) -> int:
        """The most tokens a subset of the task generates (:attr:`new_tokens`)."""
        return max(self.new_tokens[subset] for subset in self.subsets)

    def local_file(self, subset: str) -> Path:
        """``<data_dir>/<subset>.jsonl``, or a one-line error saying how to provide it."""
        assert self.data_dir is not None
        path = self.data_dir / f"{subset}.jsonl"
        if not path.is_file():
            raise KVBenchError(f"{self.title} subset {subset!r} not found: expected {path}; {self.how_to_provide()}")
        return path

    def check_data(self) -> None:
        """Each subset's file in ``data_dir``, or cached or downloadable from the hub (the hub reachable where the
        subsets stream)."""
        for subset in self.subsets:
            if self.data_dir is not None:
                self.local_file(subset)
            elif self.hub_path:
                check_hub_file(self.hub_repo, self.hub_path.format(subset=subset), self.how_to_provide())
            elif not hub_online():
                raise KVBenchError(f"the hub dataset {self.hub_repo} is unreachable; {self.how_to_provide()}")

    def subset_rows(self, subset: str) -> list[dict[str, Any]]:
        """The subset's first ``num_samples`` rows, from ``data_dir`` or the hub's file (cached or downloaded)."""
        if self.data_dir is not None:
            rows = read_rows(self.local_file(subset))
        else:
            rows = read_rows(hub_file(self.hub_repo, self.hub_path.format(subset=subset), self.how_to_provide()))
        return rows[: self.limit]

    @property
    def limit(self) -> int | None:
        """``task.num_samples``: the rows (contexts, documents) taken of each subset; None: all."""
        limit = self.settings.get("num_samples")
        return None if limit is None else int(limit)
