"""LongBench v1 and LongBench-E (Bai et al., 2023), built and scored as THUDM's ``pred.py``/``eval.py``.

Prompts: the official per-dataset template (``config/dataset2prompt.json``) filled with the record,
tokenized with the tokenizer's special tokens (as ``pred.py`` measures it) and, when longer than
``max_length`` tokens, cut in the middle as ``pred.py`` does: the first and the last ``max_length // 2``
tokens are decoded separately (special tokens skipped), joined as text and tokenized again, which can
merge or split a token at the cut. The prompt format (``task.prompt_format``, :mod:`kvbench.tasks.prompts`)
then wraps the (cut) text, so a template's tokens come on top of ``max_length``:

* ``longbench_official``: ``pred.py``'s ``build_chat`` (Llama-2 chat ``[INST]{prompt}[/INST]``, the raw
  prompt for Llama-3, Mistral and Qwen, which it does not know), not on trec, triviaqa, samsum, lsht,
  lcc and repobench-p ("chat models are better off without build prompts on these tasks");
* ``kvcache_factory``: KVCache-Factory's ``run_longbench.py`` as the papers ran it (up to ``ffac160``):
  the raw prompt but where ``"llama2"`` is in the model's id (never in Hugging Face's Llama-2 ids);
* ``cake``: CAKE's ``pred_cake.py`` (Llama-3 header, ``[INST]{prompt}[/INST]`` for Llama-2,
  ``<s>[INST] {prompt} [/INST]`` for Mistral, the chat template for Qwen), skipping the same datasets;
* ``hf_chat``: the tokenizer's chat template, skipping the same datasets; ``raw``: the raw prompt.

Truncation length ``max_length`` (null: :data:`MAX_LENGTH` by ``model.hf_id``, else the model's context
window less the dataset's generation length). Generation: greedy, up to the official ``dataset2maxlen``
new tokens. Scores: :func:`kvbench.metrics.longbench.score_sample`.

samsum: ``pred.py`` passes ``eos_token_id=[tokenizer.eos_token_id, tokenizer.encode("\\n",
add_special_tokens=False)[-1]]`` (models otherwise go on with another "Dialogue:" example) and
``min_length=context_length + 1``, so generation stops at that newline token, which can never be
the first new token. Here samsum samples carry ``stop_strings = ["\\n"]``, which
``kvbench.run`` turns into the same extra stop token, and ``min_new_tokens = 1`` on the datasets of
``task.min_length_datasets`` (``[samsum]`` as ``pred.py``; ``all`` as KVCache-Factory, which passes
``min_length`` on every dataset).

Data: ``data_dir`` holds the official jsonl files (``<dataset>.jsonl``, LongBench-E
``<dataset>_e.jsonl``); without it they are read from ``data.zip`` of the hub dataset
``THUDM/LongBench``, downloaded once into the Hugging Face cache (the hub copy is a loading script
plus that archive, which ``datasets`` >= 4 no longer runs).
"""

from __future__ import annotations

import json
import random
import zipfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

from kvbench import resolve_path
from kvbench.domains import FLAG, PATH, SAMPLES, SEED, Domain, choice, integer, name_list, one_of, optional
from kvbench.errors import KVBenchError, choose
from kvbench.hub import check_hub_file, hub_file
from kvbench.metrics.longbench import length_bucket, score_sample
from kvbench.tasks.base import ModelInfo, Sample, TableLayout, Task, context_id, contexts_together
from kvbench.tasks.longbench_prompts import PROMPTS
from kvbench.tasks.prompts import after_context

HUB_REPO = "THUDM/LongBench"
HUB_ARCHIVE = "data.zip"
HUB_MEMBER_DIR = "data/"
HOW_TO_PROVIDE = (
    f"unzip data/*.jsonl of {HUB_ARCHIVE} into a folder and set task.data_dir=FOLDER (or KVBENCH_LONGBENCH_DIR)"
)

# The official generation lengths (config/dataset2maxlen.json).
MAX_NEW_TOKENS = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}  # fmt: skip

DATASETS = tuple(PROMPTS)
E_DATASETS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
# Datasets prompted without the chat template ("chat models are better off without" it, pred.py).
NO_CHAT_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
PROMPT_FORMATS = ("longbench_official", "kvcache_factory", "cake", "hf_chat", "raw")
SKIPS_NO_CHAT = frozenset({"longbench_official", "cake", "hf_chat"})  # formats that send NO_CHAT_DATASETS raw

