"""Hydra glue: validate command-line overrides and make composite options selectable.

``policy=h2o+obcache_joint`` and ``budget=3k`` name no YAML file. Before Hydra composes, every policy
option (each base, and every spec given for ``policy``, sweeps included) is registered in Hydra's
``ConfigStore`` with a node generated from the policy's dataclasses (:func:`policy_node`: the defaults are
defined once, in the dataclass), merged with the selected experiment's ``policy_settings`` for that base and
those modifiers; every budget as ``{spec}`` (conf/ holds no budget file). Bad values and unknown
``policy.<key>`` settings are rejected here with one line instead of a Hydra traceback.
"""

from __future__ import annotations

import re
from functools import cache, partial
from pathlib import Path
from typing import Any

import omegaconf._utils
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from kvbench import CONF_DIR, config_dict
from kvbench.budgets import Budget
from kvbench.errors import KVBenchError, choose
from kvbench.policies import BASES, MODIFIERS, build_policy, parse_spec, policy_keys, registered
from kvbench.rundir import config_loader, register_run_name

register_run_name()  # conf/config.yaml's ${run_name:}


def _the_one_store(store: ConfigStore, memo: dict) -> ConfigStore:
    """``ConfigStore`` is a singleton and its nodes are copied when loaded (``ConfigStore.load``), yet Hydra 1.3
    deep-copies it with the config repository at every composition (hydra#2928): each composition then copies every
    policy node registered so far (131 compositions of the registry: 17.2 s, shared 12.6 s). The store is shared."""
    return store


ConfigStore.__deepcopy__ = _the_one_store  # type: ignore[attr-defined]
#: every YAML file Hydra and OmegaConf read (``OmegaConf.load``: a composition reads about a dozen) through libyaml
#: with OmegaConf's resolvers (:func:`~kvbench.rundir.config_loader`, which reads every committed config and conf/
#: file as OmegaConf's own loader does); OmegaConf builds its pure-Python loader class anew at each read
omegaconf._utils.get_yaml_loader = config_loader

#: ``${policies:KIND[,TASKS[,MODE[,REGIME]]]}``'s TASKS: ``decoding`` (every modifier) or ``prefill`` (a task that
#: decodes nothing); MODE: the sweep's ``task.query_mode``; REGIME: its ``engine.regime`` (``any``: defined in one)
POLICY_TASKS = ("decoding", "prefill")
QUERY_MODES = ("aware", "agnostic")


def registered_policies(kind: str, tasks: str = "decoding", mode: str = "aware", regime: str = "any") -> str:
    """``${policies:variants}`` in a sweep's values: the registry's policies comma-joined, a Hydra choice sweep
    (:func:`kvbench.policies.registered`: ``bases``, ``variants``, every base alone and with each modifier that
    applies, or ``headwise``; kinds joined by ``+``; ``${policies:variants,prefill}`` without the modifiers that act
    only while decoding), so an
    experiment names no method by hand and a new method file joins it. Only the policies defined in the query
    ``mode`` (``aware``, or ``agnostic``: ``Policy.refusal``) under ``regime`` (``any``: in some regime); in
    ``agnostic`` a base defined only there (KVzip) comes with its variants even for ``bases``: it has no query-aware
    cells to hold them."""
    from kvbench.engine.settings import REGIMES

    choose("${policies:KIND,TASKS} TASKS", tasks, POLICY_TASKS)
    choose("${policies:KIND,TASKS,MODE} MODE", mode, QUERY_MODES)
    choose("${policies:KIND,TASKS,MODE,REGIME} REGIME", regime, ["any", *REGIMES])
    decoding, agnostic = tasks == "decoding", mode == "agnostic"
    regimes = REGIMES if regime == "any" else [regime]
    only_agnostic = {spec for spec in registered("bases") if not defined(spec, False) and defined(spec, True)}
    kinds = kind.split("+")  # bases+headwise: the bases and their head-wise variants
    chosen = {spec for part in kinds for spec in registered(part, decoding)}
    if kinds != ["headwise"]:
        chosen |= {
            spec for spec in registered("variants", decoding) if agnostic and parse_spec(spec)[0] in only_agnostic
        }
    return ",".join(
        spec for spec in registered("variants", decoding) if spec in chosen and defined(spec, agnostic, regimes)
    )


