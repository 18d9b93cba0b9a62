"""One job (model × policy × budget × task), resolved before any weight is loaded: the settings that run.

:func:`resolve` is the one place on the run path where per-model settings are applied: it checks that every
setting of the composed config is read by some part of the job (a typo is a one-line error naming the valid
keys), builds the policy and fills in its per-model values (CAKE's τ, SLAKE's VABS α/β, keyed by the
model's Hugging Face id) and the task's (LongBench's truncation length), and returns the config as it runs.
``kvbench run`` writes that config to the run directory's ``config.yaml``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from kvbench import config_dict
from kvbench.budgets import Budget
from kvbench.config import GROUPS, engine_keys, group_keys, group_options, root_keys
from kvbench.domains import FLAG, Domain, check_table, choice, integer, number
from kvbench.engine.kivi import Kivi, kivi_of
from kvbench.engine.refusals import settings_refusal
from kvbench.engine.sampling import Sampling
from kvbench.engine.settings import CACHE_SETTINGS, ENGINE_SETTINGS, evicts_decoding
from kvbench.errors import KVBenchError, check_keys, choose
from kvbench.models import MODEL_SETTINGS, ModelSpec
from kvbench.policies import build_policy
from kvbench.policies.base import Policy
from kvbench.policies.layer_budget import check_layer_budget_keys
from kvbench.rundir import RESUME_MODES
from kvbench.tasks.base import Task

#: the prompt length against which a fraction budget is checked before any prompt exists (an int budget is
#: checked against a prompt of ten times it); the engine checks every real prompt again
NOMINAL_PROMPT = 100_000

#: how a run decodes (``generation.<key>``, conf/config.yaml; kvbench/engine/sampling.py) and the domains
GENERATION_SETTINGS: dict[str, Domain] = {
    "do_sample": FLAG,
    "temperature": number(0.0, low_open=True),
    "top_p": number(0.0, 1.0, low_open=True),
    "num_samples": integer(1, "a count of traces per problem"),
    "seed": integer(0),
}

#: the top-level settings of a run (conf/config.yaml) that take a value of their own, and their domains
RUN_SETTINGS: dict[str, Domain] = {
    "seed": integer(0),
    "resume": choice(*RESUME_MODES),
    "output_dir": Domain("a directory", lambda value: isinstance(value, str) and value != ""),
}


@dataclass(frozen=True)
class EngineSettings:
    """How a job's engine runs (``engine.*``, ``cache.*``, ``generation.*``), read once from its resolved config:
    the regime and whether it evicts while decoding (the regime's default applied), the cache's representation, how
    tokens are drawn, and the settings that change no prediction (rows, threads)."""

    regime: str
    block_size: int
    decode_evict: bool
    decode_interval: int
    score_block: int | str
    batch_size: int | str
    rows_attention: str
    sums_kernel: str
    threads: int | str
    save_kept: bool
    #: the cache's quantisation (``cache.quant``), or None: as the model gives it
    quant: Kivi | None
    #: how tokens are drawn (``generation``), or None: greedily
    sampling: Sampling | None

    @staticmethod
    def of(settings: Mapping[str, Any]) -> EngineSettings:
        """A resolved run config's (plain) settings, as the engine reads them."""
        engine, generation = settings["engine"], settings["generation"]
        sampling = None
        if generation["do_sample"]:
            sampling = Sampling(float(generation["temperature"]), float(generation["top_p"]), int(generation["seed"]))
        return EngineSettings(
            regime=engine["regime"],
            block_size=engine["block_size"],
            decode_evict=evicts_decoding(engine["regime"], engine.get("decode_evict")),
            decode_interval=engine["decode_interval"],
            score_block=engine["score_block"],
            batch_size=engine["batch_size"],
            rows_attention=engine["rows_attention"],
            sums_kernel=engine["sums_kernel"],
            threads=engine["threads"],
            save_kept=engine["save_kept"],
            quant=kivi_of(settings["cache"]),
            sampling=sampling,
        )

    @property
    def label_suffix(self) -> str:
        """What a run's label adds to its policy's: ``+kivi2`` for a quantised cache, else nothing."""
        return "" if self.quant is None else f"+kivi{self.quant.bits}"


@dataclass(frozen=True)
class Job:
    """A resolved job: ``cfg`` as it runs (plain values, per-model settings filled in; the run directory it is written
    to set in it), the model's spec, the built policy, the budget and the engine's settings. What runs it receives its
    typed part: a task its ``task.*`` values (:class:`~kvbench.domains.Settings`), a model load its
    :class:`~kvbench.models.ModelSpec`, the engine :class:`EngineSettings`, the run directory :attr:`settings`."""

    cfg: DictConfig
    model: ModelSpec
    policy: Policy
    budget: Budget
    engine: EngineSettings

    @property
    def settings(self) -> dict[str, Any]:
        """The job's settings as plain values (``config.yaml``'s): what the run directory and the logger receive."""
        return config_dict(self.cfg, resolve=True)

    @property
    def label(self) -> str:
        """The name results give the run's cells: the policy's label, then a quantised cache's (``snapkv+kivi2``)."""
        return self.policy.label + self.engine.label_suffix


def resolve(cfg: DictConfig) -> Job:
    """Validate every setting of the composed run config and resolve its per-model settings."""
    settings = config_dict(cfg, resolve=True)
    settings.pop("hydra", None)
    check_settings(settings)
    budget = Budget.parse(settings["budget"]["spec"])
    policy = build_policy(settings["policy"]["name"], settings["policy"])
    policy.for_model(settings["model"].get("hf_id"), budget)
    if budget.in_bytes and not policy.bounded:
        raise KVBenchError(
            f"budget={settings['budget']['spec']}: policy {policy.spec} keeps whole layers or heads whatever the "
            "budget, so bytes cannot bound it; valid choices: a token count (384, 2k) or a prompt fraction (10pct); "
            "its records carry the bytes it held"
        )
    if not budget.in_bytes:  # a byte budget's tokens depend on the model's cache: checked per prompt
        nominal = NOMINAL_PROMPT if budget.tokens is None else 10 * budget.tokens
        policy.check_budget(budget.resolve(nominal), nominal)
    engine = EngineSettings.of(settings)
    if engine.decode_interval > 1 and not engine.decode_evict:
        raise KVBenchError(
            f"engine.decode_interval={engine.decode_interval} spaces the evictions while decoding, and this run "
            f"does not evict while it decodes (engine.regime={engine.regime}); set engine.regime=streaming or "
            "engine.decode_evict=true"
        )
    agnostic = settings["task"].get("query_mode") == "agnostic"
    if (refusal := settings_refusal(policy, engine.regime, agnostic, engine.decode_evict, engine.quant)) is not None:
        raise KVBenchError(refusal)
    settings["policy"] = policy.settings()
    task_class = task_of(settings["task"]["_target_"])
    task_class.check(settings["task"])
    settings["task"] = task_class.for_model(settings["task"], settings["model"])
    return Job(OmegaConf.create(settings), ModelSpec.of(settings["model"]), policy, budget, engine)


def task_of(target: str) -> type[Task]:
    """The task class ``task._target_`` names (conf/task/<name>.yaml's, or a researcher's own), or a one-line error
    where it names no :class:`~kvbench.tasks.base.Task` class."""
    module, _, name = str(target).rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError, ValueError):
        found = None
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise KVBenchError(f"task._target_={target!r} is not a task class (a Task, e.g. kvbench.tasks.ruler.RulerTask)")
    return found


