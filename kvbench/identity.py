"""What identifies what, in one place: a run (its settings, whose digest names its directory), a group of jobs (one
model load and one task's samples), the twin jobs of a group that compute one thing, a loaded or measured config
node, and a row of the tables.

A run's *identity* is every setting of its resolved config but :data:`NOT_IDENTITY` (settings that change no
prediction), :data:`ADDED_SETTINGS` at the value older runs had, and :data:`SAME_RUN`'s aliases read as the value
they name. Engine-level sharing keys (a shared prefill's rankings, windows and selections; the stored rows'
shelves) are the engine's own (:mod:`kvbench.engine.sharing`, :func:`kvbench.engine.shelf.shelf_key`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:  # importing kvbench.cli loads no torch before it sets OpenMP's wait (kvbench.process)
    from kvbench.policies.base import Policy

#: settings that change no prediction, left out of a run's identity: where its files go, how it resumes and logs, an
#: experiment's per-policy table (already applied to the ``policy`` node), how it runs (rows decoding together and how
#: they are attended, CPU threads), and how many of the task's samples it asks for: they are prefix-stable, so a run
#: grows in its directory and one asking for fewer reads the first ones (:func:`kvbench.run.lifecycle.first_samples`)
NOT_IDENTITY = (
    "hydra",
    "logger",
    "output_dir",
    "policy_settings",
    "resume",
    "engine.batch_size",
    "engine.threads",
    "task.num_samples",
)

#: settings added after run directories were made, with the value every older run ran with: at that value a setting is
#: left out of a run's identity, so that older runs keep their directory names and resume
ADDED_SETTINGS = {
    "task.query_mode": "aware",
    "task.questions_per_context": 1,
    "policy.compress_above": "budget",  # CAKE's, +compat=cakekv
    "policy.layer_budget.rounding": "proportional",
    "engine.rows_attention": "each",  # padded rounds otherwise than each (docs/running.md, Groups): another run
    "policy.counting": "selectable",  # ChunkKV's and CriticalKV's, +compat=kvpress
    "task.empty_answers": "wrong",  # LongBench-v2's
    "engine.sums_kernel": "torch",  # triton's fused pass rounds otherwise
    "engine.decode_interval": 1,  # evicting at every decoded token, as every run before the setting
    "generation.do_sample": False,  # greedy, as every run before sampling
    "generation.temperature": 1.0,
    "generation.top_p": 1.0,
    "generation.num_samples": 1,
    "generation.seed": 0,
    "cache.quant": "none",  # the cache as the model gives it, as every run before KIVI
    "cache.group_size": 32,
    "cache.residual": 128,
}

#: settings whose value names the same run as another's: ``engine.sums_kernel=auto`` (torch's blocks on a CPU, the
#: fused pass on a GPU, as ``model.dtype=auto`` is float32 on the one and bfloat16 on the other) is a run of ``torch``,
#: ``engine.rows_attention=auto`` (each row alone on a CPU, the rows stored on a GPU) one of ``each``
SAME_RUN = {"engine.sums_kernel": {"auto": "torch"}, "engine.rows_attention": {"auto": "each"}}


def run_identity(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The settings that make a run what it is (a plain config dict without :data:`NOT_IDENTITY`, whose dotted
    names are keys of nested groups, e.g. ``engine.batch_size``; nor :data:`ADDED_SETTINGS` at the value older runs
    had)."""
    kept = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        value = SAME_RUN.get(name, {}).get(value, value) if isinstance(value, str) else value
        if name in NOT_IDENTITY or (name in ADDED_SETTINGS and value == ADDED_SETTINGS[name]):
            continue
        nested = (other for other in (*NOT_IDENTITY, *ADDED_SETTINGS, *SAME_RUN) if other.startswith(f"{name}."))
        if isinstance(value, Mapping) and any(nested):
            value = run_identity(value, f"{name}.")
            if not value:  # a node all of whose settings are at the values older runs had (generation)
                continue
        kept[str(key)] = value
    return kept


def flatten(settings: Any, prefix: str = "") -> dict[str, Any]:
    """``{"task.context_length": 1024, ...}``: the leaves of nested dicts, by dotted key."""
    if not isinstance(settings, Mapping) or not settings:
        return {prefix.rstrip("."): settings}
    return {key: value for name, node in settings.items() for key, value in flatten(node, f"{prefix}{name}.").items()}


def identity_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key=saved there, current here`` for each identity setting that differs, sorted by key (a setting of
    :data:`ADDED_SETTINGS` left out of one side at its value older runs had: that value)."""
    before, after = flatten(run_identity(saved)), flatten(run_identity(current))
    missing = "(unset)"

    def shown(settings: Mapping[str, Any], key: str) -> Any:
        return settings.get(key, ADDED_SETTINGS.get(key, missing))

    return [
        f"{key}={shown(before, key)} there, {shown(after, key)} here"
        for key in sorted(set(before) | set(after))
        if before.get(key, missing) != after.get(key, missing)
    ]


def run_digest(root: DictConfig) -> str:
    """The first 8 hex digits of the SHA-256 of a composed config's :func:`run_identity` (a run directory's name ends
    with it)."""
    nodes = {str(key): root[key] for key in root if key not in NOT_IDENTITY}
    settings = run_identity(
        {
            key: OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
            for key, node in nodes.items()
        }
    )
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:8]


#: the settings the jobs of one load group may differ in (:func:`load_group_key`)
GROUPED = ("policy", "budget")


def load_group_key(settings: Mapping[str, Any]) -> str:
    """What the jobs of one group share, from a job's plain settings: every identity setting but the policy and the
    budget (same model, task, data, regime and engine settings) and the samples asked for, so one model load and one
    task's samples serve them all."""
    identity = run_identity(dict(settings))
    shared = {key: value for key, value in identity.items() if key not in GROUPED}
    return json.dumps({**shared, "num_samples": settings["task"].get("num_samples")}, sort_keys=True, default=str)


def computation_key(policy: Policy, budget: str) -> tuple[str, str | None]:
    """The jobs of one load group with the same key compute the same thing, so a group computes it once for all of
    them: the policy's settings and modifiers, and its ``budget`` (spec) unless it neither evicts nor reads by it
    (``full`` at any budget is one full-cache run; Quest reads a budget's pages)."""
    return policy.key, budget if policy.evicts or policy.reads else None


def node_settings_key(settings: Mapping[str, Any]) -> str:
    """A part's plain settings as one string: a key for what was loaded or measured for them."""
    return json.dumps(settings, sort_keys=True)


#: the columns that name a row of the tables (:meth:`kvbench.finished.Run.table_identity`)
TABLE_IDENTITY = ("model", "policy", "budget", "regime")
