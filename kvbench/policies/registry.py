"""Name → class registries for base policies and modifiers; ``@register`` adds a class by its ``name``."""

from __future__ import annotations

from typing import Any

BASES: dict[str, Any] = {}  # name -> Policy subclass
MODIFIERS: dict[str, Any] = {}  # name -> Modifier subclass


def register(cls: Any) -> Any:
    """Class decorator: a ``Policy`` subclass goes to ``BASES``, a ``Modifier`` subclass to ``MODIFIERS``."""
    from kvbench.policies.base import Modifier

    table = MODIFIERS if issubclass(cls, Modifier) else BASES
    table[cls.name] = cls
    return cls
