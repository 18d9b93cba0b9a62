"""Hydra glue: validate command-line overrides and make composite options selectable.

``policy=h2o+obcache_joint`` and ``budget=3k`` name no YAML file; before Hydra composes, every value
given for ``policy`` or ``budget`` (sweeps included) is registered in Hydra's ``ConfigStore``: a policy
spec as its base's YAML merged with each modifier's YAML (``conf/modifier/``), a budget as ``{spec}``.
Bad values are rejected here with one line instead of a Hydra traceback.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from kvbench import CONF_DIR
from kvbench.errors import KVBenchError, choose
from kvbench.policies import parse_spec
from kvbench.policies.budgets import Budget


def group_options(group: str) -> list[str]:
    """The YAML options of a config group (``conf/<group>/*.yaml``)."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def policy_node(spec: str) -> DictConfig:
    """The config of ``base+modifier+...``: the base's YAML, then each modifier's, ``name`` = the spec."""
    base, modifiers = parse_spec(spec)
    parts = [OmegaConf.load(CONF_DIR / "policy" / f"{base}.yaml")]
    for modifier in modifiers:
        path = CONF_DIR / "modifier" / f"{modifier}.yaml"
        parts.append(OmegaConf.load(path) if path.exists() else OmegaConf.create())
    node = OmegaConf.merge(*parts)
    node.name = spec
    return node


def _values(override) -> list[str]:
    if override.is_sweep_override():
        return [str(value) for value in override.sweep_string_iterator()]
    return [str(override.get_value_element_as_str())]


def prepare_overrides(args: list[str]) -> list[str]:
    """Validate ``args`` (Hydra overrides), register composite policy / budget options, and return the
    overrides with budget values quoted (Hydra would read ``budget=64`` as an int, not an option name)."""
    try:
        overrides = OverridesParser.create().parse_overrides([arg for arg in args if not arg.startswith("-")])
    except HydraException as error:
        raise KVBenchError(f"cannot parse overrides {' '.join(args)!r}: {str(error).splitlines()[0]}") from None
    store = ConfigStore.instance()
    rewritten = [arg for arg in args if arg.startswith("-")]
    for override in overrides:
        key = override.key_or_group.lstrip("+~")
        values = _values(override)
        if key == "budget":
            rewritten.append(f"{override.get_key_element()}=" + ",".join(f"'{value}'" for value in values))
        else:
            rewritten.append(override.input_line)
        for value in values:
            if key in ("model", "task"):
                choose(key, value, group_options(key))
            elif key == "policy":
                node = policy_node(value)
                if value not in group_options("policy"):
                    store.store(group="policy", name=value, node=node)
            elif key == "budget":
                Budget.parse(value)
                if value not in group_options("budget"):
                    store.store(group="budget", name=value, node={"spec": value})
            elif key == "engine.regime":
                from kvbench.engine import REGIMES

                choose("engine.regime", value, REGIMES)
    return rewritten


def compose(overrides: list[str], config_name: str = "config") -> DictConfig:
    """Compose the run config outside ``hydra.main`` (for ``prepare``, ``bench`` and tests)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    overrides = prepare_overrides(overrides)
    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides)