MAX_LENGTH = {
    # LongBench config/model2maxlen.json ("llama2-7b-chat-4k"); CAKE's model2maxlen.json agrees.
    "meta-llama/Llama-2-7b-chat-hf": 3500,
    # KVCache-Factory run_longbench.py model2maxlen ("llama3"/"llama-3", matched in the model path), the
    # pipeline of CaliDrop's Llama-3 numbers; 7500 since its commit 485af3c (2026-06).
    "meta-llama/Meta-Llama-3-8B-Instruct": 7950,
    "meta-llama/Meta-Llama-3-70B-Instruct": 7950,
    # CAKE experiments/LongBench/config/model2maxlen.json ("llama3.1-8b-128k"), the pipeline of SLAKE.
    "meta-llama/Llama-3.1-8B-Instruct": 127500,
    # KVCache-Factory model2maxlen ("mistral"), CaliDrop's Mistral numbers.
    "mistralai/Mistral-7B-Instruct-v0.2": 31500,
    # CAKE model2maxlen ("mistral-0.3-7b-32k"), SLAKE's Mistral numbers.
    "mistralai/Mistral-7B-Instruct-v0.3": 31500,
    # CAKE model2maxlen ("qwen2.5-7b-instruct").
    "Qwen/Qwen2.5-7B-Instruct": 31500,
}
"""``task.max_length: null`` by ``model.hf_id``: the official value where LongBench has the model, else the
value of the reference pipeline that ran it. Other models: the context window less the generation length."""
RECORD_FIELDS = ("input", "context", "answers", "length", "all_classes", "_id")


def drawn(population: int, count: int, seed: int) -> list[int]:
    """``count`` distinct indices below ``population``, drawn one by one with ``random.Random(seed)`` (an index drawn
    again is drawn anew): a larger draw begins with a smaller one, so a run grown to more samples keeps the ones it
    has. These are ``Random(seed).sample``'s indices wherever it draws this way (``population`` larger than
    ``21 + 4**ceil(log4(3·count))``, e.g. up to 16 of LongBench's 200 records)."""
    rng, chosen = random.Random(seed), dict[int, None]()  # a dict keeps the draws' order
    while len(chosen) < count:
        chosen[rng.randrange(population)] = None
    return list(chosen)


LONGBENCH_CATEGORIES = {
    "Single-Doc QA": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "Multi-Doc QA": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "Summarization": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "Few-shot": ("trec", "triviaqa", "samsum", "lsht"),
    "Synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "Code": ("lcc", "repobench-p"),
}
"""LongBench's six task categories (Bai et al., 2023, Table 1), in the order the papers print them."""

LONGBENCH_SHORT = {
    "narrativeqa": "NrtvQA",
    "qasper": "Qasper",
    "multifieldqa_en": "MF-en",
    "multifieldqa_zh": "MF-zh",
    "hotpotqa": "HotpotQA",
    "2wikimqa": "2WikiMQA",
    "musique": "Musique",
    "dureader": "DuReader",
    "gov_report": "GovReport",
    "qmsum": "QMSum",
    "multi_news": "MultiNews",
    "vcsum": "VCSUM",
    "trec": "TREC",
    "triviaqa": "TriviaQA",
    "samsum": "SAMSum",
    "lsht": "LSHT",
    "passage_count": "PCount",
    "passage_retrieval_en": "PRe",
    "passage_retrieval_zh": "PRe-zh",
    "lcc": "Lcc",
    "repobench-p": "RB-P",
}
"""The column headers the papers use for LongBench datasets."""


