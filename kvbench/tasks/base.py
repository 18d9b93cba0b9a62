"""The task interface: a task builds token-level samples and scores what the engine returns.

A task never imports a policy and the engine never imports a task; ``kvbench.run`` joins them.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from kvbench.domains import Domain, Settings, check_table, choice
from kvbench.tasks import prompts

T = TypeVar("T")  # what Task.fitted builds


@dataclass
class Sample:
    """One unit of work for the engine.

    ``mode="generate"``: greedy-decode up to ``max_new_tokens`` after ``input_ids`` (the prompt, already
    templated and truncated by the task); no stop token may end it before ``min_new_tokens`` new tokens
    (Hugging Face's ``min_length = prompt + min_new_tokens``); the last token of each of ``stop_strings`` also
    stops it (LongBench samsum's newline). ``mode="perplexity"``: score every token of
    ``input_ids`` after the first ``context_tokens`` (0 = the whole stream, StreamingLLM protocol).
    ``question_start`` (``task.query_mode=agnostic``): ``input_ids[:question_start]`` is the context, compressed
    alone; the rest is the question, read after the eviction without evicting. ``context_id``: the samples that
    ask about one context share it (RULER's ``task.questions_per_context``); in ``agnostic``, the context is compressed
    once for all of them.
    """

    id: str
    subtask: str
    input_ids: list[int]
    answers: list[str] = field(default_factory=list)
    mode: Literal["generate", "perplexity"] = "generate"
    max_new_tokens: int = 32
    min_new_tokens: int = 0
    stop_strings: list[str] = field(default_factory=list)
    context_tokens: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    question_start: int | None = None
    context_id: str | None = None


@dataclass
class ModelInfo:
    """What a task may know about the model: its tokenizer, its context window and its Hugging Face id
    (the prompt formats pick a model family's template by it), nothing about the cache."""

    name: str
    tokenizer: Any
    context_window: int
    hf_id: str | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text, without special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens skipped."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def cut_middle(self, text: str, max_length: int) -> str:
        """``text`` cut to about ``max_length`` tokens as LongBench's ``pred.py`` (and KVCache-Factory) cut it:
        counted with the special tokens, the first and the last ``max_length // 2`` tokens decoded on their
        own and joined (tokenized again, the cut can merge or split a token)."""
        ids = self.prompt_ids("raw", text)
        if len(ids) <= max_length:
            return text
        half = max_length // 2
        return self.decode(ids[:half]) + self.decode(ids[-half:])

    def cut_halves(self, text: str, max_length: int, odd_to_tail: bool = False) -> str:
        """``text`` cut to ``max_length`` tokens as LongBench-v2's ``pred.py`` and InfiniteBench's ``truncate_input``
        cut it: its token ids (with the special tokens) kept to their first and last halves (:func:`middle_cut`, the
        odd token to the tail with ``odd_to_tail``), decoded as one text (special tokens skipped)."""
        ids = self.prompt_ids("raw", text)
        return text if len(ids) <= max_length else self.decode(middle_cut(ids, max_length, odd_to_tail))

    def template(self, prompt_format: str, valid: tuple[str, ...]) -> str:
        """The template a task's prompt format (one of ``valid``) uses for this model, checked usable here."""
        template = prompts.template_for(prompt_format, valid, self.hf_id)
        if template == prompts.HF_CHAT:
            prompts.check_chat_template(self.tokenizer, self.name)
        return template

    def prompt_ids(
        self, template: str, text: str, answer_prefix: str = "", messages: list[dict[str, str]] | None = None
    ) -> list[int]:
        """The prompt's token ids in a template of :mod:`kvbench.tasks.prompts`."""
        prompt, special_tokens = prompts.rendered(self.tokenizer, self.name, template, text, answer_prefix, messages)
        return list(self.tokenizer(prompt, add_special_tokens=special_tokens, verbose=False)["input_ids"])

    def prompt_split(
        self,
        template: str,
        text: str,
        question: str,
        answer_prefix: str = "",
        messages: list[dict[str, str]] | None = None,
    ) -> tuple[list[int], int]:
        """:meth:`prompt_ids` and the index where ``question`` (the end of ``text``) starts in them."""
        prompt, special_tokens = prompts.rendered(self.tokenizer, self.name, template, text, answer_prefix, messages)
        return prompts.split_question(self.tokenizer, prompt, special_tokens, question)


def middle_cut(ids: list[int], max_length: int, odd_to_tail: bool = False) -> list[int]:
    """``ids`` kept to their first and last ``max_length // 2`` where longer than ``max_length`` (``truncate_input``'s
    "middle" of SCBench and of InfiniteBench's ``eval_yarn_mistral.py``); with ``odd_to_tail`` the last
    ``-max_length // 2`` (Python's floor: one more where ``max_length`` is odd, so ``max_length`` in all) as
    InfiniteBench's ``eval_utils.py`` (line 401 at 88b3daa) and LongBench-v2's ``pred.py`` (``input_ids[-max_len//2:]``)
    keep them."""
    if len(ids) <= max_length:
        return ids
    tail = -max_length // 2 if odd_to_tail else -(max_length // 2)
    return ids[: max_length // 2] + ids[tail:]


def context_id(name: str, context: str) -> str:
    """``<name>-context-<12 hex digits>``: one id for the samples of ``name`` whose contexts are identical."""
    return f"{name}-context-{hashlib.sha1(context.encode('utf-8')).hexdigest()[:12]}"


def contexts_together(samples: list[Sample]) -> list[Sample]:
    """``samples`` with those of one ``context_id`` next to each other, contexts in the order they first appear (a
    query-agnostic run answers them from one compression)."""
    first: dict[str, int] = {}
    for sample in samples:
        first.setdefault(sample.context_id or sample.id, len(first))
    return sorted(samples, key=lambda sample: first[sample.context_id or sample.id])


@dataclass(frozen=True)
class TableLayout:
    """How ``kvbench table`` lays out a task's scores: under ``title``, the subtasks' ``order`` (any other after
    them), the ``headers`` the papers print for them, ``categories`` (each a mean of its subtasks, in a table of its
    own), whether scores are named ``<subtask>@<bucket>`` (``buckets``: a row per bucket) and whether a row is
    one context length (``by_context``: :meth:`Task.context_size`)."""

    title: str
    order: tuple[str, ...] = ()
    headers: Mapping[str, str] = field(default_factory=dict)
    categories: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    buckets: bool = False
    by_context: bool = False


class Task(ABC):
    """Build samples for one benchmark and score the engine's outputs."""

    name: str
    #: the task's table in ``kvbench table`` (None: its scores in the table of runs)
    table: ClassVar[TableLayout | None] = None
    #: the domain of each of the task's settings (``task.<key>``, conf/task/<name>.yaml)
    domains: ClassVar[dict[str, Domain]] = {}
    #: the setting that gives a run's context length in tokens (:meth:`context_size`), if one does
    context_setting: ClassVar[str | None] = None
    #: whether the task gives its samples a ``question_start``: ``task.query_mode=agnostic`` needs it
    splits_prompts: ClassVar[bool] = False
    #: the fields of a finished sample's record that :meth:`aggregate` reads beyond every record's
    #: (:data:`kvbench.rundir.RECORD_FIELDS`): a line without them is redone
    required_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        """``settings``: the job's ``task.*`` values (any mapping: a Hydra node's are read once, into
        :class:`~kvbench.domains.Settings`)."""
        self.settings = Settings(settings)
        self.check(self.settings.to_dict())  # the domains, however the task is built
        self.model = model

    @classmethod
    def setting_domains(cls, name: str | None = None) -> dict[str, Domain]:
        """:attr:`domains` and every task's ``query_mode``: ``agnostic`` where the task splits its prompts (``name``:
        the task's, where one class serves several)."""
        refusal = f"aware (task {name or cls.name} cannot split its prompts into a context and a question)"
        modes = choice("aware", "agnostic") if cls.splits_prompts else Domain(refusal, lambda mode: mode == "aware")
        return {**cls.domains, "query_mode": modes}

    @classmethod
    def check(cls, settings: dict[str, Any]) -> None:
        """A one-line error for a setting outside its domain (before anything is loaded)."""
        check_table(settings, cls.setting_domains(settings.get("name")), "task.")

    @classmethod
    def context_size(cls, settings: Mapping[str, Any]) -> int | None:
        """The context length a run with these ``task.*`` settings ran at (its rows in the tables): the value of
        :attr:`context_setting`; None where the task has none or the run left it unset."""
        value = settings.get(cls.context_setting) if cls.context_setting else None
        return None if value is None else int(value)

    @classmethod
    def for_model(cls, settings: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
        """The task's ``settings`` with its per-model values filled in, before anything is loaded (the config
        that runs and is printed, ``kvbench.job.resolve``); ``model`` is the model's node. None here."""
        return settings

    def check_data(self) -> None:
        """A one-line error, with the fix, when the data this task reads is neither on this machine nor
        downloadable now (``kvbench plan`` marks the job invalid); nothing is downloaded. None here: the task
        generates its samples or reads files its constructor checked."""
        return None

    @abstractmethod
    def samples(self) -> Iterator[Sample]:
        """Yield samples in a deterministic order (ids must be stable across runs for resuming)."""

    @abstractmethod
    def score(self, sample: Sample, prediction: str) -> float:
        """Score one generated prediction in [0, 1]."""

    def evaluate(self, sample: Sample, output: Any) -> dict[str, Any]:
        """The record fields of one finished sample (at least ``prediction`` and ``score``).

        ``output`` is the decoded text for ``mode="generate"``; perplexity tasks override this and
        receive the per-token negative log-likelihoods (list of floats).
        """
        return {"prediction": output, "score": self.score(sample, output)}

    def fitted(self, build: Callable[[int], T], length: Callable[[T], int], limit: int, new_tokens: int) -> T:
        """``build(limit)`` (a prompt cut to ``limit`` tokens of its text), the limit lowered by what the prompt the
        model sees and ``new_tokens`` overflow its window (a template's tokens around the cut text, a re-tokenised
        cut): the default cut of a task counts every token the model will see and leaves room for the answer."""
        built = build(limit)
        for _ in range(4):  # a cut re-tokenised may merge or split a token: settles in one or two rounds
            over = length(built) + new_tokens - self.model.context_window
            if over <= 0 or limit <= over:
                break
            limit -= over
            built = build(limit)
        return built

    def cut_limit(self) -> int | None:
        """The user's prompt token limit (``task.max_length``), or None: the task's default, which fits the window."""
        return None

    def answer_tokens(self) -> int:
        """The most tokens a sample may generate, as the settings tell."""
        return 0

    def window_refusal(self) -> str | None:
        """Why the settings alone cannot fit a prompt and its answer in the model's window (``kvbench plan`` and
        ``run``, before any data is read: a :meth:`cut_limit` with no room for :meth:`answer_tokens`), else None;
        each sample is checked again once built."""
        limit, answer, window = self.cut_limit(), self.answer_tokens(), self.model.context_window
        if limit is not None and limit + answer > window:
            return (
                f"task.max_length={limit} and up to {answer} generated tokens exceed the context window {window} of "
                f"model {self.model.name}; lower task.max_length (null: the window's)"
            )
        return None

    def planned_tokens(self) -> tuple[int, int] | None:
        """``(prompt tokens to prefill, tokens to generate at most)`` over every sample, where the settings alone
        tell (``kvbench plan``); None where only the data does."""
        return None

    def aggregate(self, records: list[dict]) -> dict[str, float]:
        """Subtask -> mean score on a 0-100 scale (records carry ``subtask`` and ``score``)."""
        by_subtask: dict[str, list[float]] = {}
        for record in records:
            by_subtask.setdefault(record["subtask"], []).append(record["score"])
        return {name: 100.0 * sum(values) / len(values) for name, values in by_subtask.items()}
