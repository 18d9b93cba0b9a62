"""RULER synthetic tasks (Hsieh et al., 2024), generated per tokenizer to a target context length, or read
from the jsonl files RULER's own scripts write.

Each subtask is a spec (a small frozen dataclass) in :data:`SUBTASKS` that builds one example from
a random generator and a haystack *size* (noise paragraphs, essay words, distractor needles, list
words ...). :class:`RulerTask` finds, for every sample, the largest size whose prompt -- in the prompt
format, with RULER's answer prefix appended -- fits ``context_length`` less RULER's tokens to generate
for the task, by doubling then bisection on the real token count.

Official files (``task.data_dir``): ``<subtask>.jsonl`` as RULER's ``scripts/data/prepare.py`` writes
them (``index``, ``input``, ``outputs``, ``length``, and ``answer_prefix`` where the generator split it off
``input``), e.g. the files KVCache-Factory ships in ``data/RULER/<length>/``; they are run as they are, in
the prompt format, with their own answers. Scores: RULER's ``string_match_all`` (``string_match_part``
for qa), :mod:`kvbench.metrics.ruler`.

Prompt formats (``task.prompt_format``, :mod:`kvbench.tasks.prompts`): ``ruler_official`` -- RULER's
template for the model (``scripts/config_models.sh``: "meta-llama3" for Llama-3.1, "meta-chat" for
Llama-2 chat, "base" for the models it does not list) with the answer prefix after it, as
``call_api.py`` joins them; ``kvcache_factory`` -- KVCache-Factory's ``run_ruler.py``: the ``input``
alone (it never appends the answer prefix), raw with BOS; ``hf_chat``; ``raw``. KVCache-Factory also cuts
prompts longer than its ``model2maxlen`` in the middle as LongBench does: ``task.max_length`` (null: no cut,
as RULER).

Configurations, templates and answer prefixes follow RULER's ``scripts/synthetic.yaml`` and
``scripts/data/synthetic/constants.py``. Deliberate differences from RULER's generator scripts:

* randomness comes from one generator per (seed, subtask, index), so every sample is reproducible on
  its own (RULER re-uses one fixed shuffle seed for all samples);
* needle keys and values are distinct within a sample, and distractors never reuse them;
* essays are split into sentences by a regular expression (RULER uses NLTK's punkt, which needs a
  download);
* haystack lines (noise paragraphs, needles, vt assignments) are separated by newlines, and vt's
  worked example has a fixed 10 noise paragraphs (RULER sizes it to 500 tokens of the tokenizer);
* the single-answer wording fix (``Some`` -> ``A``, ``are`` -> ``is`` ...) touches only the task's
  own template, never the model's chat template;
* qa_1 / qa_2 draw their question at random (per seed and index) where RULER takes the questions in
  file order, and their distractor documents from that per-sample generator.

qa_1 (SQuAD v2.0 dev, answerable questions) and qa_2 (HotpotQA dev, distractor setting) read RULER's
``squad.json`` / ``hotpotqa.json`` (the official ``dev-v2.0.json`` / ``hotpot_dev_distractor_v1.json``
names work too) from ``task.qa_dir``, or, without it, the hub datasets ``rajpurkar/squad_v2`` and
``hotpotqa/hotpot_qa`` (validation split) through ``datasets``. They are not in the null default.
"""

from __future__ import annotations

import functools
import itertools
import json
import random
import re
import string
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig

