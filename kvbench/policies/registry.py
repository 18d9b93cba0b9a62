"""Name → class registries for base policies and modifiers; ``@register`` adds a class by its ``name``."""

from __future__ import annotations

BASES: dict[str, type] = {}
MODIFIERS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: a ``Policy`` subclass goes to ``BASES``, a ``Modifier`` subclass to ``MODIFIERS``."""
    from kvbench.policies.base import Modifier

    table = MODIFIERS if issubclass(cls, Modifier) else BASES
    table[cls.name] = cls
    return cls
