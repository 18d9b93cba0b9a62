"""NeedleBench (Li et al., 2024; OpenCompass), the v1 benchmark SLAKE Table 4 cites: single-needle
retrieval, multi-needle retrieval and multi-needle reasoning, in English and Chinese.

Subtasks: ``single_en``/``single_zh`` (OpenCompass ``NeedleBenchOriginDataset``), ``retrieval_en``/
``retrieval_zh`` (``NeedleBenchParallelDataset``: one needle per depth, all in one prompt) and
``reasoning_en``/``reasoning_zh`` (``NeedleBenchMultiDataset``: the 2-5 derivation needles of a
multi-hop question). Generation follows OpenCompass's loaders line by line:

* haystack: ``PaulGrahamEssays.jsonl`` (EN) or ``zh_finance.jsonl`` (ZH), one ``{"text": ...}`` record
  per line; repeat ``r`` uses the records in the order left by ``random.seed(c); random.shuffle(lines)``
  applied for c = 0..r in turn (the loaders shuffle one list cumulatively), each record tokenized on
  its own and the tokens concatenated up to ``length - length_buffer - needle tokens``;
* needles: single -- ``random.seed(r); random.choice`` among the language's lines of ``needles.jsonl``
  (``needle``, ``retrieval_question``, keyword ``arg2``); reasoning -- ``random.seed(r);
  random.choice`` among the records of ``multi_needle_reasoning_<lang>.json`` with ``derivation_count``
  = N (needles ``derivations``, ``question``, ``answer``); retrieval -- as many needles as depths, unique
  in ``arg1``, ``arg2`` and the pair, re-shuffled per repeat; each needle is wrapped in newlines;
* insertion at token ``int(n * depth / 100)`` (no sentence snapping); reasoning needles follow each other
  at ``diff`` = 10 % of the haystack; retrieval needles go one per depth;
* prompts: the v1 templates with the question at the end and the "guide" sentence (``guide: true`` as
  in the official configs), sent as one user turn through the model's chat template (``prompt_format:
  hf_chat``: OpenCompass's ``HuggingFacewithChatTemplate``, the type of its chat model configs such as
  ``hf_llama3_8b_instruct.py``) or raw with BOS (``raw``);
* generation: up to ``max_new_tokens`` (OpenCompass's model configs: ``max_out_len=1024``).

Scores are the official evaluators' (:mod:`kvbench.metrics.needlebench`). ``aggregate`` follows the
official summarizer: a dataset is one (subtask, needle count, length, depth) cell -- (subtask, length)
for retrieval -- scored by its mean x100; groups are plain means of their datasets; ``overall`` =
0.4 single + 0.3 reasoning + 0.3 retrieval.

Grids (``task.grid``): the official ``4k`` (lengths 1000-4000) and ``8k`` (5000-8000) configurations,
20 depths, their per-language ``length_buffer`` values and repeats (10; retrieval 25).

Deliberate differences: lengths are counted with the evaluated model's tokenizer (OpenCompass: tiktoken
``gpt-4``), so a "5000" prompt holds about 5000 of the model's tokens; the multi-needle retrieval needle
draw, unseeded in OpenCompass, uses ``random.Random(task.seed)``; a retrieval question without the
"Please answer in the format" / "请按照" marker gets the guide sentence appended.

Data: ``task.data_dir`` (a folder with the hub files) or the hub dataset ``opencompass/NeedleBench``.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from kvbench import resolve_path
from kvbench.domains import (
    FLAG,
    PATH,
    PERCENT,
    SAMPLES,
    SEED,
    TOKENS,
    choice,
    integer,
    list_of,
    mapping,
    name_list,
    number,
    one_of,
    optional,
)
from kvbench.errors import KVBenchError
from kvbench.hub import check_hub_file, hub_file
from kvbench.metrics.needlebench import multi_reasoning_score, multi_retrieval_score, single_needle_score
from kvbench.tasks.base import ModelInfo, Sample, Task
from kvbench.tasks.needlebench_prompts import guided_question, needlebench_prompt, retrieval_question, unique_needles

HUB_REPO = "opencompass/NeedleBench"
LANGUAGES = {"en": "English", "zh": "Chinese"}
HAYSTACK_FILES = {"en": "PaulGrahamEssays.jsonl", "zh": "zh_finance.jsonl"}
NEEDLE_FILE = "needles.jsonl"
REASONING_FILES = {"en": "multi_needle_reasoning_en.json", "zh": "multi_needle_reasoning_zh.json"}
KINDS = ("single", "retrieval", "reasoning")
SUBTASKS = tuple(f"{kind}_{language}" for kind in KINDS for language in LANGUAGES)
OVERALL_WEIGHTS = {"single": 0.4, "reasoning": 0.3, "retrieval": 0.3}
REPEATS = {"single": 10, "retrieval": 25, "reasoning": 10}
PROMPT_FORMATS = ("hf_chat", "raw")


def truncated_depths(intervals: int = 20) -> list[int]:
    """OpenCompass's ``generate_depth_percents(intervals, 'linear')``, truncated by ``int()``."""
    if intervals == 1:
        return [0]
    step = 100 / (intervals - 1)
    return [int(step * i) for i in range(intervals)]


