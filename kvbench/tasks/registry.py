"""Tasks by name: the class each ``conf/task/<name>.yaml`` builds (``_target_``)."""

from __future__ import annotations

import functools

from hydra.utils import get_class
from omegaconf import OmegaConf

from kvbench import CONF_DIR
from kvbench.tasks.base import TableLayout, Task


@functools.cache
def task_class(name: str) -> type[Task] | None:
    """The class of task ``name``, or None for a task this version does not know (a run from another, or a name
    that is not one of conf/task's file names: read out of a run directory, it is never a path)."""
    path = CONF_DIR / "task" / f"{name}.yaml"
    if path.parent != CONF_DIR / "task" or name.startswith(".") or not path.is_file():
        return None
    return get_class(str(OmegaConf.select(OmegaConf.load(path), "_target_")))


def tabled_tasks() -> dict[str, TableLayout]:
    """Each task that declares a table (:attr:`~kvbench.tasks.base.Task.table`), by name: its table."""
    names = sorted(path.stem for path in (CONF_DIR / "task").glob("*.yaml"))
    tasks = {name: task_class(name) for name in names}
    return {name: task.table for name, task in tasks.items() if task is not None and task.table is not None}
