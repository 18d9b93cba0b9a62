"""kvbench's Hydra plugins (Hydra finds plugins only in the ``hydra_plugins`` namespace package).

* ``Sweeper`` (``hydra/sweeper=kvbench``, the default of conf/config.yaml): submits only the jobs whose run
  directory is not finished, reports every failed job (:mod:`kvbench.launch.sweeps`).
* ``SlurmLauncher`` and ``LocalLauncher`` (``hydra/launcher=slurm|local``): hydra-submitit-launcher's,
  naming the Slurm array after what it runs and collecting every job's outcome (:mod:`kvbench.launch.launchers`).

The classes only delegate, importing kvbench when used: Hydra imports this module on every start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper as HydraSweeper
from hydra_plugins.hydra_submitit_launcher import submitit_launcher


class Sweeper(HydraSweeper):
    """A sweeper on Hydra's public plugin API with the basic sweeper's keys (``params``: values swept as a cartesian
    product; ``max_batch_size``: jobs per launch, null or -1 all) and kvbench's skipping and reporting, ``group``: the
    jobs that differ only in policy and budget run in one process (:func:`kvbench.run.run_group`), and
    ``share_prefill``: a group prefills each sample once for its oneshot jobs (both set in
    ``conf/hydra/sweeper/kvbench.yaml``)."""

    def __init__(
        self, group: bool, share_prefill: bool, max_batch_size: int | None = None, params: dict[str, str] | None = None
    ):
        self.group, self.share_prefill = group, share_prefill
        self.max_batch_size, self.params = max_batch_size, params or {}
        self.hydra_context: Any = None
        self.config: Any = None
        self.launcher: Launcher | None = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        """Run the sweep of this config (``arguments`` are its command-line overrides, read from the config)."""
        from kvbench.launch.sweeps import run_sweep

        return run_sweep(self)


class KVBenchLaunch:
    """The ``launch`` of kvbench's submitit launchers (:func:`kvbench.launch.launchers.launch`)."""

    array_name: str | None = None  # the Slurm job name, set by the sweeper before each launch

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from kvbench.launch.launchers import launch

        return launch(self, job_overrides, initial_job_idx)


class SlurmLauncher(KVBenchLaunch, submitit_launcher.SlurmLauncher):
    """hydra-submitit-launcher's Slurm launcher: one array per sweep."""


class LocalLauncher(KVBenchLaunch, submitit_launcher.LocalLauncher):
    """hydra-submitit-launcher's local launcher: one process per job on this machine."""
