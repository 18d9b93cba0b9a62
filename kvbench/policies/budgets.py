"""Budgets: parsing ``budget=`` specs and allocating a total budget across layers."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbench.errors import KVBenchError, choose

_BUDGET = re.compile(r"^(?P<number>\d+(\.\d+)?)(?P<unit>k|pct)?$")


@dataclass(frozen=True)
class Budget:
    """A per-layer KV budget: a token count (``2048``, ``2k``) or a fraction of the prompt (``10pct``)."""

    spec: str
    tokens: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, spec) -> "Budget":
        text = str(spec).strip().lower()
        match = _BUDGET.match(text)
        if match is None:
            raise KVBenchError(
                f"invalid budget {spec!r}; use a positive token count (64, 2048, 2k) or a prompt fraction (10pct)"
            )
        number, unit = float(match["number"]), match["unit"]
        if number <= 0:
            raise KVBenchError(f"invalid budget {spec!r}: it must be > 0")
        if unit == "pct":
            if number > 100:
                raise KVBenchError(f"invalid budget {spec!r}: a fraction of the prompt must be at most 100pct")
            return cls(text, fraction=number / 100.0)
        tokens = number * 1024 if unit == "k" else number
        if tokens != int(tokens):
            raise KVBenchError(f"invalid budget {spec!r}: a token count must be a whole number")
        return cls(text, tokens=int(tokens))

    def resolve(self, prompt_len: int) -> int:
        """Tokens per layer for a prompt of ``prompt_len`` tokens (at least 1)."""
        if self.tokens is not None:
            return self.tokens
        return max(1, round(self.fraction * prompt_len))


LAYER_BUDGETS = ["uniform", "pyramid"]


def layer_budgets(kind: str, budget: int, num_layers: int, *, beta: float = 20.0, reserved: int = 0) -> list[int]:
    """Split ``budget × num_layers`` tokens over layers; the total is conserved exactly.

    ``uniform``: every layer gets ``budget``. ``pyramid``: PyramidKV eq. 7 on the non-reserved part
    ``b = budget − reserved`` (the observation window is kept in every layer): the top layer keeps
    ``b / beta``, the bottom ``2b − b / beta``, linear in between.
    """
    choose("policy.layer_budget", kind, LAYER_BUDGETS)
    free = budget - reserved
    if kind == "uniform" or num_layers == 1 or free <= 0:
        return [budget] * num_layers
    top = free / beta
    bottom = 2 * free - top
    raw = [bottom - (bottom - top) * layer / (num_layers - 1) for layer in range(num_layers)]
    return [reserved + share for share in conserve_total(raw, free * num_layers)]


def conserve_total(raw: list[float], total: int) -> list[int]:
    """Round non-negative shares to integers summing to ``total`` (largest remainders first)."""
    scale = total / sum(raw)
    exact = [value * scale for value in raw]
    rounded = [int(value) for value in exact]
    order = sorted(range(len(raw)), key=lambda index: exact[index] - rounded[index], reverse=True)
    for index in order[: total - sum(rounded)]:
        rounded[index] += 1
    return rounded
