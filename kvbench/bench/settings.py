"""What ``kvbench bench`` accepts (conf/bench.yaml's ``bench`` node): every setting's domain, and the specs, budgets,
regimes and experiments it names, checked before any model loads or anything is written — a bad value is one line,
``bench.repetitions=two: must be a repetition count ≥ 1``, as ``kvbench run``'s settings are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig

from kvbench import config_dict
from kvbench.bench.sections import PROMPT_SOURCES
from kvbench.budgets import Budget
from kvbench.config import group_options
from kvbench.domains import FLAG, SAMPLES, TEXT, TOKENS, Domain, choice, integer, is_int, list_of, mapping
from kvbench.engine.settings import REGIMES
from kvbench.errors import KVBenchError, choose
from kvbench.policies import parse_spec

#: a prompt of the bench: two tokens at least (the last is the first decode step's), a decode of one step at least
PROMPT = integer(2, "a token count")
STEPS = integer(2, "a new-token count")
PROMPT_OR_NONE = Domain(
    "0 (the section skipped) or a token count ≥ 2",
    lambda value: (is_int(value) and value == 0) or PROMPT.accepts(value),
)
LENGTHS = list_of(PROMPT, "token counts ≥ 2", empty=True)  # empty: the section is skipped
SPECS = list_of(TEXT, "policy specs", empty=True)
BUDGETS = list_of(Domain("a budget", lambda value: isinstance(value, (str, int))), "budgets", empty=True)
OVERRIDES = list_of(TEXT, "overrides", empty=True)

#: each setting of ``bench`` (a dotted key below it) and its domain
BENCH_SETTINGS: dict[str, Domain] = {
    "repetitions": integer(1, "a repetition count"),
    "warmup_tokens": integer(0, "a token count"),
    "prompt_source": choice(*PROMPT_SOURCES),
    "policy_params": mapping("a mapping of policy specs to their settings", lambda _, item: isinstance(item, Mapping)),
    "prefill.policies": SPECS,
    "prefill.prompt_lengths": LENGTHS,
    "prefill.profile": SPECS,
    "prefill.profile_rows": integer(1, "a row count"),
    "decode.policy": TEXT,
    "decode.prompt_lengths": LENGTHS,
    "decode.new_tokens": STEPS,
    "memory.regime": choice(*REGIMES),
    "memory.policies": SPECS,
    "memory.prompt_lengths": LENGTHS,
    "memory.new_tokens": TOKENS,
    "headwise.policies": SPECS,
    "headwise.prompt_length": PROMPT,
    "headwise.new_tokens": STEPS,
    "generate.prompt_lengths": LENGTHS,
    "generate.new_tokens": TOKENS,
    "kvpress.enabled": FLAG,
    "kvpress.prompt_length": PROMPT,
    "kvpress.window": TOKENS,
    "kvpress.kernel": integer(1, "a pooling width"),
    "grid.task": OVERRIDES,
    "grid.context_length": PROMPT,
    "grid.num_samples": SAMPLES,
    "grid.policies": SPECS,
    "grid.budgets": BUDGETS,
    "grid.rows": integer(1, "a row count"),
    "grid.rows_policy": TEXT,
    "grid.new_tokens": TOKENS,
    "leaderboard_grid.experiment": TEXT,
    "leaderboard_grid.num_samples": integer(0, "a sample count"),  # 0: the section skipped
    "leaderboard_grid.overrides": OVERRIDES,
    "leaderboard_grid.memory_samples": list_of(SAMPLES, "sample counts ≥ 1", empty=True),
    "grid_operators.experiment": TEXT,
    "grid_operators.budgets": BUDGETS,
    "grid_operators.context_length": PROMPT_OR_NONE,
    "grid_operators.new_tokens": TOKENS,
    "grid_operators.profile_rows": integer(0, "a row count"),  # 0: no profile
    "contexts.task": OVERRIDES,
    "contexts.context_length": TOKENS,
    "contexts.contexts": integer(1, "a context count"),
    "contexts.questions": integer(1, "a question count"),
    "contexts.policies": SPECS,
    "contexts.budgets": BUDGETS,
    "contexts.new_tokens": TOKENS,
}


def flat(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``node``'s settings by dotted key; a setting whose value is a mapping (``policy_params``) is one setting."""
    settings: dict[str, Any] = {}
    for key, value in node.items():
        if isinstance(value, Mapping) and f"{prefix}{key}" not in BENCH_SETTINGS:
            settings.update(flat(value, f"{prefix}{key}."))
        else:
            settings[f"{prefix}{key}"] = value
    return settings


def check_bench(cfg: DictConfig) -> None:
    """Every setting of ``cfg.bench`` in its domain (one unknown to :data:`BENCH_SETTINGS` is refused too), every
    policy spec, budget, regime and experiment it names known: else one line (:class:`KVBenchError`)."""
    settings = flat(config_dict(cfg.bench, resolve=True))
    for key, value in settings.items():
        if key not in BENCH_SETTINGS:
            raise KVBenchError(f"bench.{key} is not a bench setting; valid choices: {', '.join(BENCH_SETTINGS)}")
        BENCH_SETTINGS[key].check(f"bench.{key}", value)
    specs = [settings["decode.policy"], settings["grid.rows_policy"], *settings["policy_params"]]
    specs += [spec for key, value in settings.items() if BENCH_SETTINGS[key] is SPECS for spec in value]
    for spec in specs:
        parse_spec(str(spec))
    for key in (key for key, domain in BENCH_SETTINGS.items() if domain is BUDGETS):
        for budget in settings[key]:
            Budget.parse(str(budget))
    choose("engine.regime", cfg.engine.regime, REGIMES)
    for key in ("leaderboard_grid.experiment", "grid_operators.experiment"):
        choose(f"bench.{key}", settings[key], group_options("experiment"))
