"""Hub access for the tasks' data: fail fast offline, with one line saying how to provide the data.

``huggingface_hub`` retries an unreachable hub for about 25 seconds before it gives up, and the
``datasets`` library longer; these helpers look in the local cache first and only contact the hub
when downloading is allowed and the hub (or the proxy) accepts a connection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import huggingface_hub

from kvbench.errors import KVBenchError


def hub_online() -> bool:
    """Whether downloading is allowed (``HF_HUB_OFFLINE`` unset) and the hub answers a quick probe."""
    from kvbench.engine.models import _hub_online  # the engine's probe, shared rather than duplicated

    return _hub_online()


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def hub_file(repo: str, filename: str, how_to_provide: str) -> Path:
    """``filename`` of the hub dataset ``repo``: from the local Hugging Face cache, else downloaded.

    ``how_to_provide`` ends the one-line error raised when neither works (e.g. "set task.data_dir=DIR").
    """
    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename, repo_type="dataset", local_files_only=True))
    except Exception:  # not cached (or a broken cache entry): try the hub
        pass
    if not hub_online():
        raise KVBenchError(f"{filename} of the hub dataset {repo} is not cached and the hub is unreachable; {how_to_provide}")
    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename, repo_type="dataset"))
    except Exception as error:
        raise KVBenchError(f"cannot download {filename} of the hub dataset {repo} ({_first_line(error)}); {how_to_provide}") from None


def hub_rows(repo: str, split: str, how_to_provide: str, name: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all when None) of ``split`` of the hub dataset ``repo`` via ``datasets``
    (streamed, so a large dataset such as PG19 is not downloaded whole)."""
    if not hub_online():
        raise KVBenchError(f"the hub dataset {repo} ({split} split) cannot be loaded: the hub is unreachable; {how_to_provide}")
    try:
        import datasets

        stream = datasets.load_dataset(repo, name, split=split, streaming=True)
        rows = []
        for row in stream:
            if limit is not None and len(rows) >= limit:
                break
            rows.append(dict(row))
        return rows
    except Exception as error:
        raise KVBenchError(f"cannot load the hub dataset {repo} ({split} split: {_first_line(error)}); {how_to_provide}") from None
