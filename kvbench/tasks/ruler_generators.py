"""RULER's synthetic generators (niah, vt, cwe, fwe): each subtask a spec (a small frozen dataclass) that builds one
example from a random generator and a haystack *size* (noise paragraphs, essay words, distractor needles, list
words ...), with RULER's templates and answer prefixes (``scripts/synthetic.yaml``,
``scripts/data/synthetic/constants.py``); the task that sizes and runs them is :mod:`kvbench.tasks.ruler`.

Deliberate differences from RULER's generator scripts:

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
"""

from __future__ import annotations

import functools
import itertools
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kvbench.domains import Settings
from kvbench.metrics.ruler import string_match_all
from kvbench.resources import wonderwords_list
from kvbench.tasks.prompts import after_context

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


class Haystack(Protocol):
    """What a generator reads of its task (:class:`~kvbench.tasks.ruler.RulerTask`)."""

    settings: Settings
    context_length: int

    @property
    def essay_words(self) -> list[str]: ...


@dataclass
class Example:
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

    def build(self, rng: random.Random, size: int, task: Haystack) -> Example:
        """An example whose haystack has ``size`` units."""
        raise NotImplementedError

    def build_questions(self, rng: random.Random, size: int, task: Haystack, count: int) -> list[Example]:
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

    def build(self, rng: random.Random, size: int, task: Haystack) -> Example:
        """An example whose haystack has ``size`` units (noise paragraphs, essay words or distractors)."""
        return self.build_questions(rng, size, task, 1)[0]

    def build_questions(self, rng: random.Random, size: int, task: Haystack, count: int) -> list[Example]:
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
                Example(
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

    def build(self, rng: random.Random, size: int, task: Haystack) -> Example:
        """An example with ``size`` noise paragraphs, preceded by the worked example."""
        example_text, example_prefix, example_answers, _ = self._example(
            rng, VT_EXAMPLE_NOISE, 3, min(10, self.num_hops)
        )
        text, prefix, answers, question = self._example(rng, size, 5, self.num_hops)
        shot = f"{example_text}{example_prefix}{' '.join(example_answers)}"
        return Example(text=f"{shot}\n\n{text}", answer_prefix=prefix, answers=answers, question=question)

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

    def build(self, rng: random.Random, size: int, task: Haystack) -> Example:
        """An example with ``size`` distinct words (capped by the vocabulary)."""
        vocabulary = _cwe_vocabulary()
        short = task.context_length < 4096  # RULER's lighter repetition for short contexts
        example, example_answers = self._listing(rng, vocabulary, 20 if short else 40, *((3, 1) if short else (10, 3)))
        context, answers = self._listing(
            rng, vocabulary, min(size, len(vocabulary)), *((6, 1) if short else (self.freq_cw, self.freq_ucw))
        )
        numbered = " ".join(f"{i + 1}. {word}" for i, word in enumerate(example_answers))
        return Example(
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

    def build(self, rng: random.Random, size: int, task: Haystack) -> Example:
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
        return Example(
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