from kvbench import resolve_path
from kvbench.domains import PATH, SAMPLES, SEED, TOKENS, choice, integer, mapping, name_list, one_of, optional
from kvbench.errors import KVBenchError, choose
from kvbench.hub import hub_online, hub_rows
from kvbench.metrics.ruler import string_match_all, string_match_part
from kvbench.tasks import prompts
from kvbench.tasks.base import ModelInfo, Sample, Task
from kvbench.tasks.prompts import after_context
from kvbench.tasks.resources import paul_graham_essays, wonderwords_list

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (  # "assgined" is RULER's spelling
    " Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assgined the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. {context}\n"
    "Question: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\n"
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"

DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER's essay depths: 40 evenly spaced percentages
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
VT_EXAMPLE_NOISE = 10  # noise paragraphs of the few-shot example (RULER fits it into 500 Llama tokens)


@dataclass
class Prompt:
    """One generated example before the model's chat template.

    ``shots`` are few-shot (user, assistant) turns placed before ``text``; ``answer_prefix`` is
    appended after the generation prompt, as RULER does for every model.
    """

    text: str
    answer_prefix: str
    answers: list[str]
    shots: list[tuple[str, str]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    #: the end of ``text`` after its context: what a query-agnostic run withholds from the compression
    question: str = ""


def _random_item(kind: str, rng: random.Random) -> str:
    """A random needle key or value: ``numbers`` (7 digits), ``uuids`` or ``words`` (adjective-noun)."""
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(wonderwords_list('adjectivelist'))}-{rng.choice(wonderwords_list('nounlist'))}"


def _unique(draw: Callable[[], str], used: set[str]) -> str:
    """``draw()`` until the result is not in ``used`` (which it then joins)."""
    while (item := draw()) in used:
        pass
    used.add(item)
    return item


def _unique_item(kind: str, rng: random.Random, used: set[str]) -> str:
    """A random needle key or value not in ``used`` (which it then joins)."""
    return _unique(lambda: _random_item(kind, rng), used)


def _random_name(rng: random.Random, alphabet: str, length: int) -> str:
    """A random string of ``length`` letters from ``alphabet`` (vt variable names, fwe coded words)."""
    return "".join(rng.choices(alphabet, k=length))


def _insert_lines(rng: random.Random, filler: list[str], items: list[str]) -> tuple[list[str], list[float]]:
    """Insert ``items`` in order at uniformly random line positions; returns the lines and their depths."""
    total = len(filler) + len(items)
    slots = sorted(rng.sample(range(total), len(items)))
    lines = list(filler)
    for slot, item in zip(slots, items):
        lines.insert(slot, item)
    return lines, [slot / max(total - 1, 1) for slot in slots]


def _join_keys(keys: list[str]) -> str:
    """``a``, ``a, and b``, ``a, b, and c`` ... (RULER's query wording)."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


class Generator:
    """What every RULER generator declares: RULER's tokens to generate, its metric and the smallest
    haystack size (class attributes: each kind of subtask has one of each)."""

    tokens_to_generate: ClassVar[int]
    needs_data: ClassVar[bool] = False  # a QA subtask: not in the null default of task.subtasks

    @property
    def min_size(self) -> int:
        """The smallest haystack size."""
        return 0

    def metric(self, prediction: str, answers: list[str]) -> float:
        """RULER's metric for this kind of subtask."""
        return string_match_all(prediction, answers)

    @property
    def questions(self) -> int:
        """How many different questions one haystack can be asked (``task.questions_per_context``)."""
        return 1

    def build(self, rng: random.Random, size: int, task: RulerTask) -> Prompt:
        """An example whose haystack has ``size`` units."""
        raise NotImplementedError

    def build_questions(self, rng: random.Random, size: int, task: RulerTask, count: int) -> list[Prompt]:
        """``count`` (at most :attr:`questions`) examples of one haystack of ``size`` units, each asking another
        question."""
        return [self.build(rng, size, task)]


@dataclass(frozen=True)
class Niah(Generator):
    """Needle in a haystack: ``haystack`` is ``noise`` (repeated sentences), ``essay`` or ``needle``
    (distractor needles); keys and values are ``words``, ``numbers`` or ``uuids``."""

    haystack: str
    key_type: str = "words"
    value_type: str = "numbers"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    tokens_to_generate = 128

    @property
    def questions(self) -> int:
        """The haystack's keys asked ``num_queries`` at a time (niah_multikey_1: 4 questions of one key)."""
        return max(self.num_keys, self.num_queries) // self.num_queries

    def build(self, rng: random.Random, size: int, task: RulerTask) -> Prompt:
        """An example whose haystack has ``size`` units (noise paragraphs, essay words or distractors)."""
        return self.build_questions(rng, size, task, 1)[0]

    def build_questions(self, rng: random.Random, size: int, task: RulerTask, count: int) -> list[Prompt]:
        """``count`` examples of one haystack, each asking about other keys of its needles (one example draws what
        :meth:`build` draws)."""
        num_keys = max(self.num_keys, self.num_queries)
        used: set[str] = set()
        keys = [_unique_item(self.key_type, rng, used) for _ in range(num_keys)]
        values = [[_unique_item(self.value_type, rng, used) for _ in range(self.num_values)] for _ in keys]
        needles = [
            NEEDLE.format(type_needle_v=self.value_type, key=key, value=value)
            for key, key_values in zip(keys, values)
            for value in key_values
        ]
        rng.shuffle(needles)
        queried = rng.sample(range(num_keys), self.num_queries * count)

        if self.haystack == "essay":
            context, depths = self._essay_context(rng, task.essay_words, size, needles)
        else:
            if self.haystack == "noise":
                filler = [NOISE] * size
            else:
                filler = [
                    NEEDLE.format(
                        type_needle_v=self.value_type,
                        key=_unique_item(self.key_type, rng, used),
                        value=_unique_item(self.value_type, rng, used),
                    )
                    for _ in range(size)
                ]
            lines, depths = _insert_lines(rng, filler, needles)
            context = "\n".join(lines)

        template, prefix, type_needle_v = NIAH_TEMPLATE, NIAH_ANSWER_PREFIX, self.value_type
        if self.num_queries * self.num_values == 1:  # RULER's singular wording
            for plural, singular in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                template, prefix = template.replace(plural, singular), prefix.replace(plural, singular)
            type_needle_v = type_needle_v[:-1]
        examples = []
        for begin in range(0, len(queried), self.num_queries):
            asked = queried[begin : begin + self.num_queries]
            query = _join_keys([keys[i] for i in asked])
            examples.append(
                Prompt(
                    text=template.format(type_needle_v=type_needle_v, context=context, query=query),
                    answer_prefix=prefix.format(type_needle_v=type_needle_v, query=query),
                    answers=[value for i in asked for value in values[i]],
                    info={"depths": depths},
                    question=after_context(template, type_needle_v=type_needle_v, query=query),
                )
            )
        return examples

    @staticmethod
    def _essay_context(rng: random.Random, words: list[str], size: int, needles: list[str]) -> tuple[str, list[float]]:
        """The first ``size`` essay words (repeated if needed), needles between sentences at RULER depths."""
        text = " ".join(itertools.islice(itertools.cycle(words), size))
        sentences = SENTENCE_END.split(text) if text else []
        depths = sorted(rng.sample(DEPTHS, len(needles)))
        parts, start = [], 0
        for depth, needle in zip(depths, needles):
            cut = len(sentences) * depth // 100
            parts += sentences[start:cut] + [needle]
            start = cut
        parts += sentences[start:]
        return " ".join(parts), [depth / 100 for depth in depths]


@dataclass(frozen=True)
class VariableTracking(Generator):
    """Multi-hop tracing: chains ``VAR B = VAR A`` hidden in noise; name every variable holding a value.

    Like RULER, the prompt starts with one worked example (3-letter names, fixed noise length).
    """

    num_chains: int = 1
    num_hops: int = 4
    tokens_to_generate = 30

    def build(self, rng: random.Random, size: int, task: RulerTask) -> Prompt:
        """An example with ``size`` noise paragraphs, preceded by the worked example."""
        example_text, example_prefix, example_answers, _ = self._example(
            rng, VT_EXAMPLE_NOISE, 3, min(10, self.num_hops)
        )
        text, prefix, answers, question = self._example(rng, size, 5, self.num_hops)
        shot = f"{example_text}{example_prefix}{' '.join(example_answers)}"
        return Prompt(text=f"{shot}\n\n{text}", answer_prefix=prefix, answers=answers, question=question)

    def _example(
        self, rng: random.Random, size: int, name_length: int, num_hops: int
    ) -> tuple[str, str, list[str], str]:
        """Task text, answer prefix, answer (the first chain's names) and question for ``size`` noise paragraphs."""
        used: set[str] = set()
        chains = [
            [_unique(lambda: _random_name(rng, string.ascii_uppercase, name_length), used) for _ in range(num_hops + 1)]
            for _ in range(self.num_chains)
        ]
        values = [_unique(lambda: str(rng.randint(10000, 99999)), used) for _ in chains]
        lines = [NOISE] * size
        for names, value in zip(chains, values):
            assignments = [f"VAR {names[0]} = {value}"]
            assignments += [f"VAR {later} = VAR {earlier}" for earlier, later in zip(names, names[1:])]
            lines, _ = _insert_lines(rng, lines, assignments)
        return (
            VT_TEMPLATE.format(context="\n".join(lines), query=values[0]),
            VT_ANSWER_PREFIX.format(num_v=num_hops + 1, query=values[0]),
            chains[0],
            after_context(VT_TEMPLATE, query=values[0]),
        )


@functools.lru_cache(maxsize=1)
def _cwe_vocabulary() -> list[str]:
    """wonderwords nouns, adjectives and verbs, de-duplicated and sorted (RULER's cwe vocabulary)."""
    return sorted(set(wonderwords_list("nounlist") + wonderwords_list("adjectivelist") + wonderwords_list("verblist")))


@dataclass(frozen=True)
class CommonWords(Generator):
    """Aggregation: a numbered word list where ``num_cw`` words repeat ``freq_cw`` times and the rest
    ``freq_ucw`` times; name the common ones. One worked example first, as RULER (a separate turn)."""

    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    tokens_to_generate = 120

    @property
    def min_size(self) -> int:
        """At least the common words themselves."""
        return self.num_cw

    def build(self, rng: random.Random, size: int, task: RulerTask) -> Prompt:
        """An example with ``size`` distinct words (capped by the vocabulary)."""
        vocabulary = _cwe_vocabulary()
        short = task.context_length < 4096  # RULER's lighter repetition for short contexts
        example, example_answers = self._listing(rng, vocabulary, 20 if short else 40, *((3, 1) if short else (10, 3)))
        context, answers = self._listing(
            rng, vocabulary, min(size, len(vocabulary)), *((6, 1) if short else (self.freq_cw, self.freq_ucw))
        )
        numbered = " ".join(f"{i + 1}. {word}" for i, word in enumerate(example_answers))
        return Prompt(
            text=CWE_TEMPLATE.format(context=context),
            answer_prefix=CWE_ANSWER_PREFIX,
            answers=answers,
            shots=[(CWE_TEMPLATE.format(context=example), CWE_ANSWER_PREFIX + numbered)],
            info={"num_words": min(size, len(vocabulary))},
            question=after_context(CWE_TEMPLATE),
        )

    def _listing(
        self, rng: random.Random, vocabulary: list[str], num_words: int, common: int, uncommon: int
    ) -> tuple[str, list[str]]:
        chosen = rng.sample(vocabulary, num_words)
        words = chosen[: self.num_cw] * common + chosen[self.num_cw :] * uncommon
        rng.shuffle(words)
        return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words)), chosen[: self.num_cw]


