"""RULER's qa_1 / qa_2: SQuAD v2.0 dev and HotpotQA dev (distractor) read as RULER reads them, from ``task.qa_dir``
or the hub, and the generator that builds a question over distractor documents from them."""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from typing import Any

from kvbench import resolve_path
from kvbench.errors import KVBenchError
from kvbench.hub import hub_rows
from kvbench.metrics.ruler import string_match_part
from kvbench.tasks.prompts import after_context
from kvbench.tasks.ruler_generators import QA_ANSWER_PREFIX, QA_DOCUMENT, QA_TEMPLATE, Example, Generator, Haystack

QA_FILES = {"squad": ("squad.json", "dev-v2.0.json"), "hotpotqa": ("hotpotqa.json", "hotpot_dev_distractor_v1.json")}
QA_HUB = {"squad": ("rajpurkar/squad_v2", None), "hotpotqa": ("hotpotqa/hotpot_qa", "distractor")}
QA_SOURCE = {"squad": "SQuAD v2.0 dev", "hotpotqa": "HotpotQA dev (distractor)"}


def read_squad(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's ``read_squad``: answerable questions, the sorted unique paragraphs as documents, and per
    question the other paragraphs of its article (``more_context``)."""
    docs = sorted({paragraph["context"] for article in data["data"] for paragraph in article["paragraphs"]})
    index = {doc: i for i, doc in enumerate(docs)}
    qas = []
    for article in data["data"]:
        article_docs = [index[paragraph["context"]] for paragraph in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            own = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                if not qa.get("is_impossible", False):
                    qas.append(
                        {
                            "query": qa["question"],
                            "outputs": [answer["text"] for answer in qa["answers"]],
                            "context": [own],
                            "more_context": [doc for doc in article_docs if doc != own],
                        }
                    )
    return qas, docs


def read_hotpotqa(data: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's ``read_hotpotqa``: documents ``title\\nsentences``, sorted and unique; each question's
    own ten paragraphs (two gold, eight distractors) are its context."""
    docs = sorted({f"{title}\n{''.join(sentences)}" for record in data for title, sentences in record["context"]})
    index = {doc: i for i, doc in enumerate(docs)}
    qas = [
        {
            "query": record["question"],
            "outputs": [record["answer"]],
            "context": [index[f"{title}\n{''.join(sentences)}"] for title, sentences in record["context"]],
        }
        for record in data
    ]
    return qas, docs


def _squad_from_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The official SQuAD json layout rebuilt from ``rajpurkar/squad_v2`` rows (articles by title)."""
    articles: dict[str, dict[str, list]] = {}
    for row in rows:
        paragraphs = articles.setdefault(row["title"], {})
        paragraphs.setdefault(row["context"], []).append(
            {
                "question": row["question"],
                "answers": [{"text": text} for text in row["answers"]["text"]],
                "is_impossible": not row["answers"]["text"],
            }
        )
    return {
        "data": [
            {"title": title, "paragraphs": [{"context": context, "qas": qas} for context, qas in paragraphs.items()]}
            for title, paragraphs in articles.items()
        ]
    }


def _hotpot_from_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The official HotpotQA json layout rebuilt from ``hotpotqa/hotpot_qa`` rows."""
    return [
        {
            "question": row["question"],
            "answer": row["answer"],
            "context": [list(pair) for pair in zip(row["context"]["title"], row["context"]["sentences"])],
        }
        for row in rows
    ]


@functools.lru_cache(maxsize=4)
def qa_dataset(dataset: str, qa_dir: str | None) -> tuple[list[dict[str, Any]], list[str]]:
    """(questions, documents) of ``squad`` or ``hotpotqa`` from ``qa_dir`` or the hub, as RULER reads them."""
    names = QA_FILES[dataset]
    how = f"download {QA_SOURCE[dataset]} as {names[0]} (or {names[1]}) into a folder and set task.qa_dir=FOLDER"
    if qa_dir is not None:
        folder = resolve_path(qa_dir)
        path = next((folder / name for name in names if (folder / name).is_file()), None)
        if path is None:
            raise KVBenchError(
                f"RULER {dataset} data not found: no {names[0]} or {names[1]} in task.qa_dir={qa_dir}; {how}"
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise KVBenchError(f"cannot read {path} ({type(error).__name__}); {how}") from None
    else:
        repo, config = QA_HUB[dataset]
        rows = list(hub_rows(repo, "validation", f"RULER {dataset} needs {names[0]}: {how}", name=config))
        data = _squad_from_rows(rows) if dataset == "squad" else _hotpot_from_rows(rows)
    try:
        qas, docs = read_squad(data) if dataset == "squad" else read_hotpotqa(data)
    except (KeyError, TypeError, ValueError) as error:
        raise KVBenchError(f"RULER {dataset} data is not in the official layout (missing {error}); {how}") from None
    if not qas:
        raise KVBenchError(f"RULER {dataset} data has no answerable question; {how}")
    return qas, docs


@dataclass(frozen=True)
class QA(Generator):
    """Question answering over distractor documents: the gold paragraph(s) first, then (SQuAD) the other
    paragraphs of the article, then random documents, shuffled with the task seed; ``size`` documents."""

    dataset: str
    tokens_to_generate = 32
    needs_data = True  # below the question's own documents (min_size 0), only those are used

    def metric(self, prediction: str, answers: list[str]) -> float:
        """RULER's QA metric: any answer found."""
        return string_match_part(prediction, answers)

    def build(self, rng: random.Random, size: int, task: Haystack) -> Example:
        qas, docs = qa_dataset(self.dataset, task.settings.get("qa_dir"))
        qa = qas[rng.randrange(len(qas))]
        gold, more = list(qa["context"]), list(qa.get("more_context", []))
        if size < len(docs):
            if size - len(gold) > len(more):
                taken = set(gold + more)
                others = [doc for doc in range(len(docs)) if doc not in taken]
                chosen = gold + more + rng.sample(others, size - len(gold) - len(more))
            else:
                chosen = gold + rng.sample(more, max(size - len(gold), 0))
        else:
            chosen = list(range(len(docs)))
        texts = [docs[doc] for doc in chosen]
        random.Random(task.settings.get("seed", 42)).shuffle(texts)
        context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=text) for i, text in enumerate(texts))
        return Example(
            text=QA_TEMPLATE.format(context=context, query=qa["query"]),
            answer_prefix=QA_ANSWER_PREFIX,
            answers=list(qa["outputs"]),
            info={"num_docs": len(texts)},
            question=after_context(QA_TEMPLATE, query=qa["query"]),
        )
