"""Name → class registries of the policy parts; ``@register`` adds a class by its ``name`` to the registry its
``registry`` class variable names (a base policy, a modifier or a layer budget)."""

from __future__ import annotations

from typing import Any

BASES: dict[str, Any] = {}  # name -> Policy subclass
MODIFIERS: dict[str, Any] = {}  # name -> Modifier subclass
LAYER_BUDGETS: dict[str, Any] = {}  # name -> LayerBudget subclass

REGISTRIES = {"base": BASES, "modifier": MODIFIERS, "layer budget": LAYER_BUDGETS}


def register(cls: Any) -> Any:
    """Class decorator: ``cls`` goes to the registry its ``registry`` names, under its ``name``."""
    REGISTRIES[cls.registry][cls.name] = cls
    return cls