@dataclass(frozen=True)
class FreqWords(Generator):
    """Aggregation: coded words drawn from a Zipf(``alpha``) distribution; name the three most frequent
    (the most frequent of all is the noise word ``...``). Vocabulary: ``context_length // 50`` words."""

    alpha: float = 2.0
    word_length: int = 6
    tokens_to_generate = 50

    def build(self, rng: random.Random, size: int, task: RulerTask) -> Prompt:
        """An example of about ``size`` coded words."""
        used: set[str] = set()
        vocabulary = [
            _unique(lambda: _random_name(rng, string.ascii_lowercase, self.word_length), used)
            for _ in range(max(task.context_length // 50, 4))
        ]
        vocabulary[0] = "..."
        norm = _zeta(self.alpha)
        words = [word for rank, word in enumerate(vocabulary, 1) for _ in range(int(size * rank**-self.alpha / norm))]
        rng.shuffle(words)
        return Prompt(
            text=FWE_TEMPLATE.format(context=" ".join(words)),
            answer_prefix=FWE_ANSWER_PREFIX,
            answers=vocabulary[1:4],
            question=after_context(FWE_TEMPLATE),
        )


@functools.lru_cache(maxsize=4)
def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1: a partial sum plus its integral tail (error below 1e-8)."""
    terms = 10_000
    return sum(k**-alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1)


# --- qa_1 / qa_2: SQuAD and HotpotQA ------------------------------------------------------------

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

    def build(self, rng: random.Random, size: int, task: RulerTask) -> Prompt:
        qas, docs = qa_dataset(self.dataset, task.cfg.get("qa_dir"))
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
        random.Random(task.cfg.get("seed", 42)).shuffle(texts)
        context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=text) for i, text in enumerate(texts))
        return Prompt(
            text=QA_TEMPLATE.format(context=context, query=qa["query"]),
            answer_prefix=QA_ANSWER_PREFIX,
            answers=list(qa["outputs"]),
            info={"num_docs": len(texts)},
            question=after_context(QA_TEMPLATE, query=qa["query"]),
        )


SUBTASKS: dict[str, Generator] = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", num_values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", num_queries=4),
    "vt": VariableTracking(num_chains=1, num_hops=4),
    "cwe": CommonWords(freq_cw=30, freq_ucw=3, num_cw=10),
    "fwe": FreqWords(alpha=2.0),
    "qa_1": QA("squad"),
    "qa_2": QA("hotpotqa"),
}
"""RULER's 13 subtasks (``scripts/synthetic.yaml``); qa_1 / qa_2 need SQuAD / HotpotQA (``task.qa_dir`` or the hub)."""


PROMPT_FORMATS = ("ruler_official", "kvcache_factory", "hf_chat", "raw")


@dataclass
class Generated:
    """A sample's example, its final prompt text and token ids, and the haystack size that fits."""

    prompt: Prompt
    text: str
    input_ids: list[int]
    question_start: int | None
    size: int


def _largest_fitting(length: Callable[[int], int], budget: int, low: int, limit: int) -> int:
    """Largest ``n`` in ``[low, limit]`` with ``length(n) <= budget``, given that ``low`` fits and that
    lengths grow about linearly with ``n``: secant estimates, doubling steps away from them, bisection."""
    guess = min(low + 16, limit)
    for _ in range(2):  # two secant steps on the token count
        rate = max((length(guess) - length(low)) / max(guess - low, 1), 1e-3)
        guess = min(limit, low + int((budget - length(low)) / rate))
    step = max(1, (guess - low) // 256)
    if length(guess) <= budget:
        low, high = guess, min(guess + step, limit + 1)
        while high <= limit and length(high) <= budget:
            low, step = high, step * 2
            high = min(low + step, limit + 1)
    else:
        high = guess
        while (candidate := max(high - step, low)) > low and length(candidate) > budget:
            high, step = candidate, step * 2
        low = candidate
    while high - low > 1:  # low fits, high does not (or lies past the limit)
        middle = (low + high) // 2
        low, high = (middle, high) if length(middle) <= budget else (low, middle)
    return low


class RulerTask(Task):
    """RULER: ``subtasks`` (null = the synthetic ones of :data:`SUBTASKS`), ``num_samples`` per subtask,
    ``seed``, ``context_length`` (prompt + generated tokens), ``tokens_to_generate`` (null = RULER's per
    task, a number for every task, or a ``{subtask: number}`` mapping), ``prompt_format``,
    ``min_new_tokens``, ``data_dir`` (official jsonl files instead of generating), ``essay_dir`` with the
    Paul Graham essays, ``qa_dir`` with RULER's ``squad.json`` / ``hotpotqa.json`` and ``query_mode``
    (``agnostic``: each generated sample's ``question_start``, the task's question after its context) and
    ``questions_per_context`` (questions asked about one generated haystack)."""

    name = "ruler"
    splits_prompts = True
    domains = {
        "subtasks": optional(name_list(SUBTASKS), "its 11 synthetic tasks"),
        "context_length": TOKENS,
        "num_samples": optional(SAMPLES, "every record of task.data_dir"),
        "tokens_to_generate": optional(
            one_of(
                TOKENS,
                mapping(
                    "a mapping of subtask names to token counts ≥ 1",
                    lambda key, value: key in SUBTASKS and TOKENS.accepts(value),
                ),
            ),
            "RULER's per task",
        ),
        "prompt_format": choice(*PROMPT_FORMATS),
        "max_length": optional(TOKENS, "no cut"),
        "min_new_tokens": integer(0, "a token count"),
        "data_dir": optional(PATH, "generate the samples"),
        "seed": SEED,
        "essay_dir": optional(PATH, "download the essays once"),
        "qa_dir": optional(PATH, "the hub"),
        "questions_per_context": integer(1, "a question count"),
    }

    def __init__(self, cfg: DictConfig, model: ModelInfo):
        super().__init__(cfg, model)
        subtasks = cfg.get("subtasks")
        if subtasks is None:  # all the synthetic ones (qa_1 / qa_2 need data: name them)
            subtasks = [name for name, spec in SUBTASKS.items() if not spec.needs_data]
        elif isinstance(subtasks, str):
            subtasks = [subtasks]
        for subtask in subtasks:
            choose("RULER subtask (task.subtasks)", subtask, SUBTASKS)
        self.subtasks: list[str] = list(subtasks)
        self.context_length = int(cfg.context_length)
        if self.context_length > model.context_window:
            raise KVBenchError(
                f"task.context_length={self.context_length} exceeds the context window {model.context_window} "
                f"of model {model.name}; lower task.context_length"
            )
        self.data_dir = None if cfg.data_dir is None else resolve_path(cfg.data_dir)
        self.num_samples = None if cfg.num_samples is None else int(cfg.num_samples)
        if self.num_samples is None and self.data_dir is None:
            raise KVBenchError(
                "task.num_samples=null reads every record of task.data_dir; generated RULER samples need "
                "a number (RULER's default: 500)"
            )
        self.max_length = None if cfg.max_length is None else int(cfg.max_length)
        if self.max_length is not None and self.data_dir is None and self.max_length < self.context_length:
            raise KVBenchError(
                f"task.max_length={self.max_length} would cut prompts generated for task.context_length="
                f"{self.context_length}; lower task.context_length instead"
            )
        self.agnostic = cfg.query_mode == "agnostic"
        if self.agnostic and self.data_dir is not None:
            raise KVBenchError(
                "task.query_mode=agnostic needs generated samples (RULER's files hold each prompt as one text, "
                "with no context/question split); set task.data_dir=null"
            )
        self.questions_per_context = int(cfg.get("questions_per_context", 1))
        self._check_questions()
        self.template = model.template(cfg.prompt_format, PROMPT_FORMATS)
        self.answer_prefix = cfg.prompt_format != "kvcache_factory"
        self.min_new_tokens = int(cfg.min_new_tokens)
        self.tokens_to_generate = {
            name: self._tokens_to_generate(name, cfg.tokens_to_generate) for name in self.subtasks
        }

    def _check_questions(self) -> None:
        """``task.questions_per_context`` > 1 needs generated haystacks that hold that many questions."""
        count = self.questions_per_context
        if count == 1:
            return
        if self.data_dir is not None:
            raise KVBenchError(
                f"task.questions_per_context={count} needs generated samples (RULER's files hold one question "
                "per prompt); set task.data_dir=null"
            )
        holding = [name for name, spec in SUBTASKS.items() if spec.questions >= count]
        for subtask in self.subtasks:
            if SUBTASKS[subtask].questions < count:
                raise KVBenchError(
                    f"task.questions_per_context={count}: RULER {subtask} can be asked "
                    f"{SUBTASKS[subtask].questions} question(s) per haystack; subtasks that hold {count}: "
                    f"{', '.join(holding) or 'none'}"
                )

    def planned_tokens(self) -> tuple[int, int] | None:
        """Generated samples fill ``context_length`` (prompt and answer); files tell their own sizes."""
        if self.data_dir is not None or self.num_samples is None:
            return None
        decode = sum(self.tokens_to_generate.values()) * self.num_samples
        return self.context_length * self.num_samples * len(self.subtasks) - decode, decode

    @staticmethod
    def _tokens_to_generate(subtask: str, setting: Any) -> int:
        """``task.tokens_to_generate`` for one subtask: RULER's (null), one number, or a per-subtask mapping."""
        value = setting.get(subtask) if isinstance(setting, Mapping) else setting
        value = SUBTASKS[subtask].tokens_to_generate if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise KVBenchError(
                f"task.tokens_to_generate for {subtask} must be a positive number of tokens, got {value!r}"
            )
        return value

    @cached_property
    def essay_words(self) -> list[str]:
        """The essay haystack as a word list (downloaded on first use unless ``task.essay_dir`` is set)."""
        return paul_graham_essays(self.cfg.get("essay_dir")).split()

    def samples(self) -> Iterator[Sample]:
        """``num_samples`` samples per subtask (null: every record of a ``data_dir`` file), subtask by
        subtask; ids ``<subtask>-<index>`` (generated: ``questions_per_context`` consecutive ones ask about one
        haystack, :meth:`context_samples`) or ``<subtask>-<line>`` (files)."""
        for subtask in self.subtasks:
            if self.data_dir is not None:
                yield from self.file_samples(self.data_dir, subtask)
                continue
            assert self.num_samples is not None  # __init__ requires it without a data_dir
            count = self.questions_per_context
            for context in range(-(-self.num_samples // count)):
                yield from self.context_samples(subtask, context)[: self.num_samples - context * count]

    def check_data(self) -> None:
        """The official file of every subtask in ``data_dir``; else the QA subtasks' data in ``qa_dir`` or the
        hub reachable."""
        for subtask in self.subtasks:
            if self.data_dir is not None:
                self.data_file(self.data_dir, subtask)
            spec = SUBTASKS[subtask]
            if self.data_dir is None and isinstance(spec, QA) and self.cfg.get("qa_dir") is None and not hub_online():
                names = QA_FILES[spec.dataset]
                raise KVBenchError(
                    f"RULER {subtask} needs {names[0]}: the hub is unreachable; download {names[0]} into a folder "
                    "and set task.qa_dir=FOLDER"
                )

    def data_file(self, data_dir: Path, subtask: str) -> Path:
        """``<data_dir>/<subtask>.jsonl``, or a one-line error."""
        path = data_dir / f"{subtask}.jsonl"
        if not path.is_file():
            raise KVBenchError(
                f"RULER file {path} not found; task.data_dir must hold <subtask>.jsonl files written by "
                "RULER's scripts/data/prepare.py (or set task.data_dir=null to generate samples)"
            )
        return path

    def file_samples(self, data_dir: Path, subtask: str) -> Iterator[Sample]:
        """The first ``num_samples`` records of ``<data_dir>/<subtask>.jsonl``, in file order.

        Records are RULER's (``input``, ``outputs``, and ``answer_prefix`` where the generator split one off)
        as its scripts write them; ``index`` is only kept as metadata: RULER's niah generator has written a
        character offset there since its commit d4293b9, so the sample id is the record's position."""
        path = self.data_file(data_dir, subtask)
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        for position, line in enumerate(lines[: self.num_samples]):
            try:
                record = json.loads(line)
                text, answers = record["input"], list(record["outputs"])
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise KVBenchError(
                    f"{path}:{position + 1} is not a RULER record with input and outputs "
                    f"({type(error).__name__}: {error})"
                ) from None
            prefix = record.get("answer_prefix", "") if self.answer_prefix else ""
            if self.max_length is not None:
                text = self.model.cut_middle(text, self.max_length)
            ids = self.model.prompt_ids(self.template, text, prefix)
            yield self._sample(
                subtask,
                position,
                ids,
                [str(answer) for answer in answers],
                {"index": record.get("index"), "length": record.get("length"), "source": str(path)},
            )

    def sample(self, subtask: str, index: int) -> Sample:
        """Generated sample ``index`` of ``subtask`` (the same for the same seed, tokenizer, context length and
        questions per context)."""
        context, question = divmod(index, self.questions_per_context)
        return self.context_samples(subtask, context)[question]

    def context_samples(self, subtask: str, context: int) -> list[Sample]:
        """The ``questions_per_context`` samples asking about haystack ``context`` of ``subtask``: indices
        ``context * questions_per_context ...``; with more than one, each carries the ``context_id`` they share, and
        in ``query_mode=agnostic`` the same context tokens."""
        count = self.questions_per_context
        generated = self.generate_questions(subtask, context, count)
        context_id = f"{subtask}-context-{context}" if count > 1 else None
        samples = []
        for question, example in enumerate(generated):
            index = context * count + question
            info = {"index": index, "haystack_size": example.size, **example.prompt.info}
            if context_id is not None:
                info |= {"context": context, "question": question}
            ids, answers = example.input_ids, example.prompt.answers
            samples.append(self._sample(subtask, index, ids, answers, info, example.question_start, context_id))
        if self.agnostic and len({tuple(sample.input_ids[: sample.question_start]) for sample in samples}) > 1:
            raise KVBenchError(
                f"RULER {subtask} haystack {context}: its questions' contexts tokenize differently in "
                f"task.prompt_format={self.cfg.prompt_format}; set task.questions_per_context=1"
            )
        return samples

    def _sample(
        self,
        subtask: str,
        position: int,
        ids: list[int],
        answers: list[str],
        info: dict[str, Any],
        question_start: int | None = None,
        context_id: str | None = None,
    ) -> Sample:
        max_new_tokens = self.tokens_to_generate[subtask]
        if len(ids) + max_new_tokens > self.model.context_window:
            raise KVBenchError(
                f"RULER {subtask} sample {position} has {len(ids)} prompt tokens + {max_new_tokens} to generate, "
                f"beyond the context window {self.model.context_window} of model {self.model.name}"
            )
        return Sample(
            id=f"{subtask}-{position}",
            subtask=subtask,
            input_ids=ids,
            answers=answers,
            max_new_tokens=max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            metadata={"context_length": self.context_length, **info},
            question_start=question_start,
            context_id=context_id,
        )

    def generate(self, subtask: str, index: int) -> Generated:
        """Build sample ``index`` of ``subtask`` (one question per haystack) with the largest haystack that fits the
        token budget: the context length less RULER's tokens to generate for the task (what its generator
        reserves)."""
        return self.generate_questions(subtask, index, 1)[0]

    def generate_questions(self, subtask: str, context: int, count: int) -> list[Generated]:
        """``count`` questions about haystack ``context`` of ``subtask`` (:meth:`generate` for one), the haystack the
        largest whose longest prompt fits the token budget."""
        spec = SUBTASKS[subtask]
        budget = self.context_length - spec.tokens_to_generate
        seed = f"{self.cfg.seed}:{subtask}:{context}"
        tried: dict[int, list[Generated]] = {}

        def length(size: int) -> int:
            if size not in tried:
                examples = spec.build_questions(random.Random(seed), size, self, count)
                tried[size] = [Generated(prompt, *self.render(prompt), size) for prompt in examples]
            return max(len(example.input_ids) for example in tried[size])

        if length(spec.min_size) > budget:
            raise KVBenchError(
                f"task.context_length={self.context_length} is too small for RULER {subtask}: its prompt needs "
                f"{length(spec.min_size)} tokens without haystack plus {spec.tokens_to_generate} to generate; "
                "raise task.context_length"
            )
        return tried[_largest_fitting(length, budget, spec.min_size, 2 * self.context_length)]

    def render(self, prompt: Prompt) -> tuple[str, list[int], int | None]:
        """The text the model reads (template, answer prefix but for ``kvcache_factory``), its token ids and, with
        ``task.query_mode=agnostic``, where its question starts in them.

        The worked examples (cwe, vt) precede the task text, as RULER writes them; ``hf_chat`` makes them
        earlier turns of the chat."""
        prefix = prompt.answer_prefix if self.answer_prefix else ""
        text = "".join(f"{user}{assistant}\n" for user, assistant in prompt.shots) + prompt.text
        messages = None
        if self.template == prompts.HF_CHAT:
            messages = []
            for user, assistant in prompt.shots:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant.strip()}]
            messages.append({"role": "user", "content": prompt.text})
        if self.agnostic:
            ids, question_start = self.model.prompt_split(self.template, text, prompt.question, prefix, messages)
            return self.model.tokenizer.decode(ids), ids, question_start
        ids = self.model.prompt_ids(self.template, text, prefix, messages)
        return self.model.tokenizer.decode(ids), ids, None

    def score(self, sample: Sample, prediction: str) -> float:
        """The subtask's RULER metric (string_match_all; qa: string_match_part), 0-1."""
        return SUBTASKS[sample.subtask].metric(prediction, sample.answers)
