"""Packed results: a folder's run directories in one archive (``runs.tar.xz``), so that a committed experiment is one
file rather than four per run. Readers see the archive's run directories as the folder's own
(:func:`kvbench.rundir.runs_below`, extracted once into the cache), a folder's own run directory of the same path
first; ``kvbench unpack`` puts them back in place to resume a sweep, ``kvbench pack`` writes the archive again (the
same bytes for the same files)."""

from __future__ import annotations

import functools
import hashlib
import io
import lzma
import tarfile
from pathlib import Path

from kvbench import cache_dir, published
from kvbench.errors import KVBenchError

#: the archive of a folder's run directories
PACKED = "runs.tar.xz"
#: what a folder keeps beside its archive, unpacked: the reports written from its runs
NOT_PACKED = ("report",)
#: files a run holds only while it runs
TRANSIENT = ("run.lock",)


def packed_files(folder: Path) -> list[Path]:
    """The files ``pack`` puts in ``folder``'s archive, sorted: everything below it but its reports, hidden files and
    folders, run locks and the archive itself."""
    files = []
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        if not path.is_file() or relative.parts[0] in (*NOT_PACKED, PACKED):
            continue
        if any(part.startswith(".") for part in relative.parts) or path.name in TRANSIENT:
            continue
        files.append(path)
    return files


def pack(folder: str | Path) -> Path:
    """``folder``'s run directories and sweep files as ``folder/runs.tar.xz``: the same files give the same bytes (no
    times, owners or modes); returns the archive's path."""
    folder = Path(folder)
    files = packed_files(folder)
    if not files:
        raise KVBenchError(f"kvbench pack: {folder} holds no files to pack")
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(path.relative_to(folder).as_posix())
            info.size, info.mode = len(data), 0o644
            archive.addfile(info, io.BytesIO(data))
    target = folder / PACKED
    partial = target.with_name(f".{PACKED}.partial")
    partial.write_bytes(lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME))
    partial.replace(target)
    return target


def extract(archive: Path, into: Path, keep_existing: bool) -> list[Path]:
    """The files of ``archive`` written below ``into`` (members confined to it: a name with ``..`` or a root is
    refused), those already there kept if ``keep_existing``; returns the files written."""
    written = []
    with tarfile.open(archive, mode="r:xz") as members:
        for member in members:
            relative = Path(member.name)
            if relative.is_absolute() or ".." in relative.parts or not member.isfile():
                raise KVBenchError(f"{archive}: member {member.name!r} is not a file inside its folder")
            target = into / relative
            if keep_existing and target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            source = members.extractfile(member)
            assert source is not None  # a regular file
            target.write_bytes(source.read())
            written.append(target)
    return written


def unpack(folder: str | Path) -> list[Path]:
    """``folder/runs.tar.xz``'s files put back in ``folder`` (a sweep run into it again resumes them), the files
    already there kept; returns the files written (none without an archive)."""
    folder = Path(folder)
    archive = folder / PACKED
    return extract(archive, folder, keep_existing=True) if archive.is_file() else []


@functools.lru_cache(maxsize=16)
def digest(archive: Path, size: int, modified: int) -> str:
    """The first 16 hex digits of the archive's SHA-256 (read once for its size and modification time)."""
    return hashlib.sha256(archive.read_bytes()).hexdigest()[:16]


def unpacked(archive: Path) -> Path:
    """A read-only extraction of ``archive`` in the cache (``$KVBENCH_CACHE/packed/<its hash>``), made once: another
    process extracting it at the same time finds it made."""
    stat = archive.stat()
    target = cache_dir() / "packed" / digest(archive.resolve(), stat.st_size, stat.st_mtime_ns)
    if target.is_dir():
        return target
    return published(target, lambda scratch: extract(archive, scratch, keep_existing=False))


def packed_run(output_dir: str | Path) -> Path:
    """Where a run directory's files are read from before a sweep unpacks its folder (``kvbench plan``): its
    extraction from the archive of the nearest folder above it holding one, if it is there and ``output_dir`` does not
    exist; else ``output_dir``."""
    output_dir = Path(output_dir)
    if output_dir.exists():
        return output_dir
    for folder in output_dir.parents:
        if (folder / PACKED).is_file():
            extracted = unpacked(folder / PACKED) / output_dir.relative_to(folder)
            return extracted if extracted.is_dir() else output_dir
    return output_dir