def check_settings(settings: dict[str, Any]) -> None:
    """Every key known (:func:`check_known_keys`) and every top-level, engine and model value in its domain;
    policy and task values are checked when they are built."""
    check_table(settings, RUN_SETTINGS, "")
    check_table(settings["engine"], ENGINE_SETTINGS, "engine.")
    check_table(settings["generation"], GENERATION_SETTINGS, "generation.")
    check_table(settings["cache"], CACHE_SETTINGS, "cache.")
    if settings["generation"]["num_samples"] > 1 and not settings["generation"]["do_sample"]:
        raise KVBenchError(
            f"generation.num_samples={settings['generation']['num_samples']} draws as many traces of a problem, "
            "which greedy decoding makes alike; set generation.do_sample=true"
        )
    check_table(settings["model"], MODEL_SETTINGS, "model.")
    for group in GROUPS:
        name = settings[group].get("name") if group != "budget" else None
        if name is not None:
            choose(f"{group}.name", name, group_options(group))
    check_known_keys(settings)


def check_known_keys(settings: dict[str, Any]) -> None:
    """The one check of a composed config's keys: a one-line error for a setting no part of the job reads
    (added with ``+key=``, ``key=`` or by an experiment file): top-level keys, ``engine.*``, each group's keys
    against its YAML, the policy's against its parts and ``policy.layer_budget.*`` against its strategy. A
    sweep runs it on every job before submitting any (a typed key is wrong in every job)."""
    check_keys(settings, root_keys(), "", "the run config")
    check_keys(settings["engine"], engine_keys(), "engine.", "the engine")
    check_keys(settings["generation"], list(GENERATION_SETTINGS), "generation.", "generation")
    check_keys(settings["cache"], list(CACHE_SETTINGS), "cache.", "the cache")
    for group in (*GROUPS, "policy"):
        name = settings[group].get("name") if group != "budget" else None
        if group != "policy" and name is not None and name not in group_options(group):
            continue  # an unknown option: check_settings names it
        valid = ["spec"] if name is None else group_keys(group, str(name))
        check_keys(settings[group], valid, f"{group}.", f"{group} {name}" if name else group)
    if isinstance(settings["policy"].get("layer_budget"), Mapping):
        check_layer_budget_keys(settings["policy"]["layer_budget"])
