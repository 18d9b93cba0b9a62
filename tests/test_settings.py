"""Every setting has a domain, checked before anything runs: walked from the registries and the engine, model
and run tables, so a new policy, modifier, layer budget or setting is covered without editing this file.

For each setting a wrong type, a negative number, zero, an out-of-set value and a non-whole number are
tried. A value outside the domain: ``kvbench run`` exits 2 with one line naming the setting, the value and the
domain, and ``kvbench plan -m`` marks that job invalid. A value inside it is meaningful: the domain (shown by
``kvbench policies``) says what it means, and the built policy holds it as given, not replaced.
"""

from __future__ import annotations

import copy
import json
import pickle
from dataclasses import fields
from typing import Any

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf, open_dict

from kvbench import CONF_DIR
from kvbench.cli import main
from kvbench.config import compose, engine_keys, group_keys, group_options
from kvbench.domains import Domain, Settings, domains_of, shown
from kvbench.engine.settings import CACHE_SETTINGS, ENGINE_SETTINGS
from kvbench.errors import KVBenchError
from kvbench.job import GENERATION_SETTINGS, RUN_SETTINGS, resolve
from kvbench.models import MODEL_SETTINGS
from kvbench.policies import BASES, MODIFIERS, build_policy, composable
from kvbench.policies.layer_budget import LAYER_BUDGETS
from tests.helpers import refused

RUN = ["model=tiny_llama", "budget=64"]
RULER = ["task=ruler", "task.subtasks=[niah_single_1]", "task.num_samples=1"]

#: (typed on the command line, the value Hydra gives the setting)
CANDIDATES: list[tuple[str, Any]] = [("abc", "abc"), ("-1", -1), ("0", 0), ("nope", "nope"), ("1.5", 1.5)]

#: fields that are not settings of their own (the composed modifiers; the layer budget, a node of its own)
STRUCTURAL = {"modifiers", "layer_budget"}


def setting_cases() -> list[tuple[str, list[str], str, type, Domain]]:
    """(label, overrides selecting the part, the setting's key, the part's class, its domain) for every
    setting of every base, modifier and layer budget."""
    cases = []
    for name, cls in sorted(BASES.items()):
        for key, domain in domains_of(cls).items():
            cases.append((f"{name}.{key}", [f"policy={name}"], f"policy.{key}", cls, domain))
    for name, cls in sorted(MODIFIERS.items()):
        base = next(base for base in sorted(BASES) if composable(base, name))
        for key, domain in domains_of(cls).items():
            cases.append((f"{name}.{key}", [f"policy={base}+{name}"], f"policy.{key}", cls, domain))
    for name, cls in sorted(LAYER_BUDGETS.items()):
        for key, domain in domains_of(cls).items():
            overrides = ["policy=snapkv", f"policy.layer_budget={name}"]
            cases.append((f"layer_budget.{name}.{key}", overrides, f"policy.layer_budget.{key}", cls, domain))
    return cases


def table_cases() -> list[tuple[str, list[str], str, type | None, Domain]]:
    """The same for every engine, model and top-level setting of a run and every setting of every task."""
    tables = [("engine.", ENGINE_SETTINGS), ("cache.", CACHE_SETTINGS), ("model.", MODEL_SETTINGS), ("", RUN_SETTINGS)]
    cases = [
        (f"{prefix}{key}", RULER, f"{prefix}{key}", None, domain)
        for prefix, table in tables
        for key, domain in table.items()
    ]
    for task in group_options("task"):
        cls = task_class(task)
        selection = [f"task={task}"]
        cases += [(f"{task}.{key}", selection, f"task.{key}", cls, domain) for key, domain in cls.domains.items()]
    return cases


def task_class(option: str) -> type:
    return get_class(str(OmegaConf.load(CONF_DIR / "task" / f"{option}.yaml")["_target_"]))


CASES = setting_cases() + table_cases()


@pytest.mark.parametrize("task", group_options("task"))
def test_every_task_setting_declares_its_domain(task):
    undeclared = set(group_keys("task", task)) - {"name", "_target_"} - set(task_class(task).setting_domains())
    assert undeclared == set(), f"task {task}: settings without a domain (Task.domains)"


def test_every_engine_model_and_run_setting_declares_its_domain():
    assert sorted(ENGINE_SETTINGS) == engine_keys()
    for model in group_options("model"):
        assert set(group_keys("model", model)) <= set(MODEL_SETTINGS), model
    top = OmegaConf.load(CONF_DIR / "config.yaml")
    groups = ("defaults", "hydra", "engine", "generation", "cache", "policy_settings")
    assert {str(key) for key in top if key not in groups} == set(RUN_SETTINGS)
    assert set(top.generation) == set(GENERATION_SETTINGS)
    assert set(top.cache) == set(CACHE_SETTINGS)


@pytest.mark.parametrize("cls", [*BASES.values(), *MODIFIERS.values(), *LAYER_BUDGETS.values()])
def test_every_setting_declares_its_domain(cls):
    undeclared = [item.name for item in fields(cls) if item.name not in STRUCTURAL and "domain" not in item.metadata]
    assert undeclared == [], f"{cls.__name__}: settings without a domain (kvbench.domains.setting)"


def task_of(selection: list[str]) -> list[str]:
    """RULER's overrides, unless ``selection`` picks a task of its own."""
    return [] if any(override.startswith("task") for override in selection) else RULER


