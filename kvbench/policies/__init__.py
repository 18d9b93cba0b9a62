"""Eviction policies: base rankings (``h2o``, ``snapkv`` ...) and modifiers (``caote``, ``obcache_joint`` ...).

Each policy is one small module that registers its class with ``@register``; every module in this
package is imported here, so adding a policy means adding a file. ``build_policy("h2o+obcache_joint",
params)`` parses a spec and sets each part's dataclass fields from ``params``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import fields
from typing import Any, Mapping

from kvbench.errors import KVBenchError, choose
from kvbench.policies.base import Modifier, Policy
from kvbench.policies.registry import BASES, MODIFIERS

_INFRASTRUCTURE = {"base", "registry", "budgets", "scores", "overhead"}
for _module in pkgutil.iter_modules(__path__):
    if _module.name not in _INFRASTRUCTURE:
        importlib.import_module(f"{__name__}.{_module.name}")


def _instantiate(cls: type, params: Mapping[str, Any], **extra):
    names = {f.name for f in fields(cls)}
    return cls(**{key: value for key, value in params.items() if key in names}, **extra)


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``'snapkv+caote'`` → ``('snapkv', ['caote'])``, with one-line errors for unknown parts."""
    base, *modifiers = [part.strip() for part in str(spec).split("+")]
    if base in MODIFIERS:
        raise KVBenchError(f"policy {spec!r} starts with the modifier {base!r}; use base+{base}, e.g. snapkv+{base}")
    choose("policy", base, BASES)
    for modifier in modifiers:
        choose("policy modifier", modifier, MODIFIERS)
    return base, modifiers


def build_policy(spec: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Build ``base+modifier+...`` with hyper-parameters from ``params`` (unknown keys are ignored)."""
    params = dict(params or {})
    base, modifier_names = parse_spec(spec)
    modifiers: list[Modifier] = [_instantiate(MODIFIERS[name], params) for name in modifier_names]
    choose("policy.gqa", params.get("gqa", "sum"), ["sum", "mean", "repeat"])
    policy = _instantiate(BASES[base], params, modifiers=modifiers)
    for modifier in modifiers:
        modifier.bind(policy)
    return policy


__all__ = ["BASES", "MODIFIERS", "Modifier", "Policy", "build_policy", "parse_spec"]
