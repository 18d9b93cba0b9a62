"""Packed results (kvbench/packed.py): a folder's run directories as one archive, read as they were."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from kvbench import PROJECT_ROOT
from kvbench.cli import main
from kvbench.errors import KVBenchError
from kvbench.packed import PACKED, pack, unpack
from kvbench.rundir import run_dirs_below
from tests.helpers import refused

RUN = ("config.yaml", "metrics.json", "predictions.jsonl", "kvbench.log")


def sweep_folder(root: Path, runs: tuple[str, ...] = ("m/t/a-1", "m/t/b-2", "m/u/a-1")) -> Path:
    """A sweep's folder as a sweep leaves it: run directories (one still locked), its multirun files and a report."""
    for run in runs:
        for name in RUN:
            (root / run).mkdir(parents=True, exist_ok=True)
            (root / run / name).write_text(f"{run}/{name}\n")
    (root / runs[0] / "run.lock").write_text("")
    (root / ".hydra").mkdir()
    (root / ".hydra" / "x.yaml").write_text("hidden\n")
    (root / "multirun.yaml").write_text("sweep\n")
    (root / "report").mkdir()
    (root / "report" / "table.md").write_text("| a |\n")
    return root


def test_a_packed_folder_reads_as_its_run_directories_and_unpacks_to_them(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    folder = sweep_folder(tmp_path / "sweep")
    runs = [path.relative_to(folder) for path in run_dirs_below(folder)]
    archive = pack(folder)
    first = archive.read_bytes()
    with tarfile.open(archive, "r:xz") as members:
        names = sorted(member.name for member in members)
    assert names == sorted(
        [f"{run}/{name}" for run in ("m/t/a-1", "m/t/b-2", "m/u/a-1") for name in RUN] + ["multirun.yaml"]
    )
    (folder / "m" / "t" / "a-1" / "config.yaml").touch()  # another time: the same bytes
    assert pack(folder).read_bytes() == first

    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / PACKED).write_bytes(first)
    found = run_dirs_below(packed)
    cache = tmp_path / "cache" / "packed"
    assert [path.relative_to(path.parents[2]) for path in found] == runs and all(
        cache in path.parents for path in found
    )
    assert (found[1] / "metrics.json").read_text() == "m/t/b-2/metrics.json\n"
    assert run_dirs_below(packed) == found  # extracted once

    own = packed / "m" / "t" / "b-2"  # a run directory of the folder's own comes before the archive's of its path
    own.mkdir(parents=True)
    (own / "metrics.json").write_text("mine\n")
    assert run_dirs_below(packed) == [found[0], own, found[2]]

    written = unpack(packed)
    assert len(written) == 3 * len(RUN) - 1 + 1  # b-2's metrics.json kept, multirun.yaml too
    assert (own / "metrics.json").read_text() == "mine\n" and (
        own / "config.yaml"
    ).read_text() == "m/t/b-2/config.yaml\n"
    assert [path.relative_to(packed) for path in run_dirs_below(packed)] == runs
    assert unpack(tmp_path / "sweep" / "m") == []  # no archive: nothing


@pytest.mark.parametrize("name", ["../escaped", "/tmp/absolute", "a/../../b"])
def test_an_archive_member_outside_its_folder_is_refused(tmp_path, monkeypatch, name):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as archive:
        info = tarfile.TarInfo(name)
        info.size = 1
        archive.addfile(info, io.BytesIO(b"x"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / PACKED).write_bytes(buffer.getvalue())
    with pytest.raises(KVBenchError, match="is not a file inside its folder"):
        unpack(folder)
    with pytest.raises(KVBenchError, match="is not a file inside its folder"):
        run_dirs_below(folder)
    assert not (tmp_path / "escaped").exists() and sorted(path.name for path in folder.iterdir()) == [PACKED]


def test_a_folder_with_a_run_being_written_is_not_packed(tmp_path, capsys):
    from kvbench.rundir import RunDir

    folder = sweep_folder(tmp_path / "sweep")
    with RunDir(folder / "m" / "t" / "b-2").lock():
        line = refused(capsys, ["pack", str(folder)], folder / PACKED)
    assert line.startswith("kvbench: error: kvbench pack: ") and "b-2 is being written now" in line


@pytest.mark.parametrize("args", [["pack"], ["unpack", "a", "b"], ["pack", "--all"], ["pack", "/nonexistent/x"]])
def test_pack_and_unpack_take_one_folder(args, capsys):
    assert refused(capsys, args).startswith(f"kvbench: error: kvbench {args[0]}")


def test_unpack_refuses_a_folder_without_an_archive(tmp_path, capsys):
    """Nothing to unpack is one line naming the folder, not "0 files written"."""
    line = refused(capsys, ["unpack", str(tmp_path)])
    assert line == f"kvbench: error: kvbench unpack: {tmp_path} holds no {PACKED} (kvbench pack {tmp_path} makes one)\n"


def test_the_committed_results_are_light_enough_to_carry():
    """Every clone (and a GPU check's copy of the tree) carries them: at most 300 files and 10 MB, an experiment's
    runs packed (``kvbench pack``)."""
    listed = subprocess.run(["git", "ls-files", "results"], cwd=PROJECT_ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = [PROJECT_ROOT / name for name in listed.stdout.splitlines()]
    assert len(files) <= 300
    assert sum(path.stat().st_size for path in files if path.exists()) <= 10 * 2**20
    assert not [path for path in files if path.name in RUN]  # run directories go packed


def test_a_sweep_into_a_packed_folder_resumes_its_runs_and_plan_sees_them_finished(tmp_path, monkeypatch, capsys):
    """``make leaderboard`` on a fresh clone: the sweep's folder holds only its archive; ``kvbench plan`` finds every
    job finished, and the sweep unpacks the runs and runs nothing again; ``table`` reads the archive as the runs."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    sweep = tmp_path / "sweep"
    jobs = ["model=tiny_llama", "task=ruler", "task.subtasks=[niah_single_1]", "task.context_length=512"]
    args = ["-m", *jobs, "task.num_samples=1", "policy=snapkv,tova", "budget=64", f"hydra.sweep.dir={sweep}"]
    main(["run", *args])
    main(["table", str(sweep), "--output-dir", str(tmp_path / "tables")])
    pack(sweep)
    for folder in [path for path in sweep.iterdir() if path.name != PACKED]:
        shutil.rmtree(folder) if folder.is_dir() else folder.unlink()
    capsys.readouterr()
    main(["table", str(sweep), "--output-dir", str(tmp_path / "packed-tables")])
    for table in (tmp_path / "tables").iterdir():
        assert (tmp_path / "packed-tables" / table.name).read_text() == table.read_text()
    capsys.readouterr()
    main(["plan", *args])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 2 and all(line["finished"] for line in lines)
    main(["run", *args])
    out = capsys.readouterr().out
    assert f"kvbench: {sweep / PACKED}: " in out and "2 jobs, 2 skipped (2 finished, 0 running), 0 submitted" in out