class LongBenchTask(Task):
    """Options: ``datasets`` (or its alias ``subtasks``), ``data_dir``, ``num_samples`` per dataset
    (a seeded random subset, kept in file order), ``prompt_format``, ``max_length`` (prompt tokens; null =
    :data:`MAX_LENGTH`), ``min_length_datasets``, ``seed``, and ``e`` (LongBench-E: ``*_e`` files, scores
    per length bucket)."""

    name = "longbench"
    splits_prompts = True
    context_setting = "max_length"
    table = TableLayout(
        title="LongBench",
        order=tuple(dataset for members in LONGBENCH_CATEGORIES.values() for dataset in members),
        headers=LONGBENCH_SHORT,
        categories=LONGBENCH_CATEGORIES,
    )
    domains = {
        "datasets": name_list(DATASETS),
        "subtasks": optional(name_list(DATASETS), "task.datasets"),
        "data_dir": optional(PATH, "data.zip of THUDM/LongBench from the hub"),
        "num_samples": optional(SAMPLES, "every record"),
        "prompt_format": choice(*PROMPT_FORMATS),
        "max_length": optional(integer(2, "a token count"), "the model's entry of MAX_LENGTH, else its window"),
        "min_length_datasets": one_of(
            choice("all"),
            Domain(
                "a list of dataset names",
                lambda value: isinstance(value, list) and all(name in DATASETS for name in value),
            ),
        ),
        "seed": SEED,
        "e": FLAG,
    }

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        super().__init__(settings, model)
        settings = self.settings  # read once, plain values
        self.e = bool(settings.get("e", False))
        names = settings.get("subtasks") or settings.datasets
        self.datasets = [names] if isinstance(names, str) else list(names)
        for dataset in self.datasets if self.e else ():  # LongBench's names are the setting's domain; -E has fewer
            choose("LongBench-E dataset", dataset, E_DATASETS)
        self.prompt_format = settings.prompt_format
        self.format_template = model.template(self.prompt_format, PROMPT_FORMATS)
        self.fixed_max_length = None if settings.get("max_length") is None else int(settings.max_length)
        self.num_samples = None if settings.get("num_samples") is None else int(settings.num_samples)
        self.min_length_datasets = _dataset_set(settings.min_length_datasets)
        self.seed = int(settings.get("seed", 42))
        self.agnostic = settings.get("query_mode") == "agnostic"

    @classmethod
    def for_model(cls, settings: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
        """``max_length: null`` becomes the model's entry of :data:`MAX_LENGTH` where it has one (the models
        of the official table and of the papers); otherwise it stays per dataset (the window less its answer)."""
        if settings.get("max_length") is None and model.get("hf_id") in MAX_LENGTH:
            return {**settings, "max_length": MAX_LENGTH[model["hf_id"]]}
        return settings

    def cut_limit(self) -> int | None:
        return self.fixed_max_length

    def answer_tokens(self) -> int:
        return max(MAX_NEW_TOKENS[dataset] for dataset in self.datasets)

    def max_length(self, dataset: str) -> int:
        """Prompt tokens kept for ``dataset``: ``task.max_length``, else :data:`MAX_LENGTH`, else the context
        window less the dataset's generation length."""
        if self.fixed_max_length is not None:
            return self.fixed_max_length
        return MAX_LENGTH.get(self.model.hf_id or "", self.model.context_window - MAX_NEW_TOKENS[dataset])

    def samples(self) -> Iterator[Sample]:
        """Each dataset's (selected: :func:`drawn`) records in file order, datasets in the configured order. Records
        whose contexts are identical in the file carry one ``context_id``; in ``query_mode=agnostic`` they follow one
        another (each context's questions in file order, contexts in the order they first appear), to be answered
        from one compression."""
        for dataset in self.datasets:
            records = self.records(dataset)
            repeats = Counter(record["context"] for record in records)  # over the file: a sample's id is its own
            if self.num_samples is not None and self.num_samples < len(records):
                records = [records[index] for index in sorted(drawn(len(records), self.num_samples, self.seed))]
            samples = [
                self.sample(
                    dataset, record, context_id(dataset, record["context"]) if repeats[record["context"]] > 1 else None
                )
                for record in records
            ]
            yield from contexts_together(samples) if self.agnostic else samples

    def check_data(self) -> None:
        """Each dataset's file in ``data_dir``, or the hub archive cached or downloadable."""
        if self.settings.get("data_dir") is not None:
            for dataset in self.datasets:
                self.local_file(dataset)
        else:
            check_hub_file(HUB_REPO, HUB_ARCHIVE, HOW_TO_PROVIDE)

    def local_file(self, dataset: str) -> Path:
        """``<data_dir>/<dataset>[_e].jsonl``, or a one-line error saying how to provide it."""
        file_name = f"{dataset}_e.jsonl" if self.e else f"{dataset}.jsonl"
        path = resolve_path(self.settings.data_dir) / file_name
        if not path.is_file():
            raise KVBenchError(
                f"LongBench dataset {dataset!r} not found: expected {path}; download data.zip from "
                f"https://huggingface.co/datasets/{HUB_REPO} and unzip its data/*.jsonl into that folder, "
                "or set task.data_dir=DIR (null: download from the hub)"
            )
        return path

    def records(self, dataset: str) -> list[dict[str, Any]]:
        """The official records of one dataset, from ``data_dir`` or the hub archive."""
        if self.settings.get("data_dir") is None:
            return _hub_records(f"{dataset}_e.jsonl" if self.e else f"{dataset}.jsonl")
        path = self.local_file(dataset)
        with path.open(encoding="utf-8") as lines:
            return _parse_records(lines, str(path))

    def sample(self, dataset: str, record: dict[str, Any], context: str | None = None) -> Sample:
        """The engine's sample for one record (``context``: its ``context_id``); samsum carries ``stop_strings =
        ["\\n"]``, the datasets of ``min_length_datasets`` at least one new token; in ``query_mode=agnostic``, where
        its question starts (:meth:`split_prompt_ids`)."""

        def prompt(limit: int) -> tuple[list[int], int | None]:
            if self.agnostic:
                return self.split_prompt_ids(dataset, record, limit)
            return self.prompt_ids(dataset, record, limit), None

        limit, new_tokens = self.max_length(dataset), MAX_NEW_TOKENS[dataset]
        if self.fixed_max_length is None:  # the window's default: what the model sees and the answer fit it
            ids, question_start = self.fitted(prompt, lambda built: len(built[0]), limit, new_tokens)
        else:
            ids, question_start = prompt(limit)
        return Sample(
            id=record["_id"],
            subtask=dataset,
            input_ids=ids,
            answers=list(record["answers"]),
            max_new_tokens=MAX_NEW_TOKENS[dataset],
            min_new_tokens=int(dataset in self.min_length_datasets),
            stop_strings=["\n"] if dataset == "samsum" else [],
            metadata={"all_classes": record["all_classes"], "length": record["length"]},
            question_start=question_start,
            context_id=context,
        )

    def template(self, dataset: str) -> str:
        """The template of :mod:`kvbench.tasks.prompts` that prompts of ``dataset`` get."""
        if dataset in NO_CHAT_DATASETS and self.prompt_format in SKIPS_NO_CHAT:
            return "raw"
        return self.format_template

    def prompt(self, dataset: str, record: dict[str, Any], limit: int | None = None) -> str:
        """The official prompt text, cut in the middle to ``limit`` (default ``max_length``) tokens as ``pred.py``."""
        return self.model.cut_middle(PROMPTS[dataset].format(**record), limit or self.max_length(dataset))

    def prompt_ids(self, dataset: str, record: dict[str, Any], limit: int | None = None) -> list[int]:
        """:meth:`prompt` in the prompt format, as token ids."""
        return self.model.prompt_ids(self.template(dataset), self.prompt(dataset, record, limit))

    def split_prompt_ids(self, dataset: str, record: dict[str, Any], limit: int | None = None) -> tuple[list[int], int]:
        """:meth:`prompt_ids` and where the question starts in them: the dataset's template after ``{context}``
        (every LongBench template puts its question, if any, after the context; the summaries and code completion
        have only an instruction there)."""
        question = after_context(PROMPTS[dataset], **record)
        return self.model.prompt_split(self.template(dataset), self.prompt(dataset, record, limit), question)

    def score(self, sample: Sample, prediction: str) -> float:
        """The official metric of the sample's dataset, 0-1."""
        return score_sample(sample.subtask, prediction, sample.answers, sample.metadata["all_classes"])

    def evaluate(self, sample: Sample, output: Any) -> dict[str, Any]:
        """Prediction and score, plus the record's ``length`` (LongBench-E buckets need it)."""
        return {**super().evaluate(sample, output), "length": sample.metadata["length"]}

    def aggregate(self, records: list[dict]) -> dict[str, float]:
        """Dataset (LongBench-E: ``<dataset>@<bucket>``) -> mean score on 0-100, unrounded.

        The official ``eval.py`` rounds each of these to two decimals; LongBench-E buckets without
        records are left out (the official scorer reports NaN for them).
        """
        if not self.e:
            return super().aggregate(records)
        bucketed = [
            {**record, "subtask": f"{record['subtask']}@{length_bucket(record['length'])}"} for record in records
        ]
        return super().aggregate(bucketed)


def _dataset_set(value: Any) -> frozenset[str]:
    """A list of LongBench datasets, or ``all``, as a set."""
    if value == "all":
        return frozenset(DATASETS)
    return frozenset([value] if isinstance(value, str) else list(value or []))  # its domain: task.check


def _parse_records(lines: Iterable[str], source: str) -> list[dict[str, Any]]:
    """Records of an official jsonl file, or a one-line error naming the bad line."""
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise KVBenchError(
                f"{source}:{number} is not valid JSON ({error.msg}); expected official LongBench jsonl"
            ) from None
        missing = [name for name in RECORD_FIELDS if name not in record]
        if missing:
            raise KVBenchError(f"{source}:{number} lacks {', '.join(missing)}; expected official LongBench jsonl")
        records.append(record)
    return records


def _hub_records(file_name: str) -> list[dict[str, Any]]:
    """One jsonl file from the hub dataset's ``data.zip`` (cached by huggingface_hub)."""
    archive = hub_file(HUB_REPO, HUB_ARCHIVE, HOW_TO_PROVIDE)
    member = HUB_MEMBER_DIR + file_name
    try:
        with zipfile.ZipFile(archive) as zipped, zipped.open(member) as raw:
            return _parse_records((line.decode("utf-8") for line in raw), f"{archive}:{member}")
    except (KeyError, zipfile.BadZipFile) as error:
        raise KVBenchError(
            f"cannot read {member} from {archive} ({error}); set task.data_dir=FOLDER holding {file_name}"
        ) from None


class LongBenchETask(LongBenchTask):
    """LongBench-E (``task=longbench_e``, ``e: true``): LongBench's table with a row per length bucket."""

    name = "longbench_e"
    table = replace(cast(TableLayout, LongBenchTask.table), title="LongBench-E", categories={}, buckets=True)
