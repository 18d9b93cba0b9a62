"""Setting domains: what values a setting takes, declared where the setting is defined.

A policy, modifier or layer budget declares each of its dataclass fields with :func:`setting` (default and
:class:`Domain`) and checks them on construction (:func:`check_fields`); the engine, model and task settings
keep a ``{key: Domain}`` table beside the code that reads them. Every job is resolved through these checks
(:func:`kvbench.job.resolve`) before any weight is loaded, by ``kvbench run``, ``kvbench plan`` and sweeps
alike: a value outside its domain is one line, ``policy.window=-1: must be a token count ≥ 0, ...``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvbench.errors import KVBenchError


@dataclass(frozen=True)
class Domain:
    """The values a setting takes: ``text`` says them (after "must be"), ``accepts`` tests one."""

    text: str
    accepts: Callable[[Any], bool]

    def check(self, key: str, value: Any) -> None:
        """A one-line error naming ``key``, ``value`` and what is allowed, unless ``value`` is in the domain."""
        if not self.accepts(value):
            raise KVBenchError(f"{key}={shown(value)}: must be {self.text}")


def shown(value: Any) -> str:
    """A value as it is typed on the command line (``null``, ``true``, ``abc``, ``[1, 2]``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def choice(*options: str) -> Domain:
    return Domain(f"one of {', '.join(options)}", lambda value: isinstance(value, str) and value in options)


FLAG = Domain("true or false", lambda value: isinstance(value, bool))


def integer(minimum: int, what: str = "an integer") -> Domain:
    """A whole number ≥ ``minimum`` (not a bool, not a float)."""
    return Domain(f"{what} ≥ {minimum}", lambda value: is_int(value) and value >= minimum)


def number(low: float, high: float | None = None, low_open: bool = False, high_open: bool = False) -> Domain:
    """A number in the interval from ``low`` to ``high`` (None: unbounded), ends open or closed."""
    left, right = ("(" if low_open else "["), (")" if high_open else "]")
    if high is None:
        text = f"a number {'>' if low_open else '≥'} {low:g}"
    else:
        text = f"a number in {left}{low:g}, {high:g}{right}"

    def accepts(value: Any) -> bool:
        if not is_number(value):
            return False
        above = value > low if low_open else value >= low
        below = high is None or (value < high if high_open else value <= high)
        return above and below

    return Domain(text, accepts)


_PERCENT = re.compile(r"^(\d+(\.\d+)?)pct$")


def token_window(minimum: int) -> Domain:
    """A window of tokens (:func:`window_tokens`): a count ≥ ``minimum``, a fraction of the
    budget or a percentage of the prompt."""

    def accepts(value: Any) -> bool:
        if is_int(value):
            return value >= minimum
        if isinstance(value, float):
            return 0.0 < value < 1.0
        match = _PERCENT.match(value) if isinstance(value, str) else None
        return match is not None and 0.0 < float(match[1]) <= 100.0

    return Domain(
        f"a token count ≥ {minimum}, a fraction of the budget in (0, 1) or Npct of the prompt (0 < N ≤ 100)", accepts
    )


def window_tokens(window: Any, budget: int, prompt_len: int) -> int:
    """Resolve a window setting: int tokens, a float in (0, 1) = fraction of the budget, 'Npct' = % of prompt."""
    if isinstance(window, str) and window.endswith("pct"):
        tokens = round(float(window[:-3]) / 100.0 * prompt_len)
    elif isinstance(window, float) and 0.0 < window < 1.0:
        tokens = round(window * budget)
    else:
        tokens = int(window)
    return max(0, min(tokens, budget))


def optional(domain: Domain, meaning: str) -> Domain:
    """``null`` (meaning ``meaning``) or a value of ``domain``."""
    return Domain(f"null ({meaning}) or {domain.text}", lambda value: value is None or domain.accepts(value))


def mapping(text: str, accepts_item: Callable[[Any, Any], bool]) -> Domain:
    """A mapping whose every ``(key, value)`` passes ``accepts_item``."""
    return Domain(
        text,
        lambda value: isinstance(value, Mapping) and all(accepts_item(key, item) for key, item in value.items()),
    )


TEXT = Domain("a string", lambda value: isinstance(value, str))
PATH = Domain("a path", lambda value: isinstance(value, str) and value != "")


def list_of(item: Domain, what: str, empty: bool = False) -> Domain:
    """A list of values of ``item``, non-empty unless ``empty`` (``what``: how the list is named, after "a list
    of")."""
    return Domain(
        f"a {'' if empty else 'non-empty '}list of {what}",
        lambda value: isinstance(value, list) and (empty or len(value) > 0) and all(map(item.accepts, value)),
    )


def name_list(options: Any) -> Domain:
    """A name of ``options``, or a non-empty list of them."""
    listed = list_of(choice(*options), "them")
    return Domain(
        f"one of {', '.join(options)}, or a non-empty list of them",
        lambda value: value in options if isinstance(value, str) else listed.accepts(value),
    )


def one_of(*domains: Domain) -> Domain:
    """A value of any of ``domains``."""
    return Domain(" or ".join(domain.text for domain in domains), lambda value: any(d.accepts(value) for d in domains))


TOKENS = integer(1, "a token count")
SAMPLES = integer(1, "a sample count")
SEED = integer(0, "a seed")
PERCENT = number(0, 100)


def setting(domain: Domain, default: Any = MISSING, default_factory: Any = MISSING) -> Any:
    """A dataclass field with its domain (``field(metadata={"domain": ...})``)."""
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata={"domain": domain})
    return field(default=default, metadata={"domain": domain})


