"""Budgets: the ``budget=`` spec, tokens per layer per cache head (how layers share them:
``kvbench.policies.layer_budget``)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbench.errors import KVBenchError

_BUDGET = re.compile(r"^(?P<number>\d+(\.\d+)?)(?P<unit>k|pct)?$")


@dataclass(frozen=True)
class Budget:
    """A per-layer KV budget: a token count (``2048``, ``2k``) or a fraction of the prompt (``10pct``)."""

    spec: str
    tokens: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, spec) -> Budget:
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
        # a plain count is named by its digits (Hydra reads budget=1e9 as the float 1000000000.0)
        return cls(text if unit else str(int(tokens)), tokens=int(tokens))

    def resolve(self, prompt_len: int) -> int:
        """Tokens per layer for a prompt of ``prompt_len`` tokens (at least 1)."""
        if self.tokens is not None:
            return self.tokens
        assert self.fraction is not None  # parse gives a budget its tokens or its fraction
        return max(1, round(self.fraction * prompt_len))