@dataclass(frozen=True)
class Grid:
    lengths: tuple[int, ...]
    buffers: dict[str, dict[str, int]]  # kind -> language -> length_buffer


GRIDS = {
    "4k": Grid(
        (1000, 2000, 3000, 4000),
        {"single": {"en": 600, "zh": 200}, "retrieval": {"en": 1000, "zh": 200}, "reasoning": {"en": 600, "zh": 200}},
    ),
    "8k": Grid(
        (5000, 6000, 7000, 8000),
        {"single": {"en": 800, "zh": 200}, "retrieval": {"en": 1300, "zh": 200}, "reasoning": {"en": 1000, "zh": 200}},
    ),
}


class NeedleBenchTask(Task):
    """Options: ``subtasks``, ``grid`` (4k | 8k), ``context_lengths`` / ``depths`` (override the grid),
    ``num_repeats`` (null = official per kind), ``needle_counts`` (reasoning), ``guide``, ``diff``,
    ``length_buffer`` (null = the grid's per kind and language), ``max_new_tokens`` (a number, or per kind),
    ``prompt_format``, ``data_dir`` (null = the hub), ``seed`` (the retrieval needle draw)."""

    name = "needlebench"
    context_setting = "grid"
    domains = {
        "subtasks": optional(name_list(SUBTASKS), "all six"),
        "grid": choice(*GRIDS),
        "context_lengths": optional(list_of(TOKENS, "token counts ≥ 1"), "the grid's"),
        "depths": optional(list_of(PERCENT, "percents"), "the grid's 20 depths"),
        "num_repeats": optional(SAMPLES, "the official count per kind"),
        "needle_counts": list_of(integer(2, "a needle count"), "needle counts ≥ 2"),
        "length_buffer": optional(integer(0, "a token count"), "the grid's per kind and language"),
        "guide": FLAG,
        "diff": number(0, 100, low_open=True),
        "max_new_tokens": one_of(
            TOKENS,
            mapping(
                "a mapping of kinds to token counts ≥ 1", lambda key, value: key in KINDS and TOKENS.accepts(value)
            ),
        ),
        "prompt_format": choice(*PROMPT_FORMATS),
        "data_dir": optional(PATH, "the hub's opencompass/NeedleBench"),
        "seed": SEED,
    }

    @classmethod
    def context_size(cls, settings: Mapping[str, Any]) -> int | None:
        """The grid's name in tokens (``8k`` → 8192; a NeedleBench table's columns are the grid's lengths)."""
        grid = str(settings.get("grid") or "")
        return int(grid[:-1]) * 1024 if grid[:-1].isdigit() and grid.endswith("k") else None

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        super().__init__(settings, model)
        settings = self.settings  # read once, plain values
        subtasks = settings.get("subtasks") or list(SUBTASKS)
        self.subtasks = [subtasks] if isinstance(subtasks, str) else list(subtasks)
        self.grid = GRIDS[str(settings.get("grid", "8k"))]
        lengths = settings.get("context_lengths")
        self.context_lengths = list(self.grid.lengths) if lengths is None else [int(value) for value in lengths]
        depths = settings.get("depths")
        self.depths = truncated_depths(20) if depths is None else [int(value) for value in depths]
        if not self.context_lengths or not self.depths or any(not 0 <= depth <= 100 for depth in self.depths):
            raise KVBenchError(
                f"task.context_lengths and task.depths (percents) must be non-empty, got "
                f"{self.context_lengths} and {self.depths}"
            )
        too_long = [length for length in self.context_lengths if length > model.context_window]
        if too_long:
            raise KVBenchError(
                f"task.context_lengths has {too_long[0]}, above the context window {model.context_window} "
                f"of model {model.name}; lower it or pick task.grid=4k"
            )
        self.needle_counts = [int(value) for value in settings.get("needle_counts", [2, 3, 4, 5])]
        self.guide = bool(settings.get("guide", True))
        self.diff = int(settings.get("diff", 10))
        self.seed = int(settings.get("seed", 0))
        max_new = settings.max_new_tokens
        self.max_new_tokens = {kind: int(max_new[kind] if isinstance(max_new, Mapping) else max_new) for kind in KINDS}
        self.template = model.template(settings.prompt_format, PROMPT_FORMATS)
        self._line_ids: dict[tuple[str, int], list[int]] = {}
        self._orders: dict[str, list[list[int]]] = {}

    # --- data ----------------------------------------------------------------------------------

    def check_data(self) -> None:
        """Every file the subtasks read, in ``data_dir`` or cached or downloadable from the hub."""
        languages = sorted({subtask.split("_")[1] for subtask in self.subtasks})
        names = [NEEDLE_FILE, *(HAYSTACK_FILES[lang] for lang in languages)]
        names += [REASONING_FILES[lang] for lang in languages if f"reasoning_{lang}" in self.subtasks]
        for name in names:
            if self.settings.get("data_dir") is not None:
                self.data_file(name)
            else:
                check_hub_file(HUB_REPO, name, self.how_to_provide(name))

    @staticmethod
    def how_to_provide(name: str) -> str:
        return (
            f"download {name} (and the other files of the hub dataset {HUB_REPO}) into a folder and set "
            "task.data_dir=FOLDER"
        )

    def data_file(self, name: str) -> Path:
        """A NeedleBench file from ``task.data_dir`` or the hub dataset, or a one-line error."""
        data_dir = self.settings.get("data_dir")
        how = self.how_to_provide(name)
        if data_dir is None:
            return hub_file(HUB_REPO, name, how)
        path = resolve_path(data_dir) / name
        if not path.is_file():
            raise KVBenchError(f"NeedleBench file {name} not found in task.data_dir={data_dir}; {how}")
        return path

    @cached_property
    def needle_lines(self) -> list[str]:
        with self.data_file(NEEDLE_FILE).open(encoding="utf-8") as lines:
            return lines.readlines()

    def needles(self, language: str) -> list[dict[str, Any]]:
        found = [json.loads(line) for line in self.needle_lines if line.strip()]
        found = [entry for entry in found if entry["language"] == language]
        if not found:
            raise KVBenchError(f"{NEEDLE_FILE} has no {language} needle; check task.data_dir")
        return found

    def haystack(self, lang: str) -> list[dict[str, Any]]:
        return self._jsonl(HAYSTACK_FILES[lang])

    def reasoning_records(self, lang: str) -> list[dict[str, Any]]:
        path = self.data_file(REASONING_FILES[lang])
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise KVBenchError(f"{path} is not valid JSON ({error.msg}); expected NeedleBench's {path.name}") from None

    def _jsonl(self, name: str) -> list[dict[str, Any]]:
        cache = self.__dict__.setdefault("_jsonl_cache", {})
        if name not in cache:
            path = self.data_file(name)
            try:
                cache[name] = [
                    json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()
                ]
            except json.JSONDecodeError as error:
                raise KVBenchError(f"{path} is not valid jsonl ({error.msg}); expected NeedleBench's {name}") from None
            if not cache[name]:
                raise KVBenchError(f"{path} is empty; expected NeedleBench's {name}")
        return cache[name]

    # --- tokens and haystack -------------------------------------------------------------------

    def order(self, lang: str, repeat: int) -> list[int]:
        """Haystack record order of repeat ``repeat``: ``Random(c).shuffle`` for c = 0..repeat in turn."""
        orders = self._orders.setdefault(lang, [])
        while len(orders) <= repeat:
            current = list(orders[-1]) if orders else list(range(len(self.haystack(lang))))
            random.Random(len(orders)).shuffle(current)
            orders.append(current)
        return orders[repeat]

    def haystack_ids(self, lang: str, repeat: int, target: int) -> list[int]:
        """The first ``target`` tokens of the repeat's records, each tokenized on its own."""
        records, tokens = self.haystack(lang), []
        for index in self.order(lang, repeat):
            if (lang, index) not in self._line_ids:
                self._line_ids[(lang, index)] = self.model.encode(records[index]["text"])
            tokens.extend(self._line_ids[(lang, index)])
            if len(tokens) >= target:
                break
        return tokens[:target]

    def buffer(self, kind: str, lang: str) -> int:
        override = self.settings.get("length_buffer")
        return self.grid.buffers[kind][lang] if override is None else int(override)

    # --- samples -------------------------------------------------------------------------------

    def repeats(self, kind: str) -> int:
        value = self.settings.get("num_repeats")
        return REPEATS[kind] if value is None else int(value)

    def samples(self) -> Iterator[Sample]:
        """Subtask by subtask (reasoning: needle count first), then length, depth and repeat."""
        for subtask in self.subtasks:
            kind, lang = subtask.split("_")
            counts = self.needle_counts if kind == "reasoning" else [None]
            depths = self.depths if kind != "retrieval" else [None]
            for count in counts:
                for length in self.context_lengths:
                    for depth in depths:
                        for repeat in range(self.repeats(kind)):
                            yield self.sample(subtask, length, depth, repeat, count)

    def sample(self, subtask: str, length: int, depth: int | None, repeat: int, count: int | None = None) -> Sample:
        kind, lang = subtask.split("_")
        language = LANGUAGES[lang]
        if kind == "single":
            assert depth is not None  # samples() gives single and reasoning needles a depth
            context, question, answers, info = self._single(lang, length, depth, repeat)
            sample_id = f"{subtask}-L{length}-D{depth}-{repeat}"
        elif kind == "reasoning":
            assert depth is not None and count is not None  # and reasoning a needle count
            context, question, answers, info = self._reasoning(lang, length, depth, repeat, count)
            sample_id = f"{subtask}-{count}needle-L{length}-D{depth}-{repeat}"
        else:
            context, question, answers, info = self._retrieval(lang, length, repeat)
            sample_id = f"{subtask}-L{length}-{repeat}"
        if self.guide:
            question = guided_question(question, language, kind)
        ids = self.model.prompt_ids(self.template, needlebench_prompt(context, question, language, kind))
        return Sample(
            id=sample_id,
            subtask=subtask,
            input_ids=ids,
            answers=answers,
            max_new_tokens=self.max_new_tokens[kind],
            metadata={
                "kind": kind,
                "language": language,
                "context_length": length,
                "depth": depth,
                "repeat": repeat,
                "needle_count": count,
                **info,
            },
        )

    def _single(self, lang: str, length: int, depth: int, repeat: int):
        entry = random.Random(repeat).choice(self.needles(LANGUAGES[lang]))
        needle = "\n" + entry["needle"] + "\n"
        needle_ids = self.model.encode(needle)
        target = max(length - self.buffer("single", lang) - len(needle_ids), 0)
        haystack = self.haystack_ids(lang, repeat, target)
        point = int(len(haystack) * (depth / 100))
        context = self.model.decode(haystack[:point] + needle_ids + haystack[point:])
        return context, entry["retrieval_question"], [entry["arg2"]], {"needle": needle, "insertion_points": [point]}

    def _reasoning(self, lang: str, length: int, depth: int, repeat: int, count: int):
        matching = [record for record in self.reasoning_records(lang) if record.get("derivation_count") == count]
        if not matching:
            raise KVBenchError(
                f"{REASONING_FILES[lang]} has no record with derivation_count={count}; "
                "lower task.needle_counts or check task.data_dir"
            )
        record = random.Random(repeat).choice(matching)
        needles = [self.model.encode("\n" + needle + "\n") for needle in record["derivations"]]
        target = max(length - self.buffer("reasoning", lang) - sum(map(len, needles)), 0)
        haystack = self.haystack_ids(lang, repeat, target)
        total = len(haystack)
        points: list[int] = []
        for i, _tokens in enumerate(needles):
            if i == 0:
                point = int(total * (depth / 100))
            else:
                point = int(points[i - 1] + len(needles[i - 1]) + total * (self.diff / 100))
            points.append(min(point, total + sum(len(previous) for previous in needles[:i])))
        ids = list(haystack)
        for i, tokens in enumerate(needles):
            ids = ids[: points[i]] + tokens + ids[points[i] :]
            for j in range(i + 1, len(points)):
                points[j] += len(tokens)
        return self.model.decode(ids), record["question"], [record["answer"]], {"insertion_points": points}

    def _retrieval(self, lang: str, length: int, repeat: int):
        language = LANGUAGES[lang]
        chosen = unique_needles(self.needle_lines, len(self.depths), language, random.Random(self.seed))
        if not chosen:
            raise KVBenchError(f"{NEEDLE_FILE} has no {language} needle; check task.data_dir")
        rng = random.Random(repeat)
        rng.shuffle(list(range(len(self.haystack(lang)))))  # the loader's haystack shuffle, same stream
        chosen = list(chosen)
        rng.shuffle(chosen)
        needles = [self.model.encode("\n" + item["needle"] + "\n") for item in chosen]
        target = max(length - self.buffer("retrieval", lang) - sum(map(len, needles)), 0)
        haystack = self.haystack_ids(lang, repeat, target)
        points = [int(len(haystack) * (depth / 100)) for depth in self.depths]
        ids, inserted, placed = list(haystack), 0, []
        for point, tokens in zip(points, needles):
            at = min(point + inserted, len(ids))
            ids = ids[:at] + tokens + ids[at:]
            placed.append(at)
            inserted += len(tokens)
        question = retrieval_question(chosen, language)
        return self.model.decode(ids), question, [item["arg2"] for item in chosen], {"insertion_points": placed}

    # --- scoring -------------------------------------------------------------------------------

    def score(self, sample: Sample, prediction: str) -> float:
        kind = sample.metadata["kind"]
        if kind == "single":
            return single_needle_score(prediction, sample.metadata["needle"], sample.answers[0])
        if kind == "retrieval":
            return multi_retrieval_score(prediction, sample.answers)
        return multi_reasoning_score(prediction, sample.answers[0])

    def evaluate(self, sample: Sample, output: Any) -> dict[str, Any]:
        """Prediction and score plus the cell: ``context_length``, ``depth`` (null for retrieval),
        ``needle_count`` (reasoning) and ``language``."""
        return {
            **super().evaluate(sample, output),
            **{key: sample.metadata[key] for key in ("context_length", "depth", "needle_count", "language")},
        }

    def aggregate(self, records: list[dict]) -> dict[str, float]:
        """Subtasks, ``reasoning<N>_<lang>``, the kinds (en + zh) and ``overall`` (when all three kinds
        ran), each a plain mean of its datasets' mean scores, on 0-100."""
        datasets: dict[tuple, list[float]] = defaultdict(list)
        for record in records:
            key = (record["subtask"], record.get("needle_count"), record["context_length"], record.get("depth"))
            datasets[key].append(record["score"])
        means = {key: 100.0 * sum(values) / len(values) for key, values in datasets.items()}

        def average(keys) -> float:
            return sum(means[key] for key in keys) / len(keys)

        scores: dict[str, float] = {}
        for subtask in SUBTASKS:
            keys = [key for key in means if key[0] == subtask]
            if keys:
                scores[subtask] = average(keys)
        for subtask in ("reasoning_en", "reasoning_zh"):
            for count in sorted({key[1] for key in means if key[0] == subtask}):
                scores[f"reasoning{count}_{subtask[-2:]}"] = average(
                    [key for key in means if key[:2] == (subtask, count)]
                )
        for kind in KINDS:
            keys = [key for key in means if key[0].startswith(kind + "_")]
            if keys:
                scores[kind] = average(keys)
        if all(kind in scores for kind in KINDS):
            scores["overall"] = sum(weight * scores[kind] for kind, weight in OVERALL_WEIGHTS.items())
        return scores