def defined(spec: str, query_agnostic: bool, regimes: list[str] | None = None) -> bool:
    """Whether the policy ``spec`` (its defaults) runs in one of ``regimes`` (default every regime),
    query-agnostically or not."""
    from kvbench.engine.settings import REGIMES

    policy = build_policy(spec)
    return any(policy.refusal(regime, query_agnostic) is None for regime in regimes or REGIMES)


if not OmegaConf.has_resolver("policies"):
    OmegaConf.register_new_resolver("policies", registered_policies)


def group_options(group: str) -> list[str]:
    """The YAML options of a config group (``conf/<group>/*.yaml``)."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def policy_node(spec: str, policy_settings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Hydra node of ``base+modifier+...``: every setting of the policy built with its dataclass defaults,
    overridden by ``policy_settings[base]``, then ``[modifier]`` for each modifier, then ``[spec]`` for the
    whole spec (an experiment's per-policy settings); ``name`` = the spec."""
    base, modifiers = parse_spec(spec)
    settings: dict[str, Any] = {}
    for part in (base, *modifiers, spec):
        settings.update((policy_settings or {}).get(part, {}))
    return build_policy(spec, settings).settings()


#: the node each policy option of the ``ConfigStore`` holds, as last registered (:func:`register_policies`)
_REGISTERED: dict[str, dict[str, Any]] = {}


def register_policies(specs: list[str], policy_settings: dict[str, dict[str, Any]] | None = None) -> None:
    """Register every base and each of ``specs`` as an option of Hydra's ``policy`` group (an option whose node is
    unchanged is not stored again: each composition registers every base)."""
    store = ConfigStore.instance()
    for spec in dict.fromkeys([*BASES, *specs]):
        node = policy_node(spec, policy_settings)
        if _REGISTERED.get(spec) != node or f"{spec}.yaml" not in store.repo.get("policy", {}):
            store.store(group="policy", name=spec, node=node)
            _REGISTERED[spec] = node


#: config groups selected with ``+GROUP=NAME`` that may bring ``policy_settings``: a paper's experiment and a
#: reference implementation's conventions (``conf/compat``)
SETTING_GROUPS = ("experiment", "compat")
#: the config groups of a run and their settings files (conf/<group>/<option>.yaml); ``policy`` is generated
GROUPS = ("model", "task", "budget", "logger")


def root_keys(config_name: str = "config") -> list[str]:
    """The keys of a composed ``conf/<config_name>.yaml``: its own (``defaults`` aside) and its groups'."""
    return sorted({*yaml_keys(f"{config_name}.yaml"), *GROUPS, "policy"})


