"""Budgets: the ``budget=`` spec, tokens per layer per cache head (how layers share them:
``kvbench.policies.layer_budget``), or the bytes the cache may hold, which each cache spends as its tokens cost."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvbench.errors import KVBenchError

_BUDGET = re.compile(r"^(?P<number>\d+(\.\d+)?)(?P<unit>k|pct|x|kib|mib|gib)?$")
#: byte units, as a spec names them
BYTE_UNITS = {"kib": ("KiB", 2**10), "mib": ("MiB", 2**20), "gib": ("GiB", 2**30)}
CHOICES = (
    "use a positive token count (64, 2048, 2k), a prompt fraction (10pct), a fraction of the full cache's bytes "
    "(0.25x) or a byte count (512KiB, 64MiB, 1GiB)"
)


@dataclass(frozen=True)
class Budget:
    """A per-layer KV budget: a token count (``2048``, ``2k``), a fraction of the prompt (``10pct``), a fraction of
    the full cache's bytes (``0.25x``) or a byte count (``64MiB``). A byte budget buys the tokens per layer and cache
    head whose cache holds at most those bytes after the prompt (:meth:`resolve`)."""

    spec: str
    tokens: int | None = None
    fraction: float | None = None
    byte_fraction: float | None = None
    byte_count: int | None = None

    @classmethod
    def parse(cls, spec) -> Budget:
        text = str(spec).strip()
        match = _BUDGET.match(text.lower())
        if match is None:
            raise KVBenchError(f"invalid budget {spec!r}; {CHOICES}")
        number, unit = float(match["number"]), match["unit"]
        if number <= 0:
            raise KVBenchError(f"invalid budget {spec!r}: it must be > 0")
        if unit == "pct":
            if number > 100:
                raise KVBenchError(f"invalid budget {spec!r}: a fraction of the prompt must be at most 100pct")
            return cls(text.lower(), fraction=number / 100.0)
        if unit == "x":
            if number > 1:
                raise KVBenchError(f"invalid budget {spec!r}: a fraction of the full cache's bytes must be at most 1x")
            return cls(f"{number:g}x", byte_fraction=number)  # one name for one value: 0.250x is 0.25x
        if unit in BYTE_UNITS:
            name, size = BYTE_UNITS[unit]
            if number * size != int(number * size):
                raise KVBenchError(f"invalid budget {spec!r}: a byte count must be a whole number of bytes")
            return cls(f"{number:g}{name}", byte_count=int(number * size))
        tokens = number * 1024 if unit == "k" else number
        if tokens != int(tokens):
            raise KVBenchError(f"invalid budget {spec!r}: a token count must be a whole number")
        # a plain count is named by its digits (Hydra reads budget=1e9 as the float 1000000000.0)
        return cls(text.lower() if unit else str(int(tokens)), tokens=int(tokens))

    @property
    def in_bytes(self) -> bool:
        return self.byte_fraction is not None or self.byte_count is not None

    def resolve(
        self, prompt_len: int, token_bytes: float | None = None, fixed_bytes: float = 0, full_bytes: float | None = None
    ) -> int:
        """Tokens per layer (and cache head) for a prompt of ``prompt_len`` tokens (at least 1). A byte budget needs
        ``token_bytes``, what one more token of budget costs the cache (every budgeted layer and cache head), and
        ``fixed_bytes``, what the cache holds whatever the budget (sliding layers' windows, a quantised cache's
        full-precision residual): the most tokens whose cache holds at most the budget's bytes — of ``full_bytes``
        for a fraction, the full cache of the prompt (by default ``fixed_bytes + token_bytes · prompt_len``: a cache
        that holds its entries as the model gives them)."""
        if self.tokens is not None:
            return self.tokens
        if self.fraction is not None:
            return max(1, round(self.fraction * prompt_len))
        if token_bytes is None:
            raise KVBenchError(f"budget {self.spec} needs the bytes a cached token costs (a model's cache)")
        if self.byte_fraction is not None:
            full = fixed_bytes + token_bytes * prompt_len if full_bytes is None else full_bytes
            allowed = self.byte_fraction * full
        else:
            assert self.byte_count is not None  # parse gives a budget one of its four forms
            allowed = self.byte_count
        return max(1, math.floor((allowed - fixed_bytes) / token_bytes + 1e-9))
