"""kvbench: reproduce and extend KV-cache token eviction research."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

__version__ = "0.1.0"

PROJECT_ROOT = Path(__file__).resolve().parents[1]  # the checkout (site-packages when installed from a wheel)
CONF_ENV = "KVBENCH_CONF_DIR"  # a folder laid out as kvbench/conf, replacing the shipped configs
#: the Hydra configs, shipped inside the package (the checkout's top-level conf/ links here)
CONF_DIR = Path(os.environ.get(CONF_ENV) or Path(__file__).resolve().parent / "conf")


def resolve_path(path: str | os.PathLike) -> Path:
    """A user-given file or folder: ``~`` expanded; a relative path is taken from the working directory if
    it exists there, else, in a checkout, from its root (where ``make`` and the tests run)."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute() or candidate.exists() or not (PROJECT_ROOT / "pyproject.toml").exists():
        return candidate
    return PROJECT_ROOT / candidate


def file_name(text: str, suffix: str) -> str:
    """A file name made from a value read out of data or a run directory (a subtask, a sample id, a run's title):
    every character but letters, digits and ``-_.+@`` replaced by ``_``, then ``suffix``; it names a file inside the
    folder it is joined to (no separator, never ``..`` nor empty, since it ends in ``suffix``)."""
    return "".join(char if char.isalnum() or char in "-_.+@" else "_" for char in text) + suffix


def published(target: Path, write: Callable[[Path], object]) -> Path:
    """The folder ``target``, made once and atomically: ``write`` fills a hidden sibling that is renamed into place,
    so concurrent processes never see it half-written; if another process made it first, its (identical) folder is
    kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        write(staging)
        staging.chmod(0o755)  # mkdtemp makes it private to its owner
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cache_dir() -> Path:
    """The kvbench cache root (converted models, essays): ``$KVBENCH_CACHE`` or ``~/.cache/kvbench``."""
    return Path(os.environ.get("KVBENCH_CACHE") or Path.home() / ".cache" / "kvbench").expanduser()


def duration(seconds: float) -> str:
    """``H:MM:SS`` with as many hours as it takes (a paper-scale plan runs for days)."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def config_dict(node: Any, resolve: bool = False) -> dict[str, Any]:
    """``OmegaConf.to_container`` of a mapping node (a ``DictConfig``, whose keys are strings), typed as the
    dict it is (omegaconf types the container as any dict, list or scalar)."""
    from omegaconf import OmegaConf

    container = OmegaConf.to_container(node, resolve=resolve)
    assert isinstance(container, dict)
    return cast(dict[str, Any], container)


def lazy_exports(package: str, homes: dict[str, str]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` (PEP 562) that imports ``package.<home>`` when one of its ``homes``' names
    (name → module) is first read, so that importing one light module of a package does not import its heavy ones
    (the engine's model code and transformers with it) through the package's ``__init__``."""
    import importlib

    def exported(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{homes[name]}"), name)

    return exported
