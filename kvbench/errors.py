"""User-facing errors: the CLI prints them as one line and exits with status 2."""


class KVBenchError(Exception):
    """A bad value or a missing resource, explained in one line for the user."""


def choose(kind: str, value, choices) -> None:
    """Raise a one-line error unless ``value`` is one of ``choices``."""
    choices = sorted(choices)
    if value not in choices:
        raise KVBenchError(f"unknown {kind} {value!r}; valid choices: {', '.join(map(str, choices))}")
