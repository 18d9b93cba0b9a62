"""RULER synthetic tasks (Hsieh et al., 2024), generated per tokenizer to a target context length, or read
from the jsonl files RULER's own scripts write.

Each subtask is a spec in :data:`SUBTASKS` (:mod:`kvbench.tasks.ruler_generators`, :mod:`kvbench.tasks.ruler_qa`)
that builds one example from a random generator and a haystack *size* (noise paragraphs, essay words, distractor
needles, list words ...). :class:`RulerTask` finds, for every sample, the largest size whose prompt -- in the prompt
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

qa_1 (SQuAD v2.0 dev, answerable questions) and qa_2 (HotpotQA dev, distractor setting) read RULER's
``squad.json`` / ``hotpotqa.json`` (the official ``dev-v2.0.json`` / ``hotpot_dev_distractor_v1.json``
names work too) from ``task.qa_dir``, or, without it, the hub datasets ``rajpurkar/squad_v2`` and
``hotpotqa/hotpot_qa`` (validation split) through ``datasets``. They are not in the null default.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from kvbench import resolve_path
from kvbench.domains import PATH, SAMPLES, SEED, TOKENS, choice, integer, mapping, name_list, one_of, optional
from kvbench.errors import KVBenchError
from kvbench.hub import hub_online
from kvbench.resources import paul_graham_essays
from kvbench.tasks import prompts
from kvbench.tasks.base import ModelInfo, Sample, TableLayout, Task
from kvbench.tasks.ruler_generators import CommonWords, Example, FreqWords, Generator, Niah, VariableTracking
from kvbench.tasks.ruler_qa import QA, QA_FILES

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

    prompt: Example
    text: str
    input_ids: list[int]
    question_start: int | None
    size: int


def _largest_fitting(length: Callable[[int], int], budget: int, low: int, limit: int) -> int:
    """Largest ``n`` in ``[low, limit]`` with ``length(n) <= budget``, given that ``low`` fits and that
    lengths grow about linearly with ``n``: secant estimates, doubling steps away from them, bisection."""
    guess = min(low + 16, limit)
    for _ in range(2):  # two secant steps on the token count (none from a guess of ``low``: no slope)
        if guess == low:
            break
        rate = max((length(guess) - length(low)) / (guess - low), 1e-3)
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
    table = TableLayout(title="RULER", order=tuple(SUBTASKS), by_context=True)
    context_setting = "context_length"
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

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        super().__init__(settings, model)
        settings = self.settings  # read once, plain values
        subtasks = settings.get("subtasks")
        if subtasks is None:  # all the synthetic ones (qa_1 / qa_2 need data: name them)
            subtasks = [name for name, spec in SUBTASKS.items() if not spec.needs_data]
        elif isinstance(subtasks, str):
            subtasks = [subtasks]
        self.subtasks: list[str] = list(subtasks)
        self.context_length = int(settings.context_length)
        if self.context_length > model.context_window:
            raise KVBenchError(
                f"task.context_length={self.context_length} exceeds the context window {model.context_window} "
                f"of model {model.name}; lower task.context_length"
            )
        self.data_dir = None if settings.data_dir is None else resolve_path(settings.data_dir)
        self.num_samples = None if settings.num_samples is None else int(settings.num_samples)
        if self.num_samples is None and self.data_dir is None:
            raise KVBenchError(
                "task.num_samples=null reads every record of task.data_dir; generated RULER samples need "
                "a number (RULER's default: 500)"
            )
        self.max_length = None if settings.max_length is None else int(settings.max_length)
        if self.max_length is not None and self.data_dir is None and self.max_length < self.context_length:
            raise KVBenchError(
                f"task.max_length={self.max_length} would cut prompts generated for task.context_length="
                f"{self.context_length}; lower task.context_length instead"
            )
        self.agnostic = settings.query_mode == "agnostic"
        if self.agnostic and self.data_dir is not None:
            raise KVBenchError(
                "task.query_mode=agnostic needs generated samples (RULER's files hold each prompt as one text, "
                "with no context/question split); set task.data_dir=null"
            )
        self.questions_per_context = int(settings.get("questions_per_context", 1))
        self._check_questions()
        self.template = model.template(settings.prompt_format, PROMPT_FORMATS)
        self.answer_prefix = settings.prompt_format != "kvcache_factory"
        self.min_new_tokens = int(settings.min_new_tokens)
        self.tokens_to_generate = {
            name: self._tokens_to_generate(name, settings.tokens_to_generate) for name in self.subtasks
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
        return SUBTASKS[subtask].tokens_to_generate if value is None else value  # its domain: task.check

    @cached_property
    def essay_words(self) -> list[str]:
        """The essay haystack as a word list (downloaded on first use unless ``task.essay_dir`` is set)."""
        return paul_graham_essays(self.settings.get("essay_dir")).split()

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
            if (
                self.data_dir is None
                and isinstance(spec, QA)
                and self.settings.get("qa_dir") is None
                and not hub_online()
            ):
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
        lines = [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
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
                f"task.prompt_format={self.settings.prompt_format}; set task.questions_per_context=1"
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
        seed = f"{self.settings.seed}:{subtask}:{context}"
        tried: dict[int, list[tuple[Example, list[int], int | None]]] = {}  # size → (example, ids, question start)

        def length(size: int) -> int:
            if size not in tried:
                examples = spec.build_questions(random.Random(seed), size, self, count)
                tried[size] = [(prompt, *self.encode(prompt)) for prompt in examples]
            return max(len(ids) for _, ids, _ in tried[size])

        if length(spec.min_size) > budget:
            raise KVBenchError(
                f"task.context_length={self.context_length} is too small for RULER {subtask}: its prompt needs "
                f"{length(spec.min_size)} tokens without haystack plus {spec.tokens_to_generate} to generate; "
                "raise task.context_length"
            )
        size = _largest_fitting(length, budget, spec.min_size, 2 * self.context_length)
        decode = self.model.tokenizer.decode  # the text of the size chosen only: a search tries about 13
        return [Generated(prompt, decode(ids), ids, start, size) for prompt, ids, start in tried[size]]

    def encode(self, prompt: Example) -> tuple[list[int], int | None]:
        """The token ids the model reads (template, answer prefix but for ``kvcache_factory``) and, with
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
            return self.model.prompt_split(self.template, text, prompt.question, prefix, messages)
        return self.model.prompt_ids(self.template, text, prefix, messages), None

    def score(self, sample: Sample, prediction: str) -> float:
        """The subtask's RULER metric (string_match_all; qa: string_match_part), 0-1."""
        return SUBTASKS[sample.subtask].metric(prediction, sample.answers)
