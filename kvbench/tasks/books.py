"""Perplexity on books: PG19 test books (StreamingLLM / OBCache Fig. 4) and Booksum chapters (CAOTE Table 4).

Each book is one sample: the tokenizer's BOS (if any) followed by the book's first ``max_tokens - 1``
tokens (null: the whole book), scored by the engine token by token (``engine.regime=streaming``, the
StreamingLLM protocol) or, with ``context_tokens=C``, as a prefix of C tokens prefilled under the budget
and a scored continuation. Records and aggregation are :class:`~kvbench.tasks.ppl.PerplexityTask`'s:
per-book PPL and per-position-bucket NLLs, and a token-weighted PPL over all books.

Sources, in order: ``task.path`` (one UTF-8 text file), ``task.data_dir`` (a folder of ``*.txt`` books,
sorted by name), else the hub through ``datasets`` (streamed: rows are read until ``num_samples`` books
qualify). A book qualifies with at least ``task.min_tokens`` tokens; a text met before is not scored
again. PG19 defaults to ``emozilla/pg19`` (the parquet copy OBCache cites; ``deepmind/pg19`` is a loading
script that ``datasets`` >= 4 no longer runs), Booksum to the chapter texts of ``kmfoda/booksum``.
Local files lose a Project Gutenberg header and footer if they have one. PPL-vs-position curves:
``kvbench plot RUN_DIR... --kind ppl`` (from the records' ``buckets``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from typing import Any

from kvbench import resolve_path
from kvbench.domains import PATH, SAMPLES, SEED, TEXT, TOKENS, integer, optional
from kvbench.errors import KVBenchError
from kvbench.hub import hub_online, hub_rows
from kvbench.tasks.base import ModelInfo, Sample, Task
from kvbench.tasks.ppl import PerplexityTask, read_text, strip_gutenberg

log = logging.getLogger(__name__)

CHARS_PER_TOKEN_BOUND = 12  # tokenizing this many characters per wanted token always yields enough tokens


class BookPerplexityTask(PerplexityTask):
    """Options: ``path``, ``data_dir``, ``hf_id``, ``hf_config``, ``hf_split``, ``text_field``, ``title_field``,
    ``num_samples`` (books; null = all), ``max_tokens`` (per book), ``min_tokens`` (shorter books are skipped),
    ``context_tokens``, ``bucket_size``."""

    name = "books"
    what = "books"
    domains = {
        "subtasks": optional(TEXT, "one subtask, the task's name"),
        "path": optional(PATH, "the dataset"),
        "data_dir": optional(PATH, "the hub"),
        "hf_id": TEXT,
        "hf_config": optional(TEXT, "the dataset's default"),
        "hf_split": TEXT,
        "text_field": TEXT,
        "title_field": TEXT,
        "num_samples": optional(SAMPLES, "every text"),
        "max_tokens": optional(integer(2, "a token count"), "the whole text"),
        "min_tokens": optional(TOKENS, "any length"),
        "context_tokens": integer(0, "a token count"),
        "bucket_size": TOKENS,
        "seed": SEED,
    }

    def __init__(self, settings: Mapping[str, Any], model: ModelInfo):
        Task.__init__(self, settings, model)
        settings = self.settings  # read once, plain values
        self.read_window_options(settings)
        num_samples = settings.get("num_samples")
        self.num_samples = None if num_samples is None else int(num_samples)
        self.min_tokens = 0 if settings.min_tokens is None else int(settings.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise KVBenchError(
                f"task.min_tokens={self.min_tokens} is above task.max_tokens={self.max_tokens}: no "
                f"{self.what} would be left; lower it"
            )
        self.path = None if settings.get("path") is None else resolve_path(settings.path)
        self.data_dir = None if settings.get("data_dir") is None else resolve_path(settings.data_dir)
        if self.path is not None and not self.path.is_file():
            raise KVBenchError(
                f"task.path {self.path} is not a file; set task.path=FILE (a UTF-8 text file) or task.path=null"
            )
        if self.path is None and self.data_dir is not None and not sorted(self.data_dir.glob("*.txt")):
            raise KVBenchError(
                f"task.data_dir {self.data_dir} holds no *.txt {self.what}; put one UTF-8 text file per book there "
                "or set task.data_dir=null to load them from the hub"
            )

    def check_data(self) -> None:
        """The hub reachable when neither ``path`` nor ``data_dir`` is given (the constructor checked those)."""
        if self.path is None and self.data_dir is None and not hub_online():
            raise KVBenchError(
                f"the hub dataset {self.settings.hf_id} cannot be streamed: the hub is unreachable; "
                f"{self.how_to_provide()}"
            )

    def how_to_provide(self) -> str:
        return f"put {self.what} as UTF-8 *.txt files in a folder and set task.data_dir=FOLDER (or task.path=FILE)"

    def books(self) -> Iterator[tuple[str, str]]:
        """(title, text) of every candidate book in order, read as they are taken."""
        if self.path is not None:
            yield self.path.stem, strip_gutenberg(read_text(self.path))
            return
        if self.data_dir is not None:
            for path in sorted(self.data_dir.glob("*.txt")):
                yield path.stem, strip_gutenberg(read_text(path))
            return
        settings = self.settings
        field, title_field = settings.get("text_field", "text"), settings.get("title_field")
        for index, row in enumerate(
            hub_rows(settings.hf_id, settings.get("hf_split", "test"), self.how_to_provide(), settings.get("hf_config"))
        ):
            if field not in row:
                raise KVBenchError(
                    f"the hub dataset {settings.hf_id} has no column {field!r} (columns: {', '.join(row)}); "
                    "set task.text_field"
                )
            title = row.get(title_field) if title_field is not None else None
            yield str(title or f"{self.name}-{index}"), row[field]

    def book_ids(self, text: str) -> list[int]:
        """BOS (if the tokenizer has one) and the first ``max_tokens - 1`` tokens of the text."""
        tokenizer = self.model.tokenizer
        prefix = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
        if self.max_tokens is None:
            return prefix + self.model.encode(text)
        wanted = self.max_tokens - len(prefix)
        head = text[: wanted * CHARS_PER_TOKEN_BOUND + 64]  # spare the tokenizer a 400k-character book
        ids = self.model.encode(head)
        if len(ids) < wanted and len(head) < len(text):
            ids = self.model.encode(text)
        return prefix + ids[:wanted]

    def samples(self) -> Iterator[Sample]:
        """The first ``num_samples`` books with at least ``min_tokens`` tokens (and more than ``context_tokens``),
        ids ``<task>-<index>`` by position among the candidates; a text seen before is skipped (Booksum lists a
        chapter once per summary source)."""
        yielded, seen = 0, set()
        for index, (title, text) in enumerate(self.books()):
            digest = hashlib.sha256(text.encode("utf-8")).digest()
            ids = [] if digest in seen else self.book_ids(text)
            seen.add(digest)
            if len(ids) <= max(self.context_tokens, 1) or len(ids) < self.min_tokens:
                continue
            yielded += 1
            yield Sample(
                id=f"{self.name}-{index}",
                subtask=self.name,
                input_ids=ids,
                mode="perplexity",
                context_tokens=self.context_tokens,
                metadata={"book": title},
            )
            if yielded == self.num_samples:
                break
        if not yielded:
            raise KVBenchError(
                f"no {self.what} with more than task.context_tokens={self.context_tokens} and at least "
                f"task.min_tokens={self.min_tokens} tokens; lower them or add books"
            )
        if self.num_samples is not None and yielded < self.num_samples:
            log.warning(
                "%s: only %d of task.num_samples=%d %s are long enough", self.name, yielded, self.num_samples, self.what
            )


class PG19Task(BookPerplexityTask):
    """PG19 test books (Rae et al., 2019): ``emozilla/pg19`` test split by default."""

    name = "pg19"
    what = "PG19 test books"


class BooksumTask(BookPerplexityTask):
    """Booksum chapters (Kryściński et al., 2021): the ``chapter`` texts of ``kmfoda/booksum``."""

    name = "booksum"
    what = "Booksum chapters"
