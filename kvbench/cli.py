"""The ``kvbench`` command line.

    kvbench run policy=snapkv+caote budget=128 task.subtasks=[niah_single_1] task.context_length=2048 task.num_samples=4
    kvbench run model=llama31_8b policy=h2o+obcache_joint budget=4k task=longbench   # Hydra overrides; -m sweeps
    kvbench run -m +experiment=caote [hydra/launcher=slurm|local]             # a paper's sweep (conf/experiment)
    kvbench plan -m +experiment=caote                                        # every job resolved and validated, as JSON
    kvbench policies                                                          # every policy and its parameters
    kvbench prepare task=ruler task.context_length=4096 output_dir=DIR       # write the generated samples
    kvbench table RUN_DIR... [--layout L] [--format F] [--output-dir DIR]    # benchmark-layout tables
    kvbench leaderboard RUN_DIR... [--format F] [--output-dir DIR]          # means with 95 % intervals, paired
    kvbench compare-paper caote:table2 RUN_DIR... [--output-dir DIR]           # a paper's table beside ours
    kvbench plot RUN_DIR... --kind heatmap|budget|ppl|all [--x budget|ratio|bytes] [--output-dir DIR]  # figures
    kvbench bench [overrides]                                                 # overhead, latency, memory (JSON)
    kvbench check-method SPEC [--model NAME]          # the invariants every policy holds, checked on one (your own)
    kvbench pack DIR                                  # DIR's run directories as one DIR/runs.tar.xz, read as they were
    kvbench unpack DIR                                # DIR/runs.tar.xz's run directories back in DIR
    kvbench --version

    -v / --verbose (before the command): third-party INFO lines too (quiet by default).

Errors in what the user typed are printed as one line (``kvbench: error: ...``) with exit status 2. Ctrl-C (SIGINT)
and SIGTERM stop a command with one line saying how many samples it wrote, exit status 130 and 143: every finished
sample is on disk, and the same command resumes the rest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvbench import CONF_DIR, __version__
from kvbench.allocator import PEAK_RSS_FILE, write_own_peak
from kvbench.errors import KVBenchError, fail, system_error
from kvbench.process import prepare
from kvbench.rundir import STOP_SIGNALS, RunDir, held_back, register_run_name

register_run_name()  # conf/config.yaml's ${run_name:}, also in a sweep's job processes (they import this module)
prepare()  # threads and allocator, before torch loads: nothing imported above loads it (kvbench/process.py)

log = logging.getLogger(__name__)


#: loggers of the libraries kvbench uses whose INFO lines are noise in a run (shown with -v)
NOISY_LOGGERS = ("absl", "datasets", "filelock", "fsspec", "httpx", "huggingface_hub", "matplotlib", "urllib3")
VERBOSE_ENV = "KVBENCH_VERBOSE"  # set by -v; inherited by a sweep's job processes


def quiet_libraries() -> None:
    """Third-party loggers at WARNING unless ``-v`` (after Hydra configured logging in a job)."""
    level = logging.INFO if os.environ.get(VERBOSE_ENV) else logging.WARNING
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(level)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def hydra_run(cfg: DictConfig) -> float | None:
    """The Hydra task function of ``kvbench run`` (one job of a run or a multirun sweep). A job of a sweep that
    fails writes its error to its log and raises it: the sweeper reports every failed job at the end."""
    from kvbench.run import result_line, run

    quiet_libraries()
    in_sweep = HydraConfig.get().mode == RunMode.MULTIRUN
    output_dir = HydraConfig.get().runtime.output_dir
    try:
        metrics = run(cfg, output_dir)
    except KVBenchError as error:
        if not in_sweep:  # (a sweep's job keeps its directory: its log there tells the error)
            detach_logs(Path(output_dir))
            RunDir(output_dir).discard_if_unused()
            fail(str(error))
        log.error("kvbench: error: %s", error)
        raise
    except Exception:
        if in_sweep:
            log.exception("job failed")
        raise
    print(result_line(metrics))
    return metrics["average"]


def detach_logs(directory: Path) -> None:
    """Close the log handlers that write into ``directory`` (Hydra's job log, opened at its first line), so that the
    directory can be removed and nothing logged later in this process tries to open a file there."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == directory.absolute():
            root.removeHandler(handler)
            handler.close()


def command_run(args: list[str]) -> None:
    from kvbench.config import prepare_overrides
    from kvbench.launch.sweeps import experiment_overrides

    sys.argv = [sys.argv[0], *prepare_overrides(experiment_overrides(args))]
    with one_line_errors():
        hydra_run()


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Hydra's composition errors (``foo=1``: an unknown key) and the system's (an output directory that cannot be
    made, a full disk) as one-line errors: Hydra is asked to raise them (``HYDRA_FULL_ERROR``) instead of printing
    its trace and exiting 1."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except (ConfigCompositionException, MissingConfigException, OverrideParseException) as error:
        reason = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        cause = str(error.__cause__ or "").strip().split("\n")[0]
        raise KVBenchError(f"{reason} ({cause})" if cause and cause not in reason else reason) from None
    except OSError as error:
        raise system_error(error) from None
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


def command_policies(args: list[str]) -> None:
    """Print every base policy, modifier and layer budget with its source paper, then each of its settings
    with its default and its domain (what values it takes)."""
    from kvbench.domains import domains_of, shown
    from kvbench.policies import BASES, MODIFIERS, build_policy
    from kvbench.policies.layer_budget import LAYER_BUDGETS

    strategies = ", ".join(sorted(LAYER_BUDGETS))
    layer_budget_text = f"a layer budget (below) by name or {{name: ..., <key>: ...}}: {strategies}"
    bases = {name: build_policy(name) for name in sorted(BASES)}
    parts: list[tuple[str, str, Any, dict[str, Any]]] = [
        (name, "base", BASES[name], {**policy.settings(), "layer_budget": policy.layer_budget.name})
        for name, policy in bases.items()
    ]
    parts += [(name, "modifier", cls, asdict(cls())) for name, cls in sorted(MODIFIERS.items())]
    parts += [(name, "layer budget", cls, cls().parameters()) for name, cls in sorted(LAYER_BUDGETS.items())]
    width = max(len(f"{key}={shown(value)}") for *_, settings in parts for key, value in settings.items())
    print("settings: policy.<key>=VALUE (a base's or a modifier's), policy.layer_budget.<key>=VALUE (a layer budget's)")
    print()
    for name, kind, cls, settings in parts:
        print(f"{name}  ({kind}; {cls.paper})")
        domains = domains_of(cls)
        for key, value in settings.items():
            if key != "name":
                text = layer_budget_text if key == "layer_budget" else domains[key].text
                print(f"    {f'{key}={shown(value)}':<{width}}  {text}")
    print(
        "\ncompose as base+modifier+...: e.g. policy=h2o+obcache_joint, policy=snapkv+caote; "
        "policy.layer_budget=NAME picks a layer budget with its defaults"
    )


def command_prepare(args: list[str]) -> None:
    """Write a task's samples as ``<output_dir>/<subtask>.jsonl`` (prompt text, answers, token length; the subtask
    made a file name inside ``output_dir``, :func:`kvbench.file_name`)."""
    from kvbench import file_name
    from kvbench.config import compose
    from kvbench.models import ModelSpec, load_tokenizer
    from kvbench.run import build_task

    cfg = compose(args)
    out_dir = Path(cfg.output_dir)
    tokenizer = load_tokenizer(ModelSpec.of(cfg.model))
    task = build_task(cfg, tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    handles: dict[str, IO[str]] = {}
    counts: dict[str, int] = {}
    for sample in task.samples():
        if sample.subtask not in handles:
            handles[sample.subtask] = (out_dir / file_name(sample.subtask, ".jsonl")).open("w", encoding="utf-8")
        record = {
            "id": sample.id,
            "subtask": sample.subtask,
            "prompt": tokenizer.decode(sample.input_ids),
            "answers": sample.answers,
            "num_tokens": len(sample.input_ids),
            "max_new_tokens": sample.max_new_tokens,
        }
        handles[sample.subtask].write(json.dumps(record, ensure_ascii=False) + "\n")
        counts[sample.subtask] = counts.get(sample.subtask, 0) + 1
    for handle in handles.values():
        handle.close()
    for subtask, count in counts.items():
        print(f"{out_dir / file_name(subtask, '.jsonl')}: {count} samples")


def command_plan(args: list[str]) -> None:
    """Resolve and validate every job ``kvbench run ARGS`` would launch; one JSON line per job (kvbench/plan.py)."""
    from kvbench.plan import plan_main

    plan_main(args)


def command_table(args: list[str]) -> None:
    from kvbench.results.table import table_main

    table_main(args)


def command_bench(args: list[str]) -> None:
    """Measure eviction overhead, decode latency, memory and harness speed (conf/bench.yaml overrides)."""
    from hydra.errors import HydraException

    from kvbench.bench import run_bench
    from kvbench.bench.settings import BENCH_SETTINGS
    from kvbench.config import compose

    try:
        cfg = compose(args, config_name="bench")
    except HydraException as error:
        first = str(error).splitlines()[0]
        if unknown := re.match(r"Could not override '(bench\.[^']+)'", first):  # a key bench.yaml lacks
            choices = ", ".join(BENCH_SETTINGS)
            raise KVBenchError(f"{unknown.group(1)} is not a bench setting; valid choices: {choices}") from None
        raise KVBenchError(f"bench: {first}") from None
    logging.basicConfig(level=logging.INFO, format="kvbench bench: %(message)s", stream=sys.stderr)
    quiet_libraries()
    results, out = run_bench(cfg)
    print(
        json.dumps({key: results[key] for key in ("prefill_overhead", "decode_latency_ratio", "harness_vs_generate")})
    )
    print(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")


def command_leaderboard(args: list[str]) -> None:
    from kvbench.results.leaderboard import leaderboard_main

    leaderboard_main(args)


def command_compare_paper(args: list[str]) -> None:
    from kvbench.results.compare import compare_main

    compare_main(args)


def command_plot(args: list[str]) -> None:
    from kvbench.results.plots import plot_main

    plot_main(args)


def folder_argument(command: str, args: list[str]) -> Path:
    """The one folder ``kvbench pack`` and ``unpack`` take."""
    if len(args) != 1 or args[0].startswith("-"):
        raise KVBenchError(
            f"kvbench {command} takes one folder (kvbench {command} DIR), not {' '.join(args) or 'none'}"
        )
    folder = Path(args[0])
    if not folder.is_dir():
        raise KVBenchError(f"kvbench {command}: {folder} is not a folder")
    return folder


def command_pack(args: list[str]) -> None:
    """DIR's run directories and sweep files as one DIR/runs.tar.xz, which table, leaderboard and plot read as
    they were (``kvbench.packed``)."""
    from kvbench.packed import pack, packed_files
    from kvbench.rundir import run_dirs_below

    folder = folder_argument("pack", args)
    writing = [run_dir.path for run_dir in map(RunDir, run_dirs_below(folder)) if run_dir.locked()]
    if writing:
        raise KVBenchError(f"kvbench pack: {writing[0]} is being written now (its run.lock is held); pack it once done")
    archive = pack(folder)
    print(f"wrote {archive}: {len(packed_files(folder))} files, {archive.stat().st_size} bytes")


def command_unpack(args: list[str]) -> None:
    """DIR/runs.tar.xz's files put back in DIR, the files already there kept (a sweep then resumes them)."""
    from kvbench.packed import PACKED, unpack

    folder = folder_argument("unpack", args)
    if not (folder / PACKED).is_file():
        raise KVBenchError(f"kvbench unpack: {folder} holds no {PACKED} (kvbench pack {folder} makes one)")
    print(f"{folder / PACKED}: {len(unpack(folder))} files written to {folder}")


def command_check_method(args: list[str]) -> None:
    """The invariants of every policy, checked on one (``SPEC [--model NAME]``; kvbench/check.py): a line per check,
    exit 1 where one fails."""
    from kvbench.check import check_method

    model = "tiny_llama"
    if len(args) == 3 and args[1] == "--model":
        model = args[2]
    elif len(args) != 1 or args[0].startswith("-"):
        raise KVBenchError(
            f"kvbench check-method takes a policy spec (SPEC [--model NAME]), not {' '.join(args) or 'none'}"
        )
    results = check_method(args[0], model)
    for what, differs in results:
        print(f"{'ok' if differs is None else 'FAILED'}  {what}" + ("" if differs is None else f": {differs}"))
    failed = sum(differs is not None for _, differs in results)
    print(f"kvbench check-method {args[0]}: {len(results) - failed} of {len(results)} checks hold on {model}")
    if failed:
        raise SystemExit(1)


COMMANDS = {
    "run": command_run,
    "plan": command_plan,
    "policies": command_policies,
    "prepare": command_prepare,
    "table": command_table,
    "leaderboard": command_leaderboard,
    "compare-paper": command_compare_paper,
    "plot": command_plot,
    "bench": command_bench,
    "pack": command_pack,
    "unpack": command_unpack,
    "check-method": command_check_method,
}


class Terminated(BaseException):
    """SIGTERM, raised where the process is, as Ctrl-C raises ``KeyboardInterrupt`` (not an ``Exception``: no
    handler of a job's failures takes it for one)."""


def on_stop_signal(signum: int, frame: Any) -> None:
    """SIGINT and SIGTERM: stop the command (:func:`stopped`), once the sample being written is on disk and counted."""
    if held_back(signum):
        return
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def stopped(stop: BaseException, command: str = "run") -> None:
    """The one line of a command stopped by a signal, and its exit status (128 + the signal's number): ``run`` says
    what it wrote and how to resume the rest, another command only that it stopped."""
    name, status = ("SIGTERM", 143) if isinstance(stop, Terminated) else ("SIGINT", 130)
    written = RunDir.appended
    line = (
        f"kvbench: stopped by {name}: {written} sample{'s' if written != 1 else ''} finished and written by this "
        "command; run the same command to resume the rest"
    )
    print(line if command == "run" else f"kvbench {command}: stopped by {name}", file=sys.stderr)
    sys.exit(status)


#: the commands that answer ``--help`` themselves (Hydra's for ``run``, argparse's for the readers of run directories)
OWN_HELP = {"run", "table", "leaderboard", "compare-paper", "plot"}


def command_help(command: str) -> str:
    """``kvbench COMMAND --help`` of a command that takes Hydra overrides or plain words: its usage lines of the
    module's docstring, then what its function says it does."""
    usage = [line.strip() for line in (__doc__ or "").splitlines() if line.strip().startswith(f"kvbench {command} ")]
    what = " ".join((COMMANDS[command].__doc__ or "").split())
    return "\n".join([*usage, "", what] if what else usage)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-v", "--verbose"):
        os.environ[VERBOSE_ENV] = "1"
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    if argv[0] == "--version":
        print(f"kvbench {__version__}")
        return
    command, args = argv[0], argv[1:]
    if command in COMMANDS and command not in OWN_HELP and ("-h" in args or "--help" in args):
        print(command_help(command))
        return
    previous = {number: signal.signal(number, on_stop_signal) for number in STOP_SIGNALS}
    try:
        if command not in COMMANDS:
            raise KVBenchError(f"unknown command {command!r}; valid choices: {', '.join(COMMANDS)}")
        COMMANDS[command](args)
    except KVBenchError as error:
        fail(str(error))
    except (KeyboardInterrupt, Terminated) as stop:
        stopped(stop, command)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if os.environ.get(PEAK_RSS_FILE):  # kvbench bench's child runs: their own peak (kvbench.bench.grid)
            write_own_peak()


if __name__ == "__main__":
    main()