@cache
def _selected_node(selections: tuple[tuple[str, str], ...]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    for group, name in selections:
        choose(group, name, group_options(group))
    register_policies([])
    register_budget(str(default_budget("config")))
    try:
        with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
            overrides = [f"+{group}={name}" for group, name in selections]
            return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except HydraException as error:
        names = " ".join(f"{group}={name}" for group, name in selections)
        raise KVBenchError(f"{names}: {str(error).splitlines()[0]}") from None


def experiment_config(experiment: str) -> DictConfig:
    """The run config that ``+experiment=NAME`` composes to (with its ``hydra`` node, for its sweep)."""
    return _selected_node((("experiment", experiment),)).copy()


def selected_policy_settings(selections: tuple[tuple[str, str], ...]) -> dict[str, dict[str, Any]]:
    """``policy_settings`` of the selected experiment and compat profile (``(group, name)`` in the order given,
    later ones winning): base, modifier or spec → its settings there."""
    if not selections:
        return {}
    node = _selected_node(selections).get("policy_settings")
    settings = config_dict(node, resolve=True) if node is not None else {}
    for part in settings:
        if part not in BASES and part not in MODIFIERS:
            parse_spec(part)  # a whole spec, e.g. cake+slake
    return settings


def _values(override) -> list[str]:
    """An override's value(s) as text, a quoted one without its quotes (``budget='10pct'`` is ``10pct``)."""
    if override.is_sweep_override():
        return [str(value) for value in override.sweep_string_iterator()]
    value = override.value()
    return [value if isinstance(value, str) else str(override.get_value_element_as_str())]


def prepare_overrides(args: list[str], config_name: str = "config") -> list[str]:
    """Validate ``args`` (Hydra overrides of ``conf/<config_name>.yaml``: every invalid value and unknown key at
    once), register the policy options (with the experiment's ``policy_settings``) and composite budgets, and
    return the overrides with budget values quoted (Hydra would read ``budget=64`` as an int, not an option
    name)."""
    try:
        overrides = OverridesParser.create().parse_overrides([arg for arg in args if not arg.startswith("-")])
    except HydraException as error:
        raise KVBenchError(f"cannot parse overrides {' '.join(args)!r}: {str(error).splitlines()[0]}") from None
    rewritten = [arg for arg in args if arg.startswith("-")]
    if (default := default_budget(config_name)) is not None:
        register_budget(default)
    selected: dict[str, list[str]] = {"policy": [], "task": [], "model": []}
    mistakes: list[str] = []  # every invalid value of every key, said at once
    own: dict[str, dict[str, Any]] = {}  # policy.<part>.<key>=VALUE: a base's or modifier's own settings

    def checked(check: Any, value: str) -> Any:
        try:
            return check(value)
        except KVBenchError as error:
            mistakes.append(str(error))
            return None

    top = sorted({*root_keys(config_name), "hydra", *SETTING_GROUPS})  # the keys an override's root may name
    for override in overrides:
        key, values = override.key_or_group.lstrip("+~"), _values(override)
        if not key:
            mistakes.append(f"{override.input_line!r} names no setting: write KEY=VALUE, e.g. budget=128")
            continue
        if override.key_or_group == key and re.split(r"[./]", key)[0] not in top:  # Hydra's "Could not override" else
            mistakes.append(f"unknown key {key} for the run config; valid keys: {', '.join(top)}")
            continue
        pieces = key.split(".")
        if len(pieces) == 3 and pieces[0] == "policy" and (pieces[1] in BASES or pieces[1] in MODIFIERS):
            if override.is_sweep_override():  # policy.<base or modifier>.<setting>: for the swept specs that have it
                mistakes.append(f"{key} is one method's setting: give it one value, not a sweep")
            own.setdefault(pieces[1], {})[pieces[2]] = override.value()
            continue
        if key == "budget":  # each named as Budget names it (budget=1e9, a float to Hydra, is 1000000000)
            values = [budget.spec for budget in [checked(Budget.parse, value) for value in values] if budget]
            rewritten.append(f"{override.get_key_element()}=" + ",".join(f"'{value}'" for value in values))
        elif key == "policy.layer_budget" and isinstance(override.value(), (dict, str)):  # replace the node
            node = override.value()
            text = override.get_value_element_as_str() if isinstance(node, dict) else f"{{name: {node}}}"
            rewritten += ["~policy.layer_budget", f"+policy.layer_budget={text}"]
        elif (
            key.split(".")[0] in ("policy", "task", "model", "engine", "generation")
            and "." in key
            and not override.is_delete()
        ):
            assert override.input_line is not None  # set by the parser
            rewritten.append("++" + override.input_line.lstrip("+"))  # checked once composed (kvbench.job)
        else:
            assert override.input_line is not None  # set by the parser
            rewritten.append(override.input_line)
        if key.split(".")[0] == "policy_settings":
            raise KVBenchError(
                f"{key} is an experiment's per-policy setting (conf/experiment); set policy.<key>=VALUE instead"
            )
        for value in values:
            checked(partial(_check_option, key), value)
            if key == "budget":
                register_budget(value)
        if key in selected:
            selected[key] = values
    selections = tuple(
        (o.key_or_group.lstrip("+"), o.get_value_element_as_str())
        for o in overrides
        if o.key_or_group.lstrip("+") in SETTING_GROUPS
    )
    parts: set[str] = set()  # the bases and modifiers of the specs run
    for spec in selected["policy"]:
        parts.update(parse_part(spec, checked))
    for part in own:
        if selected["policy"] and part not in parts:
            mistakes.append(f"policy.{part}.* sets {part}, which none of policy={','.join(selected['policy'])} has")
    if len(mistakes) == 1:
        raise KVBenchError(mistakes[0])
    if mistakes:
        raise KVBenchError(f"{len(mistakes)} mistakes: " + "  |  ".join(mistakes))
    settings = selected_policy_settings(selections)
    for part, chosen in own.items():  # the command line's win over an experiment's
        settings[part] = {**settings.get(part, {}), **chosen}
    register_policies(selected["policy"], settings)
    return rewritten


def parse_part(spec: str, checked: Any) -> list[str]:
    """The base and modifiers of ``spec`` (none where it does not parse: ``checked`` notes why)."""
    parsed = checked(parse_spec, spec)
    return [] if parsed is None else [parsed[0], *parsed[1]]


def _check_option(key: str, value: str) -> None:
    """A one-line error for an unknown option of a group (model, task) or a budget that does not parse; every
    other value is checked against its domain when the job is resolved (:func:`kvbench.job.resolve`)."""
    if key in ("model", "task"):
        choose(key, value, group_options(key))
    elif key == "budget":
        Budget.parse(value)


def register_budget(spec: str) -> None:
    """Make a budget (``budget=3k``) an option of Hydra's ``budget`` group: ``{spec}``. Budgets have no YAML files;
    every one is registered before Hydra composes (the command line's, an experiment's sweep, the defaults')."""
    ConfigStore.instance().store(group="budget", name=spec, node={"spec": spec})


@cache
def default_budget(config_name: str) -> str | None:
    """The budget ``conf/<config_name>.yaml``'s defaults list selects, if it selects one."""
    loaded = OmegaConf.load(CONF_DIR / f"{config_name}.yaml")
    assert isinstance(loaded, DictConfig)  # every conf file is a mapping
    for entry in loaded.get("defaults", []):
        if isinstance(entry, DictConfig) and "budget" in entry:
            return str(entry["budget"])
    return None


@cache
def yaml_keys(relative: str, node: str | None = None) -> tuple[str, ...]:
    """The keys (``defaults`` aside) of ``conf/<relative>``, or of its ``node``, sorted: read once per process (a
    sweep checks every job's keys against the same files)."""
    loaded = OmegaConf.load(CONF_DIR / relative)
    assert isinstance(loaded, DictConfig)  # every conf file is a mapping
    return tuple(sorted(str(key) for key in (loaded if node is None else loaded[node]) if key != "defaults"))


def group_keys(group: str, option: str) -> list[str]:
    """The settings of a config group's option: the keys of ``conf/<group>/<option>.yaml``, or of the
    generated node of a policy spec."""
    if group == "policy":
        return policy_keys(option)
    return list(yaml_keys(f"{group}/{option}.yaml"))


def engine_keys() -> list[str]:
    """The engine settings (conf/config.yaml's ``engine`` node)."""
    return list(yaml_keys("config.yaml", "engine"))


def compose(overrides: list[str], config_name: str = "config", return_hydra_config: bool = False) -> DictConfig:
    """Compose the run config outside ``hydra.main`` (for ``prepare``, ``bench`` and tests)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    overrides = prepare_overrides(overrides, config_name)
    with initialize_config_dir(config_dir=str(Path(CONF_DIR).resolve()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides, return_hydra_config=return_hydra_config)
