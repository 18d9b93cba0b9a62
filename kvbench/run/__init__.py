"""``kvbench run``: one model × policy × budget × task, written to a resumable run directory; a sweep's jobs that
differ only in policy and budget as one group. Its files: ``progress`` (progress bars and lines), ``factories`` (a
job's task and engine), ``records`` (each sample's record, the run's metrics), ``schedule`` (samples as rows),
``lifecycle`` (a run opened and finished in its directory), ``group`` (a group's shared model, prefills and rows;
a single job runs as a group of one). Its names are imported when first read (:func:`kvbench.lazy_exports`)."""

from typing import TYPE_CHECKING

from kvbench import lazy_exports

if TYPE_CHECKING:
    from kvbench.run.factories import (
        build_engine,
        build_task,
        checked_task,
        local_tokenizer,
        stop_ids,
        tokenizer_or_stand_in,
    )
    from kvbench.run.group import run, run_group
    from kvbench.run.progress import LOG_FORMAT, SweepProgress
    from kvbench.run.records import result_line, summarize
    from kvbench.run.schedule import context_groups, context_rows, in_sample_order, run_sample, samples_batch

__all__ = [
    "LOG_FORMAT",
    "SweepProgress",
    "build_engine",
    "build_task",
    "checked_task",
    "context_groups",
    "context_rows",
    "in_sample_order",
    "local_tokenizer",
    "result_line",
    "run",
    "run_group",
    "run_sample",
    "samples_batch",
    "stop_ids",
    "summarize",
    "tokenizer_or_stand_in",
]
__getattr__ = lazy_exports(
    __name__,
    {
        "build_engine": "factories",
        "build_task": "factories",
        "checked_task": "factories",
        "local_tokenizer": "factories",
        "stop_ids": "factories",
        "tokenizer_or_stand_in": "factories",
        "run": "group",
        "run_group": "group",
        "LOG_FORMAT": "progress",
        "SweepProgress": "progress",
        "result_line": "records",
        "summarize": "records",
        "context_groups": "schedule",
        "context_rows": "schedule",
        "in_sample_order": "schedule",
        "run_sample": "schedule",
        "samples_batch": "schedule",
    },
)
