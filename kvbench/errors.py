"""User-facing errors: the CLI prints them as one line and exits with status 2."""

import shutil
import sys
from pathlib import Path
from typing import NoReturn


class KVBenchError(Exception):
    """A bad value or a missing resource, explained in one line for the user."""


class SharedPassWarning(RuntimeWarning):
    """A group's shared pass failed and its samples ran alone: the results stand, the sharing was lost (an error
    under the tests, ``pyproject.toml``'s ``filterwarnings``)."""


def fail(message: str) -> NoReturn:
    """Print ``kvbench: error: MESSAGE`` on stderr and exit with status 2."""
    print(f"kvbench: error: {message}", file=sys.stderr)
    sys.exit(2)


def choose(kind: str, value, choices) -> None:
    """Raise a one-line error unless ``value`` is one of ``choices``."""
    choices = sorted(choices)
    if value not in choices:
        raise KVBenchError(f"unknown {kind} {value!r}; valid choices: {', '.join(map(str, choices))}")


def check_keys(given, valid: list[str], prefix: str, where: str) -> None:
    """Raise a one-line error naming the first (sorted) key of ``given`` that is not in ``valid``, as
    ``unknown key <prefix><key> for <where>; valid keys: <valid, in the order given>``."""
    unknown = sorted(set(map(str, given)) - set(valid))
    if unknown:
        raise KVBenchError(f"unknown key {prefix}{unknown[0]} for {where}; valid keys: {', '.join(valid)}")


def system_error(error: OSError, path: str | Path | None = None) -> KVBenchError:
    """An operating system's refusal to make or write ``path`` (the error's own file name if it has one) as one line:
    the path, the reason, and the free space on its disk."""
    where = Path(error.filename if error.filename is not None else path or ".")
    disk = next((folder for folder in (where, *where.parents) if folder.exists()), Path("."))
    try:
        free = f"; {shutil.disk_usage(disk).free / 2**30:.1f} GiB free on {disk}"
    except OSError:
        free = ""
    return KVBenchError(f"cannot write {where}: {error.strerror or error}{free}")
