"""Methods from outside the package (kvbench/policies/outside.py): a researcher's own file named in
``KVBENCH_METHODS``, or an installed package's ``kvbench.methods`` entry point, registers its policy as the built-in
ones do; nothing inside the package changes. Each case runs ``kvbench`` in a fresh process (the registry is filled
when :mod:`kvbench.policies` is first imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvbench import PROJECT_ROOT

#: docs/extending.md's method of one's own, as the page gives it (KNorm's score, negated: the largest norms kept)
MINE = (PROJECT_ROOT / "docs" / "extending.md").read_text().split("```python\n")[1].split("```")[0]
MINE = MINE.replace('name = "largest_norm"', 'name = "mine"')


RULER = ["model=tiny_llama", "task=ruler", "task.subtasks=[niah_single_1]", "task.context_length=640"]


def kvbench(*args: str, methods: str | None = None, path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("KVBENCH_METHODS", None)
    if methods is not None:
        env["KVBENCH_METHODS"] = methods
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "kvbench.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_a_method_file_of_ones_own_runs_as_a_built_in_one(tmp_path):
    (tmp_path / "methods").mkdir()
    (tmp_path / "methods" / "mine.py").write_text(MINE)
    listed = kvbench("policies", methods=str(tmp_path / "methods"))
    assert listed.returncode == 0 and "mine" in listed.stdout, listed.stderr
    out = tmp_path / "run"
    ran = kvbench(
        "run",
        *RULER,
        "policy=mine",
        "budget=96",
        "task.num_samples=2",
        f"output_dir={out}",
        methods=str(tmp_path / "methods" / "mine.py"),
    )
    assert ran.returncode == 0, ran.stderr
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == 2 and records[0]["kv"]["after_prefill_tokens_per_layer"] == [96, 96, 96]


def test_a_sweep_of_ones_own_method_beside_a_built_in_one(tmp_path):
    """``kvbench run -m policy=mine,snapkv``: one grouped sweep, each job its own directory and records."""
    (tmp_path / "mine.py").write_text(MINE)
    swept = kvbench(
        "run",
        "-m",
        *RULER,
        "policy=mine,snapkv",
        "budget=96",
        "task.num_samples=2",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        methods=str(tmp_path / "mine.py"),
    )
    assert swept.returncode == 0, swept.stderr
    policies = sorted(json.loads(path.read_text())["policy"] for path in (tmp_path / "sweep").rglob("metrics.json"))
    assert policies == ["mine", "snapkv"]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "import no_such_module\n",
            "mine.py cannot be imported: ModuleNotFoundError: No module named 'no_such_module'",
        ),
        (
            MINE.replace('name = "mine"', 'name = "snapkv"'),
            "base 'snapkv' of kvbench_methods.mine is already registered",
        ),
    ],
)
def test_a_broken_method_file_is_one_line_naming_it(tmp_path, source, message):
    (tmp_path / "mine.py").write_text(source)
    listed = kvbench("policies", methods=str(tmp_path / "mine.py"))
    assert listed.returncode == 2 and listed.stderr.count("\n") == 1, listed.stderr
    assert listed.stderr.startswith("kvbench: error: KVBENCH_METHODS: ") or "already registered" in listed.stderr
    assert message in listed.stderr


def test_a_path_that_is_no_method_file_is_one_line(tmp_path):
    listed = kvbench("policies", methods=str(tmp_path / "absent.py"))
    assert listed.returncode == 2 and "KVBENCH_METHODS: " in listed.stderr and "absent.py" in listed.stderr


def test_an_installed_packages_entry_point_registers_its_method(tmp_path):
    """A package declaring ``[project.entry-points."kvbench.methods"] mine = "my_methods.mine"`` (installed here as
    its files and dist-info on the path): its method is listed and runs."""
    package = tmp_path / "site" / "my_methods"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "mine.py").write_text(MINE)
    info = tmp_path / "site" / "my_methods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-methods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[kvbench.methods]\nmine = my_methods.mine\n")
    listed = kvbench("policies", path=str(tmp_path / "site"))
    assert listed.returncode == 0 and "mine" in listed.stdout, listed.stderr


def test_one_command_checks_ones_own_method_and_says_what_fails(tmp_path):
    """``kvbench check-method NAME``: the registry's invariants on a method of one's own, from the installed kvbench
    (no test file of the project's); a method whose ranking changes from call to call (random scores, drawn anew)
    fails the rows check, exit 1."""
    (tmp_path / "mine.py").write_text(MINE)
    checked = kvbench("check-method", "mine", methods=str(tmp_path / "mine.py"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "kvbench check-method mine: 6 of 6 checks hold on tiny_llama" in checked.stdout
    (tmp_path / "mine.py").write_text(
        MINE.replace("return torch.linalg.vector_norm(", "return torch.rand_like(").replace(
            ".float(), dim=-1)", ".float()[..., 0])"
        )
    )
    checked = kvbench("check-method", "mine", methods=str(tmp_path / "mine.py"))
    assert checked.returncode == 1 and "FAILED  oneshot: prefilled together and decoded as rows" in checked.stdout
