"""Eviction policies: base rankings (``h2o``, ``snapkv`` ...) and modifiers (``caote``, ``obcache_joint`` ...).

The machinery (``base``, ``stats``, ``scores``, ``budgets``, ``layer_budget``, ``registry``) lies here; the
methods, one small module each, in :mod:`kvbench.policies.methods`, each registering its classes with
``@register`` when that package is imported below, so adding a method means adding a file there; a method of one's
own, outside the package, registers alike from ``KVBENCH_METHODS`` or an entry point (:mod:`kvbench.policies.outside`).
``build_policy("h2o+obcache_joint", params)`` parses a spec and sets each part's dataclass fields from ``params``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import kvbench.policies.methods  # noqa: F401  (each method registers itself when imported)
from kvbench.errors import KVBenchError, check_keys, choose
from kvbench.policies.base import Modifier, Policy
from kvbench.policies.layer_budget import build_layer_budget
from kvbench.policies.outside import load_outside_methods
from kvbench.policies.registry import BASES, MODIFIERS

load_outside_methods()  # the researcher's own (KVBENCH_METHODS, kvbench.methods entry points), after the built-in


def parse_spec(spec: str) -> tuple[str, list[str]]:
    """``'snapkv+caote'`` → ``('snapkv', ['caote'])``, with one-line errors for unknown parts, a modifier named
    twice, a modifier that does not apply to the base, and two modifiers that each replace the per-query
    contributions (only the last would count). Each spec is parsed once (:func:`parsed`)."""
    base, modifiers = parsed(str(spec))
    return base, list(modifiers)


@functools.cache
def parsed(spec: str) -> tuple[str, tuple[str, ...]]:
    """:func:`parse_spec`'s parse, made once per spec: the registry only grows (a method cannot be replaced by
    another module's), so a spec parsed stays what it named; an error is not kept, so a spec refused before its
    method registers parses once it has."""
    base, *modifiers = [part.strip() for part in spec.split("+")]
    if base in MODIFIERS:
        raise KVBenchError(f"policy {spec!r} starts with the modifier {base!r}; use base+{base}, e.g. snapkv+{base}")
    choose("policy", base, BASES)
    for modifier in modifiers:
        choose("policy modifier", modifier, MODIFIERS)
        if modifiers.count(modifier) > 1:
            raise KVBenchError(f"policy {spec!r} names the modifier {modifier!r} twice; name it once")
        reason = MODIFIERS[modifier].inapplicable(BASES[base])
        if reason is not None:
            raise KVBenchError(f"policy {spec!r}: the modifier {modifier!r} does not apply to {base!r} ({reason})")
    replacing = [name for name in modifiers if MODIFIERS[name].reweights]
    if len(replacing) > 1:
        raise KVBenchError(
            f"policy {spec!r}: {' and '.join(replacing)} each replace the per-query contributions and only the last "
            f"would count; use one of them"
        )
    return base, tuple(modifiers)


def composable(base: str, modifier: str) -> bool:
    """Whether ``base+modifier`` is a policy (:func:`parse_spec` accepts it)."""
    return MODIFIERS[modifier].inapplicable(BASES[base]) is None


def channel_pruner(policy: Policy) -> Modifier | None:
    """The modifier of ``policy`` that prunes the prompt's key channels once it is read (ThinK), or None."""
    return next((modifier for modifier in policy.modifiers if modifier.channel_queries()), None)


#: the sets of policies a sweep can ask the registry for (:func:`registered`)
REGISTERED = ("bases", "variants", "headwise")


def registered(kind: str, decoding: bool = True) -> list[str]:
    """The policies of the registry, as a sweep asks for them: ``bases``, every base; ``variants``, every base alone
    and then with each modifier that applies to it, in registration order; ``headwise``, the variants whose modifier
    gives each head its own share (``shares_heads``: AdaKV); each of them ``swept``. ``decoding=False``
    leaves out the modifiers that act only while decoding (``attends``: CaliDrop, SLAKE), for a task that decodes
    nothing."""
    choose("registered policies", kind, REGISTERED)
    bases = [name for name, cls in BASES.items() if cls.swept]
    if kind == "bases":
        return bases
    modifiers = [name for name, cls in MODIFIERS.items() if cls.swept and (decoding or not cls.attends)]
    if kind == "headwise":
        modifiers = [name for name in modifiers if MODIFIERS[name].shares_heads]
        return [f"{base}+{name}" for base in bases for name in modifiers if composable(base, name)]
    return [
        spec for base in bases for spec in [base, *(f"{base}+{name}" for name in modifiers if composable(base, name))]
    ]


def policy_keys(spec: str) -> list[str]:
    """The settings a policy spec reads (``policy.<key>``): ``name``, the base's and each modifier's fields."""
    base, modifiers = parse_spec(spec)
    classes = [BASES[base], *(MODIFIERS[name] for name in modifiers)]
    return sorted({"name"} | {f.name for cls in classes for f in fields(cls)} - {"modifiers"})


def build_policy(spec: str, params: Mapping[str, Any] | None = None) -> Policy:
    """Build ``base+modifier+...`` with its settings from ``params`` (a policy node: ``name`` and any of
    :func:`policy_keys`; a key no part reads is a one-line error). ``layer_budget`` is a strategy name or
    node; without one, a modifier may bring its own (:meth:`Modifier.default_layer_budget`)."""
    settings = {key: value for key, value in (params or {}).items() if key != "name"}
    check_keys(settings, policy_keys(spec), "policy.", f"policy {spec}")
    base, modifier_names = parse_spec(spec)
    layer_budget = settings.pop("layer_budget", None)
    modifiers: list[Modifier] = [_instantiate(MODIFIERS[name], settings) for name in modifier_names]
    policy = _instantiate(BASES[base], settings, modifiers=modifiers)
    if layer_budget is not None:
        policy.layer_budget = build_layer_budget(layer_budget)
    else:
        for modifier in modifiers:
            policy.layer_budget = modifier.default_layer_budget(policy) or policy.layer_budget
    for modifier in modifiers:
        modifier.bind(policy)
    return policy


def _instantiate(cls: type, settings: Mapping[str, Any], **extra):
    names = {f.name for f in fields(cls)}
    return cls(**{key: value for key, value in settings.items() if key in names}, **extra)


__all__ = [
    "BASES",
    "MODIFIERS",
    "Modifier",
    "Policy",
    "build_policy",
    "channel_pruner",
    "composable",
    "parse_spec",
    "policy_keys",
]
