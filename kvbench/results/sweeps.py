"""Experiment sweeps: ``kvbench run -m +experiment=NAME`` runs the sweep a ``conf/experiment`` file pins.

An experiment file (``# @package _global_``) pins a paper's protocol and lists its sweep in
``hydra.sweeper.params``. Hydra would hand those values to the sweeper unchecked — composite policies
such as ``h2o+caote`` would not be found and ``budget: 64`` would be read as an int — so before Hydra
starts they are turned into ordinary command-line sweep overrides (:func:`experiment_overrides`), which
``kvbench.config.prepare_overrides`` then validates and registers like typed ones. What the user typed
for the same key wins.
"""

from __future__ import annotations

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from kvbench.config import experiment_config

MULTIRUN_FLAGS = ("-m", "--multirun")


def sweeper_params(experiment: str) -> dict[str, str]:
    """``hydra.sweeper.params`` of ``conf/experiment/<experiment>.yaml`` (with the files it includes)."""
    cfg = experiment_config(experiment)
    return {str(key): str(value) for key, value in (cfg.hydra.sweeper.params or {}).items()}


def experiment_overrides(args: list[str]) -> list[str]:
    """``args`` with the sweep of the ``+experiment=NAME`` they select put in front, as overrides.

    Only for a multirun (``-m``); a single run of an experiment ignores its sweep, as Hydra does."""
    if not any(arg in MULTIRUN_FLAGS for arg in args):
        return args
    try:
        overrides = OverridesParser.create().parse_overrides([arg for arg in args if not arg.startswith("-")])
    except HydraException:
        return args  # prepare_overrides reports the parse error
    experiments = [o.get_value_element_as_str() for o in overrides if o.key_or_group == "experiment"]
    if not experiments:
        return args
    typed = {override.key_or_group for override in overrides}
    params = sweeper_params(experiments[-1])
    return [f"{key}={values}" for key, values in params.items() if key not in typed] + args


__all__ = ["experiment_overrides", "sweeper_params"]
