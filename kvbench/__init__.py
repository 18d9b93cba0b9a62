"""kvbench: reproduce and extend KV-cache token eviction research."""

import os
from pathlib import Path

__version__ = "0.1.0"

PROJECT_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = PROJECT_ROOT / "conf"


def cache_dir() -> Path:
    """The kvbench cache root (converted models, essays): ``$KVBENCH_CACHE`` or ``~/.cache/kvbench``."""
    return Path(os.environ.get("KVBENCH_CACHE") or Path.home() / ".cache" / "kvbench").expanduser()
