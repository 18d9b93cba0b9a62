"""The package's floors: every kvbench module belongs to a declared layer and imports only from its own layer or
below, and no modules import each other in a circle (imports inside functions and under TYPE_CHECKING count)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench import PROJECT_ROOT

#: the layers, lowest first: a module may import from its own layer and those below it
LAYERS: list[tuple[str, ...]] = [
    # the ground: no kvbench imports above it
    ("kvbench", "kvbench.errors", "kvbench.domains", "kvbench.hub", "kvbench.budgets"),
    ("kvbench.metrics", "kvbench.papers", "kvbench.kernels"),  # official metrics, paper tables, Triton kernels
    ("kvbench.policies",),  # eviction methods and their machinery
    ("kvbench.engine",),  # the eviction-aware engine (knows no policy by name, no task)
    ("kvbench.tasks", "kvbench.models"),  # benchmarks (know no policy, no engine); model provisioning
    # the run-directory store, its packed form and its read model; Hydra glue
    ("kvbench.identity", "kvbench.rundir", "kvbench.packed", "kvbench.finished", "kvbench.config", "kvbench.pipeline"),
    ("kvbench.job",),  # one job resolved before anything runs
    ("kvbench.results",),  # reports: tables, paper comparisons, plots, W&B
    ("kvbench.run",),  # running a job into its run directory
    ("kvbench.launch", "kvbench.bench", "kvbench.check"),  # sweeps and launchers; benchmarks; a method checked
    ("kvbench.plan",),
    ("kvbench.cli",),
]


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((PROJECT_ROOT / "kvbench").rglob("*.py")):
        parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The kvbench modules a file imports (``from pkg import submodule`` counts as the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvbench":
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "kvbench")
    return {name for name in found if name in known}


def layer_of(module: str) -> int:
    """The layer of a module: that of the longest declared name it is or lies under."""
    matches = [
        (len(name), index)
        for index, names in enumerate(LAYERS)
        for name in names
        if module == name or module.startswith(name + ".")
    ]
    assert matches, f"{module} is in no declared layer (tests/test_layers.py LAYERS)"
    return max(matches)[1]


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) - {name} for name, path in known.items()}


def test_every_module_imports_only_from_its_layer_or_below():
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module) and not target.startswith(module + ".")
    ]
    assert upward == []


def held_after_import(modules: str, watched: list[str]) -> list[str]:
    """Which of the ``watched`` modules a fresh interpreter holds once it has imported ``modules`` (comma-joined)."""
    loaded = f"print([name for name in {watched!r} if name in sys.modules])"
    done = subprocess.run([sys.executable, "-c", f"import sys, {modules}; {loaded}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout)


def test_the_report_commands_and_the_policy_registry_import_no_model_library():
    """``kvbench table``, ``leaderboard``, ``plot`` and ``compare-paper`` read run directories: they import neither
    torch nor transformers (about 5 s a command on a CPU); the policies' registry, which every composition reads,
    imports torch but not transformers (DuoAttention imports its rotation where a model runs)."""
    results = "kvbench.results.table, kvbench.results.leaderboard, kvbench.results.plots, kvbench.results.compare"
    for modules, heavy in ((results, []), ("kvbench.policies", ["torch"])):
        assert held_after_import(modules, ["torch", "transformers"]) == heavy, modules


def test_a_sweep_resolves_and_launches_its_jobs_without_the_model_code():
    """A sweep's process composes, resolves and checks its jobs (``kvbench.launch.sweeps``, ``kvbench.job``) and
    skips the finished ones without importing the engine's model code or transformers' models (about 4 s a sweep on
    a CPU, each of ``make leaderboard``'s five): the engine and run packages import their names when first read."""
    modules = "kvbench.launch.sweeps, kvbench.launch.launchers, kvbench.job, kvbench.engine, kvbench.run"
    heavy = ["kvbench.engine.engine", "kvbench.run.group", "transformers.modeling_utils"]
    assert held_after_import(modules, heavy) == []
    read = "from kvbench.engine import Engine; from kvbench.run import run_group; print(Engine.__name__, run_group)"
    done = subprocess.run([sys.executable, "-c", read], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("Engine <function run_group"), done.stderr
    with pytest.raises(AttributeError, match="has no attribute 'Engines'"):
        import kvbench.engine

        _ = kvbench.engine.Engines


def test_no_import_cycle():
    edges = {
        module: {target for target in targets if not target.startswith(module + ".")}  # a package's own parts
        for module, targets in graph().items()
    }
    cycles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    assert cycles == []


def test_the_floors_table_of_the_architecture_page_is_these_layers():
    """docs/architecture.md's floors table names the modules of each floor as :data:`LAYERS` declares them (the root
    package as ``kvbench``, the rest without their ``kvbench.`` prefix), in order: the page cannot drift from the
    test that holds the code to it."""
    import re

    text = (PROJECT_ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.M)
    documented = [tuple(re.findall(r"`([^`]+)`", modules)) for _, modules in rows]
    declared = [tuple(name.removeprefix("kvbench.") for name in floor) for floor in LAYERS]
    assert [int(floor) for floor, _ in rows] == list(range(len(LAYERS)))
    assert documented == declared


def test_no_two_top_level_classes_or_functions_share_a_name():
    """One name for one thing: across ``kvbench/`` no two modules define a class or function of the same name at
    their top level (a reader or a ``grep`` finds the one meant)."""
    where: dict[str, list[str]] = {}
    for path in sorted((PROJECT_ROOT / "kvbench").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                where.setdefault(node.name, []).append(str(path.relative_to(PROJECT_ROOT)))
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


#: the most lines a module holds (a module past it is cut along a seam)
MODULE_LINES = 450


def test_no_module_is_over_450_lines():
    """Each module stays small enough to read in one sitting: none of ``kvbench/`` holds more than 450 lines."""
    lengths = {
        str(path.relative_to(PROJECT_ROOT)): len(path.read_text().splitlines())
        for path in sorted((PROJECT_ROOT / "kvbench").rglob("*.py"))
    }
    assert {path: lines for path, lines in lengths.items() if lines > MODULE_LINES} == {}


#: where a Hydra node is read: the resolver naming a run directory gets the composed root (Hydra's design), and a model
#: node becomes a ``ModelSpec``
HYDRA_BOUNDARIES = {("kvbench.rundir", "run_name"), ("kvbench.identity", "run_digest"), ("kvbench.models", "of")}


def test_below_the_run_layer_no_function_takes_a_hydra_node():
    """Tasks, models, the engine, policies, the run directory and the reports receive their typed part of the
    resolved job (a ``ModelSpec``, task ``Settings``, plain settings), never a ``DictConfig``."""
    below = ("kvbench.tasks", "kvbench.models", "kvbench.engine", "kvbench.policies", "kvbench.results")
    below += ("kvbench.rundir", "kvbench.identity", "kvbench.finished", "kvbench.packed")
    taking = []
    for name, path in modules().items():
        if not name.startswith(below):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (name, node.name) not in HYDRA_BOUNDARIES:
                arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(arg.annotation is not None and "DictConfig" in ast.unparse(arg.annotation) for arg in arguments):
                    taking.append(f"{name}.{node.name}")
    assert taking == []
