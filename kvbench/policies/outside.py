"""Methods from outside the package: a researcher's own files and installed packages register their policies,
modifiers and layer budgets exactly as the built-in ones (a module written like ``methods/knorm.py``, its classes
under ``@register``), when :mod:`kvbench.policies` is imported.

* ``KVBENCH_METHODS``: paths separated by ``os.pathsep`` (``:``), each a ``.py`` file or a folder whose ``.py`` files
  (those not starting with ``_``) are each a method module;
* the ``kvbench.methods`` entry points of installed packages (``[project.entry-points."kvbench.methods"]`` in their
  ``pyproject.toml``, ``mine = "my_package.my_method"``), each a module imported.

A file that cannot be imported, or registers a name kvbench already has, is one line naming it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

from kvbench.errors import KVBenchError

METHODS_ENV = "KVBENCH_METHODS"
ENTRY_POINTS = "kvbench.methods"
#: the package the files of ``KVBENCH_METHODS`` are imported under (``kvbench_methods.<file stem>``)
FILES_PACKAGE = "kvbench_methods"


def said(error: Exception) -> str:
    """An exception in one line: its type and its message's first line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def method_files(setting: str) -> list[Path]:
    """The method modules ``KVBENCH_METHODS`` names, in order."""
    files: list[Path] = []
    for entry in filter(None, setting.split(os.pathsep)):
        path = Path(entry).expanduser()
        if path.is_dir():
            files += sorted(found for found in path.glob("*.py") if not found.name.startswith("_"))
        elif path.is_file() and path.suffix == ".py":
            files.append(path)
        else:
            raise KVBenchError(f"{METHODS_ENV}: {entry} is neither a .py file nor a folder of them")
    return files


def load_file(path: Path) -> None:
    """Import ``path`` as ``kvbench_methods.<stem>`` (its classes register themselves)."""
    name = f"{FILES_PACKAGE}.{path.stem}"
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except KVBenchError:
        del sys.modules[name]
        raise
    except Exception as error:
        del sys.modules[name]
        raise KVBenchError(f"{METHODS_ENV}: {path} cannot be imported: {said(error)}") from None


def load_outside_methods() -> None:
    """Import every method module of ``KVBENCH_METHODS`` and of the ``kvbench.methods`` entry points."""
    for path in method_files(os.environ.get(METHODS_ENV, "")):
        load_file(path.resolve())
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        try:
            entry.load()
        except KVBenchError:
            raise
        except Exception as error:
            raise KVBenchError(
                f"the {ENTRY_POINTS} entry point {entry.name} ({entry.value}) cannot be imported: {said(error)}"
            ) from None
