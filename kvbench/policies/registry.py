"""Name → class registries of the policy parts; ``@register`` adds a class by its ``name`` to the registry its
``registry`` class variable names (a base policy, a modifier or a layer budget)."""

from __future__ import annotations

from typing import Any, ClassVar

from kvbench.domains import check_fields
from kvbench.errors import KVBenchError

BASES: dict[str, Any] = {}  # name -> Policy subclass
MODIFIERS: dict[str, Any] = {}  # name -> Modifier subclass
LAYER_BUDGETS: dict[str, Any] = {}  # name -> LayerBudget subclass

REGISTRIES = {"base": BASES, "modifier": MODIFIERS, "layer budget": LAYER_BUDGETS}


class Registered:
    """What every policy part (base, modifier, layer budget) shares: the registry ``@register`` adds it to, its
    name and paper, and its settings — dataclass fields declared with ``kvbench.domains.setting`` — checked
    against their domains when it is built, each named ``<settings_prefix><field>`` in the error."""

    registry: ClassVar[str]
    name: ClassVar[str]
    paper: ClassVar[str]
    settings_prefix: ClassVar[str] = "policy."
    #: whether the registry's sweeps (``${policies:...}``: the leaderboard) list it; False only while its leaderboard
    #: cells are being run, so that the committed leaderboard stays finished (set True with the cells)
    swept: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_fields(self, self.settings_prefix)


def register(cls: Any) -> Any:
    """Class decorator: ``cls`` goes to the registry its ``registry`` names, under its ``name`` (one line where another
    module registered that name: a method of one's own cannot replace kvbench's)."""
    registry = REGISTRIES[cls.registry]
    existing = registry.get(cls.name)
    if existing is not None and existing.__module__ != cls.__module__:
        raise KVBenchError(
            f"{cls.registry} {cls.name!r} of {cls.__module__} is already registered by {existing.__module__}; "
            "give it another name"
        )
    registry[cls.name] = cls
    return cls