def built_value(selection: list[str], key: str, value: Any) -> Any:
    """The value the policy built from ``selection`` and ``key=value`` holds for the setting; for an engine,
    model or run setting, the value in the config the job runs with."""
    if not selection[0].startswith("policy="):
        config = resolve(compose([*RUN, *selection, f"{key}={shown(value)}"])).cfg
        return OmegaConf.select(config, key)
    spec = selection[0].removeprefix("policy=")
    params: dict[str, Any] = {}
    if key.startswith("policy.layer_budget."):
        params["layer_budget"] = {"name": selection[1].split("=")[1], key.rsplit(".", 1)[1]: value}
        return getattr(build_policy(spec, params).layer_budget, key.rsplit(".", 1)[1])
    name = key.removeprefix("policy.")
    policy = build_policy(spec, {name: value})
    part = next(part for part in [policy, *policy.modifiers] if name in {item.name for item in fields(part)})
    return getattr(part, name)


@pytest.mark.parametrize(("label", "selection", "key", "cls", "domain"), CASES, ids=[case[0] for case in CASES])
def test_a_value_outside_the_domain_is_refused_in_one_line_and_one_inside_is_built_as_given(
    label, selection, key, cls, domain
):
    """Each candidate set in the composed run config, which the job resolves as ``kvbench run`` and ``plan`` do
    (:func:`~kvbench.job.resolve`): one outside the domain is the one line naming the setting, the value and the
    domain; one inside it is built as given (another setting's refusal it may meet is not about this one)."""
    composed = compose([*RUN, *task_of(selection), *selection])
    for typed, value in CANDIDATES:
        cfg = copy.deepcopy(composed)
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value, merge=False)
        if domain.accepts(value):  # meaningful: documented by the domain, and built as given
            try:
                resolve(cfg)
            except KVBenchError as error:  # another setting's refusal (a window the budget cannot hold ...)
                assert not str(error).startswith(f"{key}="), error
            assert built_value(selection, key, value) == value, f"{key}={typed} was replaced"
        else:
            with pytest.raises(KVBenchError) as error:
                resolve(cfg)
            assert str(error.value) == f"{key}={shown(value)}: must be {domain.text}"


#: one setting of each kind through the command line (the rest: the resolved config, above)
CLI_CASES = [
    case
    for case in CASES
    if case[0]
    in {
        "snapkv.window",
        "caote.power",
        "layer_budget.pyramid.beta",
        "engine.block_size",
        "model.seed",
        "seed",
        "ruler.num_samples",
    }
]


@pytest.mark.parametrize(("label", "selection", "key", "cls", "domain"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_a_value_outside_the_domain_is_one_line_and_exit_2(label, selection, key, cls, domain, capsys, tmp_path):
    """``kvbench plan -m`` over the candidates marks exactly those outside the domain invalid, with the one line
    ``kvbench run`` exits 2 with (nothing written)."""
    task = task_of(selection)
    typed_values = ",".join(typed for typed, _ in CANDIDATES)
    with pytest.raises(SystemExit) as exit_info:  # some candidate is outside every domain
        main(["plan", "-m", *RUN, *task, *selection, f"{key}={typed_values}"])
    assert exit_info.value.code == 2
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == len(CANDIDATES)
    for line, (typed, value) in zip(lines, CANDIDATES):
        assert f"{key}={typed}" in [override.lstrip("+") for override in line["overrides"]]
        if domain.accepts(value):
            assert not any(error.startswith(f"{key}=") for error in line["errors"]), line["errors"]
        else:
            assert line["errors"] == [f"{key}={shown(value)}: must be {domain.text}"]
    typed, value = next((typed, value) for typed, value in CANDIDATES if not domain.accepts(value))
    run = ["run", *RUN, *task, *selection, f"{key}={typed}", f"output_dir={tmp_path / 'run'}"]
    assert refused(capsys, run, tmp_path / "run") == f"kvbench: error: {key}={shown(value)}: must be {domain.text}\n"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("snapkv+caote+caote", "policy 'snapkv+caote+caote' names the modifier 'caote' twice; name it once"),
        (
            "sink+caote",
            "policy 'sink+caote': the modifier 'caote' does not apply to 'sink' (sink ranks tokens by position, "
            "with no attention score for caote to re-rank)",
        ),
        ("full+calidrop", "policy 'full+calidrop': the modifier 'calidrop' does not apply to 'full' (full evicts "),
        (
            "h2o+obcache_key+obcache_value",
            "policy 'h2o+obcache_key+obcache_value': obcache_key and obcache_value each replace the per-query "
            "contributions and only the last would count; use one of them",
        ),
    ],
)
def test_a_spec_naming_a_modifier_twice_or_where_it_does_not_apply_is_refused(spec, message, capsys):
    for command in (["run", *RUN, *RULER, f"policy={spec}"], ["plan", *RUN, *RULER, f"policy={spec}"]):
        assert message in refused(capsys, command)


def test_a_tasks_settings_are_plain_read_only_values_by_key_or_attribute():
    """What a task receives of the resolved job (``kvbench.domains.Settings``): a Hydra node's values read once into
    plain ones (interpolations resolved, lists as lists), by key or attribute, read-only, copied and pickled whole."""
    node = OmegaConf.create(
        {"context_length": 1024, "twice": "${context_length}", "subtasks": ["a", "b"], "n": {"k": 1}}
    )
    settings = Settings(node)
    assert settings == Settings(settings.to_dict())
    assert settings.twice == settings["twice"] == 1024 and settings.subtasks == ["a", "b"] and settings.n.k == 1
    assert type(settings.subtasks) is list and settings.get("missing") is None
    assert copy.deepcopy(settings).to_dict() == pickle.loads(pickle.dumps(settings)).to_dict() == settings.to_dict()
    with pytest.raises(AttributeError, match="no setting 'missing'"):
        _ = settings.missing
    with pytest.raises(AttributeError, match="read-only"):
        settings.context_length = 2048
