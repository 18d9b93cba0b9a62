"""What the fixture scripts that run a method's released code share: writing their cases with the code's origin."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import torch


def save_cases(cases: list[dict[str, Any]], out: str, repository: str, checkout: str, commit: str = "") -> None:
    """``cases`` to ``out`` (``torch.save``) with ``source``: ``repository`` at ``commit`` (by default the checkout's
    ``HEAD``, where it is a git work tree)."""
    if not commit:
        found = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = found.stdout.strip()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    source = f"{repository} {commit or 'unknown commit'}"
    torch.save({"source": source, "cases": cases}, out)
    print(f"wrote {len(cases)} cases to {out} ({source})")