def domains_of(obj_or_class: Any) -> dict[str, Domain]:
    """The declared domain of each field of a dataclass (or instance) that has one."""
    return {item.name: item.metadata["domain"] for item in fields(obj_or_class) if "domain" in item.metadata}


def check_fields(obj: Any, prefix: str) -> None:
    """Check every field of the dataclass instance ``obj`` against its domain, keys named ``<prefix><field>``."""
    for name, domain in domains_of(obj).items():
        domain.check(f"{prefix}{name}", getattr(obj, name))


def check_table(settings: Mapping[str, Any], table: Mapping[str, Domain], prefix: str) -> None:
    """Check the values of ``settings`` that ``table`` gives a domain for."""
    for name, domain in table.items():
        if name in settings:
            domain.check(f"{prefix}{name}", settings[name])


class Settings(Mapping[str, Any]):
    """A group's settings as the resolved job holds them (``task.*``): plain values, read-only, by key or by attribute
    (``settings.num_samples``), a mapping inside one a :class:`Settings` too. What a part of the job receives instead
    of the Hydra node it was composed from; any mapping (a test's dict) makes one."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", {str(key): plain(value) for key, value in values.items()})

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__") or key == "_values":  # protocols (copy, pickle) and the slot before it is set
            raise AttributeError(key)
        try:
            return self._values[key]
        except KeyError:
            raise AttributeError(f"no setting {key!r} (settings: {', '.join(self._values)})") from None

    def __reduce__(self) -> tuple[type[Settings], tuple[dict[str, Any]]]:
        return Settings, (self.to_dict(),)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"settings are read-only: {key}")

    def __repr__(self) -> str:
        return f"Settings({self._values!r})"

    def to_dict(self) -> dict[str, Any]:
        """The plain values, a mapping inside as a dict."""
        return {key: value.to_dict() if isinstance(value, Settings) else value for key, value in self._values.items()}


def plain(value: Any) -> Any:
    """``value`` as :class:`Settings` hold it: a mapping as Settings, a list or tuple (a ListConfig too) as a list of
    plain values, a scalar as itself."""
    if isinstance(value, Mapping):
        return Settings(value)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(item) for item in value]
    return value
