"""The settings a policy's parts (a base, its modifiers) were built with, and an identity made of them."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, cast

from kvbench.policies.layer_budget import LayerBudget
from kvbench.policies.registry import Registered


def part_settings(part: Registered, without: tuple[str, ...] = ()) -> dict[str, Any]:
    """The settings a base (its own, not its modifiers') or a modifier (a dataclass) was built with, but those named in
    ``without``: a layer budget as its node."""
    declared = fields(cast(Any, part))  # every part is a dataclass
    values = {item.name: getattr(part, item.name) for item in declared if item.name not in ("modifiers", *without)}
    return {name: v.parameters() if isinstance(v, LayerBudget) else v for name, v in values.items()}


def settings_key(*parts: Registered, without: tuple[str, ...] = ()) -> str:
    """An explicit identity of a base and modifiers: each part's name and :func:`part_settings`, as JSON."""
    return json.dumps([[part.name, part_settings(part, without)] for part in parts], sort_keys=True)
