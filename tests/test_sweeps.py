"""Sweeps: experiment configs, Hydra multirun through the submitit launchers, skipping finished runs, make targets."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import get_class
from omegaconf import OmegaConf

from kvbench import CONF_DIR, PROJECT_ROOT, config_dict
from kvbench.cli import main
from kvbench.config import compose as compose_run
from kvbench.config import group_options
from kvbench.engine.tokenizers import stand_in_tokenizer
from kvbench.errors import KVBenchError
from kvbench.launch.launchers import array_name, last_line, refusal
from kvbench.launch.sweeps import (
    compose_job,
    expand_sweep,
    experiment_overrides,
    shared_config_files,
    split_pending,
    sweep_jobs,
    sweep_loader,
    sweep_overrides,
    sweeper_params,
)
from kvbench.policies import build_policy
from kvbench.rundir import STOP_SIGNALS, RunDir, run_dirs_below
from kvbench.tasks.base import ModelInfo
from tests.helpers import local_data, refused

KVBENCH = str(Path(sys.executable).parent / "kvbench")
TINY = [
    "model=tiny_llama",
    "task=ruler",
    "task.subtasks=[niah_single_1]",
    "task.context_length=512",
    "task.num_samples=1",
]
EXPERIMENTS = group_options("experiment")


def test_every_paper_has_a_paper_and_a_smoke_experiment():
    for paper in ("caote", "obcache", "calidrop", "slake"):
        assert paper in EXPERIMENTS and f"{paper}_smoke" in EXPERIMENTS


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_sweeps_compose_and_build(experiment):
    """Every job of every experiment composes (first value of the other swept keys) and its policy builds."""
    params = sweeper_params(experiment)
    assert {"model", "policy", "budget", "task"} <= set(params)
    first = {key: values.split(",")[0] for key, values in params.items() if key != "policy"}
    for policy in params["policy"].split(","):
        cfg = compose_run([f"+experiment={experiment}", f"policy={policy}", *(f"{k}={v}" for k, v in first.items())])
        assert cfg.policy.name == policy and cfg.task.name == params["task"]
        build_policy(policy, OmegaConf.to_container(cfg.policy, resolve=True))
    if experiment.endswith("_smoke"):
        assert params["model"] == "smollm2_135m"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_model_of_every_experiment_gets_a_valid_task(experiment):
    """Each swept model (and context length) with the experiment's task settings builds its task: context windows,
    prompt formats, truncation lengths and generation settings are checked without loading weights or data."""
    params = sweeper_params(experiment)
    policy, budget = params["policy"].split(",")[0], params["budget"].split(",")[0]
    for model in params["model"].split(","):
        for context in params.get("task.context_length", "").split(","):
            extra = [f"task.context_length={context}"] if context else []
            cfg = compose_run(
                [
                    f"+experiment={experiment}",
                    f"model={model}",
                    f"policy={policy}",
                    f"budget={budget}",
                    f"task={params['task']}",
                    *extra,
                ]
            )
            info = ModelInfo(
                cfg.model.name, stand_in_tokenizer(cfg.model.context_window), cfg.model.context_window, cfg.model.hf_id
            )
            get_class(cfg.task._target_)(cfg.task, info)


def test_paper_protocols_are_pinned():
    caote = compose_run(["+experiment=caote"])
    assert (caote.engine.regime, caote.engine.block_size, caote.engine.decode_evict) == ("chunked", 128, True)
    assert sweeper_params("caote")["budget"] == "2k,4k,6k,8k"
    obcache = compose_run(["+experiment=obcache_niah", "policy=snapkv"])
    assert (obcache.engine.regime, obcache.policy.window, obcache.policy.pool, obcache.policy.kernel) == (
        "oneshot",
        16,
        "max",
        7,
    )
    h2o = compose_run(["+experiment=obcache", "policy=h2o"]).policy
    assert (h2o.window, h2o.score_window, h2o.gqa) == (0.05, 0.05, "repeat")  # 5% of the budget (obcache.yaml)
    pg19 = {
        spec: compose_run(["+experiment=obcache_pg19", f"policy={spec}"]).policy for spec in ("sink", "h2o", "tova")
    }
    assert [pg19[spec].n_sink for spec in pg19] == [4, 4, 4] and pg19["h2o"].window == 256
    caote_node = compose_run(["+experiment=caote", "policy=snapkv+caote"]).policy
    assert (caote_node.power, caote_node.window, caote_node.pool) == (1.0, 32, "avg")
    calidrop = compose_run(["+experiment=calidrop", "policy=sink+calidrop"])
    assert (calidrop.policy.n_sink, calidrop.policy.theta1, calidrop.policy.theta2) == (32, 0.7, 0.85)
    assert compose_run(["+experiment=calidrop", "policy=snapkv"]).policy.window == 32
    assert sweeper_params("slake")["policy"] == "h2o,pyramidkv,cake,cake+slake"


@pytest.mark.parametrize(
    "experiment, task, expected",
    [
        (
            "calidrop",
            "longbench",
            {"prompt_format": "kvcache_factory", "max_length": None, "min_length_datasets": "all"},
        ),
        (
            "calidrop_ruler",
            "ruler",
            {
                "prompt_format": "kvcache_factory",
                "context_length": 4096,
                "num_samples": 500,
                "tokens_to_generate": 64,
                "min_new_tokens": 1,
            },
        ),
        (
            "calidrop_needle",
            "niah",
            {
                "prompt_format": "kvcache_factory",
                "context_range": {"min": 1000, "max": 8000, "step": 100},
                "depth_steps": 10,
                "buffer": 200,
            },
        ),
        ("calidrop_needle_mistral", "niah", {"context_range": {"min": 400, "max": 32000, "step": 400}}),
        (
            "caote",
            "longbench",
            {"prompt_format": "longbench_official", "max_length": None, "min_length_datasets": ["samsum"]},
        ),
        ("caote_niah", "niah", {"prompt_format": "hf_chat"}),
        ("caote_booksum", "booksum", {"num_samples": 100, "max_tokens": 12288, "min_tokens": 12288}),
        ("obcache", "longbench", {"prompt_format": "longbench_official", "max_length": 32768}),
        ("obcache_niah", "ruler", {"prompt_format": "ruler_official", "tokens_to_generate": None, "num_samples": 250}),
        ("slake", "longbench", {"prompt_format": "cake", "max_length": None, "min_length_datasets": ["samsum"]}),
        ("slake_needlebench", "needlebench", {"prompt_format": "hf_chat", "max_new_tokens": 1024}),
    ],
)
def test_paper_task_settings_are_pinned(experiment, task, expected):
    """The prompt format, truncation and generation settings each experiment file names, with their evidence."""
    cfg = OmegaConf.to_container(compose_run([f"+experiment={experiment}", f"task={task}"]).task)
    assert {key: cfg[key] for key in expected} == expected
    text = (CONF_DIR / "experiment" / f"{experiment}.yaml").read_text()
    if "prompt_format" in expected:
        assert f"prompt_format: {expected['prompt_format']}" in text  # named in the file itself, not inherited


def test_experiment_sweep_becomes_overrides_and_typed_values_win(capsys):
    args = experiment_overrides(["-m", "+experiment=caote_smoke", "policy=h2o"])
    assert args[-3:] == ["-m", "+experiment=caote_smoke", "policy=h2o"]
    injected = dict(arg.split("=", 1) for arg in args[:-3])
    assert injected == {"model": "smollm2_135m", "budget": "64,128", "task": "longbench"}
    assert experiment_overrides(["+experiment=caote_smoke"]) == ["+experiment=caote_smoke"]  # not a multirun
    assert "nope" in refused(capsys, ["run", "-m", "+experiment=nope"])


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_sweeps_each_key_once(experiment):
    """Each job of an experiment's sweep sets each key once: a dotted key swept in the file (typed
    ``++task.query_mode`` once it is an override) is not crossed with itself, so shared_context has its 36 jobs."""
    with sweep_loader([f"+experiment={experiment}"]) as (config_loader, master):
        jobs = sweep_overrides(config_loader, master)
    params = sweeper_params(experiment)
    assert len(jobs) == math.prod(len(values.split(",")) for values in params.values())
    for overrides in jobs:
        keys = [override.split("=", 1)[0].lstrip("+") for override in overrides]
        assert len(keys) == len(set(keys)), overrides


def test_launcher_configs_compose():
    slurm = compose_run(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], return_hydra_config=True)
    local = compose_run(["hydra/launcher=local"], return_hydra_config=True)
    launcher = slurm.hydra.launcher
    assert launcher._target_ == "hydra_plugins.kvbench.SlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min, launcher.array_parallelism) == (
        "gpu",
        1,
        720,
        16,
    )
    assert local.hydra.launcher._target_ == "hydra_plugins.kvbench.LocalLauncher"
    assert slurm.hydra.sweeper._target_ == "hydra_plugins.kvbench.Sweeper"


def test_array_name_says_what_runs():
    labels = [
        {"model": "llama3_8b", "policy": policy, "budget": budget, "task": "ruler"}
        for policy in ("snapkv", "h2o")
        for budget in ("64", "128", "256", "512")
    ]
    assert array_name(labels) == "kvbench-llama3_8b-snapkv,h2o-4budgets-ruler"
    assert array_name(labels[:1]) == "kvbench-llama3_8b-snapkv-64-ruler"
    assert (
        array_name([{**label, "policy": str(n)} for n, label in enumerate(labels)])
        == "kvbench-llama3_8b-8policies-4budgets-ruler"
    )


def test_sbatch_refusal_names_the_launcher_keys():
    line = refusal(
        {"partition": None, "gpus_per_node": 1, "cpus_per_task": 8, "mem_gb": 64, "timeout_min": 720},
        RuntimeError("sbatch: error: Invalid generic resource (gres) specification\n"),
    )
    assert "\n" not in line
    assert line.startswith("sbatch refused the jobs (sbatch: error: Invalid generic resource (gres) specification)")
    assert (
        "hydra.launcher.partition=null hydra.launcher.account=null hydra.launcher.qos=null "
        "hydra.launcher.gpus_per_node=1 hydra.launcher.cpus_per_task=8 hydra.launcher.mem_gb=64" in line
    )
    assert last_line("a\n  b  \n\n") == "b" and last_line("") == ""


def test_the_sweep_is_hydras_basic_product_and_other_sweeps_are_one_line():
    """kvbench's sweeper (Hydra's public plugin API) expands a sweep as Hydra's basic sweeper does: the cartesian
    product, keys in order, a later value for a key replacing it, ``+``/``~`` kept (checked against Hydra's own
    ``BasicSweeper.split_arguments``, so that a Hydra upgrade that changes it fails here); an interval sweep is
    one line."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    typed = ["policy=snapkv,h2o+caote", "budget=32,64", "+task.seed=1", "~logger", "budget=16,32,64", "model=tiny"]
    master = OmegaConf.create({"hydra": {"overrides": {"task": typed}, "sweeper": {"params": {"task.seed": "5"}}}})
    ours = sweep_overrides(None, master)
    (basic,) = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(typed), None)
    assert ours == [list(job) for job in basic] and len(ours) == 6
    assert ours[0] == ["policy=snapkv", "budget=16", "+task.seed=1", "~logger=null", "model=tiny"]
    master.hydra.overrides.task = ["budget=interval(1,4)"]
    with pytest.raises(KVBenchError, match=r"^cannot expand the sweep: kvbench's sweeper sweeps a choice or a list"):
        sweep_overrides(None, master)


def test_a_composition_reads_the_one_config_store_and_what_was_registered_after_it():
    """Hydra copies its config repository at each composition; the singleton ``ConfigStore`` in it is not copied
    (kvbench.config: a copy of every registered policy node per sweep job), and a spec registered after a
    composition is composed from the live store, its node not changed by the composition."""
    import copy

    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    assert copy.deepcopy(store) is store and copy.deepcopy({"store": store})["store"] is store
    assert compose_run([*TINY, "policy=snapkv"]).policy.name == "snapkv"
    spec = "snapkv+obcache_value+criticalkv"
    cfg = compose_run([*TINY, f"policy={spec}", "policy.window=9"])
    assert cfg.policy.name == spec and cfg.policy.window == 9
    assert store.load(f"policy/{spec}.yaml").node.window != 9  # composition reads a copy of the node
    # a node is stored again only when it changes: an experiment's settings, then the defaults, then the experiment's
    assert build_policy("snapkv").settings()["kernel"] == 5
    for experiment, kernel in ((["+experiment=obcache"], 7), ([], 5), (["+experiment=obcache"], 7)):
        assert compose_run([*TINY, *experiment, "policy=snapkv"]).policy.kernel == kernel


def test_a_sweep_jobs_overrides_typed_back_give_the_same_job(tmp_path):
    """A job's overrides as the sweep lists them (a budget in Hydra's quotes: ``budget='10pct'``), typed back as a
    sweep of that one job, give the same run directory and config (the bench runs a grid's full-cache job so)."""
    grid = sweep_jobs([*TINY, "policy=full,snapkv", "budget=10pct,20pct", f"hydra.sweep.dir={tmp_path}"])
    assert "budget='10pct'" in grid[0].overrides
    (alone,) = sweep_jobs([*grid[0].overrides, f"hydra.sweep.dir={tmp_path}"])
    assert alone.output_dir == grid[0].output_dir and alone.cfg == grid[0].cfg


def test_sweep_jobs_compose_every_job_before_submission(tmp_path):
    """sweep_jobs: each job's overrides, config, run directory and log, as the sweeper submits them."""
    jobs = sweep_jobs([*TINY, "policy=snapkv,h2o+caote", "budget=32,64", f"hydra.sweep.dir={tmp_path}"])
    assert [(job.label["policy"], job.label["budget"]) for job in jobs] == [
        ("snapkv", "32"),
        ("snapkv", "64"),
        ("h2o+caote", "32"),
        ("h2o+caote", "64"),
    ]
    first = jobs[0]
    assert re.fullmatch(r"tiny_llama/ruler/snapkv-32-oneshot-[0-9a-f]{8}", str(first.output_dir.relative_to(tmp_path)))
    assert len({job.output_dir for job in jobs}) == 4
    assert (
        first.log == first.output_dir / "kvbench.log"
        and first.cfg.model.name == "tiny_llama"
        and "hydra" not in first.cfg
    )
    assert split_pending(jobs) == ([], [], jobs)
    smoke = sweep_jobs(["+experiment=caote_smoke"])
    params = sweeper_params("caote_smoke")
    assert len(smoke) == len(params["policy"].split(",")) * len(params["budget"].split(","))
    assert all(job.output_dir.parents[2] == Path("results/smoke/caote/longbench") for job in smoke)
    with pytest.raises(KVBenchError, match="^unknown key task.nope for task ruler; valid keys: "):
        sweep_jobs([*TINY, "task.nope=1,2"])


def run_kvbench(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [KVBENCH, "run", *args], capture_output=True, text=True, cwd=PROJECT_ROOT, env=os.environ, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def submitit_job_folders(sweep: Path) -> list[str]:
    """The job folders under ``sweep/.submitit``, one per submitted job (``<array>_<task>`` on Slurm, a process id
    locally), each holding the job's pickled call."""
    return sorted(path.parent.name for path in (sweep / ".submitit").glob("*/*_submitted.pkl"))


@pytest.mark.parametrize("group", [True, False])
def test_local_launcher_multirun_completes_then_submits_nothing(tmp_path, group):
    """Two jobs (one a composite policy, registered in the ConfigStore that submitit pickles to the workers)
    through submitit's local executor, grouped (one process: they differ only in policy) or one process each;
    submitted again, nothing is submitted."""
    sweep = tmp_path / "sweep"
    args = ["-m", "hydra/launcher=local", *TINY, "policy=snapkv,h2o+caote", "budget=64", f"hydra.sweep.dir={sweep}"]
    args.append(f"hydra.sweeper.group={str(group).lower()}")
    assert f"kvbench: {sweep}: 2 jobs, 0 skipped (0 finished, 0 running), 2 submitted" in run_kvbench(*args).stdout
    jobs = [str(path.relative_to(sweep)) for path in run_dirs_below(sweep)]
    assert [job[: -len("-0123abcd")] for job in jobs] == [
        f"tiny_llama/ruler/{policy}-64-oneshot" for policy in ("h2o+caote", "snapkv")
    ]
    metrics = {job: json.loads((sweep / job / "metrics.json").read_text()) for job in jobs}
    assert {m["policy"] for m in metrics.values()} == {"snapkv", "h2o+caote"}
    assert all(
        m["num_samples"] == 1 and m["kv_cache"]["after_prefill_tokens_per_layer"] == [64] * 3 for m in metrics.values()
    )
    folders = submitit_job_folders(sweep)
    assert len(folders) == (1 if group else 2)
    stamps = {job: (sweep / job / "predictions.jsonl").stat().st_mtime_ns for job in jobs}
    result = run_kvbench(*args)
    assert f"kvbench: {sweep}: 2 jobs, 2 skipped (2 finished, 0 running), 0 submitted" in result.stdout
    assert submitit_job_folders(sweep) == folders
    assert {job: (sweep / job / "predictions.jsonl").stat().st_mtime_ns for job in jobs} == stamps


def test_every_failed_job_is_reported_and_only_unfinished_ones_resubmitted(tmp_path, monkeypatch, capsys):
    """An ad-hoc sweep (no hydra.sweep.dir: results/multirun, run directories named after each job's settings)
    with two bad values: both reported, one line each, exit status 1, the good job finished; the sweep with the
    values fixed runs only the jobs not finished."""
    monkeypatch.chdir(tmp_path)
    tiny = [arg for arg in TINY if not arg.startswith("task.context_length")]
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "-m", *tiny, "policy=tova", "budget=32", "task.context_length=-1,512,-2"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "kvbench: results/multirun: 3 jobs, 0 skipped (0 finished, 0 running), 3 submitted" in captured.out
    failures = [line for line in captured.err.splitlines() if line.startswith("kvbench: failed:")]
    assert len(failures) == 2
    for value, line in zip(("-1", "-2"), failures):
        run_dir = Path(line.split(" | ")[1].removeprefix("run dir: "))
        assert re.fullmatch(r"results/multirun/tiny_llama/ruler/tova-32-oneshot-[0-9a-f]{8}", str(run_dir))
        assert line == (
            f"kvbench: failed: {' '.join(tiny)} policy=tova budget='32' task.context_length={value} | "
            f"run dir: {run_dir} | task.context_length={value}: must be a token count ≥ 1 | "
            f"log: {run_dir / 'kvbench.log'}"
        )
        assert f"task.context_length={value}: must be" in (run_dir / "kvbench.log").read_text()
    assert "kvbench: 2 of 3 submitted jobs failed" in captured.err
    main(["run", "-m", *tiny, "policy=tova", "budget=32", "task.context_length=512,600"])
    assert (
        "kvbench: results/multirun: 2 jobs, 1 skipped (1 finished, 0 running), 1 submitted" in capsys.readouterr().out
    )


def test_a_locked_run_dir_refuses_a_second_kvbench_in_one_line(tmp_path):
    """While one process writes a run directory, ``kvbench run`` on it exits 2 with one line; a sweep skips it."""
    run_dir = RunDir(tmp_path / "run")
    with run_dir.lock():
        run_dir.claim()
        result = subprocess.run(
            [KVBENCH, "run", *TINY, f"hydra.run.dir={run_dir.path}"],
            capture_output=True,
            text=True,
            env=os.environ,
            timeout=600,
        )
        assert result.returncode == 2
        assert result.stderr.splitlines() == [
            f"kvbench: error: run directory {run_dir.path} is being written by "
            f"process {os.getpid()} on {os.uname().nodename}; wait for it to end or "
            f"stop it (its lock {run_dir.lock_path} goes with it)"
        ]
        jobs = sweep_jobs([*TINY, f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=run"])
        assert split_pending(jobs) == ([], jobs, [])
    assert not run_dir.predictions_path.exists()


def test_basic_multirun_skips_finished_and_refuses_other_settings(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    main(["run", "-m", *TINY, "policy=tova", "budget=32,64", f"hydra.sweep.dir={sweep}"])
    job = next(path for path in run_dirs_below(sweep) if path.name.startswith("tova-32-"))
    stamp = (job / "metrics.json").stat().st_mtime_ns
    main(["run", "-m", *TINY, "policy=tova", "budget=32,64", f"hydra.sweep.dir={sweep}"])
    assert (job / "metrics.json").stat().st_mtime_ns == stamp
    assert len(list(sweep.glob("multirun-*.yaml"))) == 2 and (sweep / "multirun.yaml").exists()  # each sweep's
    # another config into the same job directory is refused, in a single run and in a sweep, nothing written
    before = {path: path.read_bytes() for path in job.rglob("*") if path.is_file()}
    other = [*TINY[:3], "task.context_length=640", TINY[4], "policy=tova", "budget=32"]
    capsys.readouterr()
    for args in (["run", *other, f'hydra.run.dir="{job}"'], ["run", "-m", *other, f"hydra.sweep.dir={sweep}"]):
        if args[1] == "-m":
            args.append(f"hydra.sweep.subdir={job.relative_to(sweep)}")
        assert refused(capsys, args) == (
            f"kvbench: error: run directory {job} holds a run of other settings: "
            "task.context_length=512 there, 640 here"
            + (
                "; run into another output_dir=DIR, or pass resume=restart to move its files into "
                f"{job}/superseded-<time>/ and start again\n"
                if args[1] != "-m"
                else "; nothing submitted: give the sweep another hydra.sweep.dir, or pass resume=restart to move "
                "their files into superseded-<time>/ sub-folders\n"
            )
        )
        assert {path: path.read_bytes() for path in job.rglob("*") if path.is_file()} == before


@pytest.mark.slow
def test_make_reproduce_caote_smoke():
    """The whole CAOTE reproduction path at SCALE=smoke on SmolLM2 (several minutes on a CPU), on local data."""
    data = {
        "KVBENCH_LONGBENCH_DIR": local_data("KVBENCH_LONGBENCH_DIR", "data", "longbench"),
        "KVBENCH_PPL_FILE": local_data("KVBENCH_PPL_FILE", "data", "gutenberg", "pride_and_prejudice.txt"),
    }
    if (
        not (data["KVBENCH_LONGBENCH_DIR"] / "multifieldqa_zh.jsonl").is_file()
        or not data["KVBENCH_PPL_FILE"].is_file()
    ):
        pytest.skip("no local LongBench multifieldqa_zh.jsonl or text (KVBENCH_LONGBENCH_DIR, KVBENCH_PPL_FILE)")
    result = subprocess.run(
        ["make", "-o", ".venv/.installed", "reproduce-caote", "SCALE=smoke"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=3600,
        env={**os.environ, **{name: str(path) for name, path in data.items()}},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = PROJECT_ROOT / "results" / "smoke" / "caote" / "report"
    for name in (
        "compare_caote_table2.md",
        "compare_caote_table4.md",
        "compare_caote_table5.md",
        "longbench.md",
        "niah.md",
        "ppl.md",
        "budget_curves.png",
        "ppl_vs_length.png",
    ):
        assert (report / name).exists(), name
    assert list(report.glob("heatmap_*.png"))
    table2 = (report / "compare_caote_table2.md").read_text()
    assert "49.20" in table2 and "not run" in table2
    table4 = (report / "compare_caote_table4.md").read_text()
    assert "smollm2_135m" in table4  # our own rows: SmolLM2's PPL gaps
    assert "## caote:table13" in result.stdout


def test_a_sweeps_jobs_sharing_one_config_repository_compose_as_each_alone(tmp_path):
    """:func:`shared_config_files`: the jobs of a sweep (experiment settings per policy, modifiers, cascades,
    fractional budgets, a job with its own ``hydra.searchpath``) compose to the same configs, run directories and
    logs as when Hydra gives each its own repository; the loader is left as it was."""
    searchpath = tmp_path / "extra" / "budget"
    searchpath.mkdir(parents=True)
    (searchpath / "77.yaml").write_text('spec: "77"\n')
    args = ["+experiment=leaderboard", "policy=snapkv,snapkv+calidrop,cake+slake,kvzip+slake,h2o+obcache_joint"]
    args += ["budget=10pct,40pct", f"hydra.sweep.dir={tmp_path}/sweep"]

    def composed(jobs):
        return [(job.overrides, config_dict(job.cfg, resolve=True), job.output_dir, job.log) for job in jobs]

    with sweep_loader(args) as (loader, master):
        jobs = sweep_overrides(loader, master)
        own = [override for override in jobs[0] if not override.startswith("budget=")]
        jobs.insert(3, [*own, "budget='77'", f"hydra.searchpath=[file://{tmp_path / 'extra'}]"])
        alone = composed(compose_job(loader, master, overrides) for overrides in jobs)
        with shared_config_files(loader):
            shared = composed(compose_job(loader, master, overrides) for overrides in jobs)
        assert "_parse_overrides_and_create_caching_repo" not in vars(loader)
    assert len(alone) == 11 and shared == alone
    assert alone[3][1]["budget"] == {"spec": "77"}


def test_a_large_sweep_composed_by_forked_processes_gives_the_same_jobs_in_order(tmp_path, monkeypatch):
    """:func:`expand_sweep` with two composers of two jobs or more each (the leaderboard's settings, 10 jobs): the same
    overrides, configs, run directories and logs, in the same order, as composed in this process; each job's
    ``${run_name:}`` resolves to its own settings."""
    import kvbench.launch.sweeps as sweeps

    args = ["+experiment=leaderboard", "policy=snapkv,snapkv+calidrop,cake+slake,kvzip+slake,h2o+obcache_joint"]
    args += ["budget=10pct,40pct", f"hydra.sweep.dir={tmp_path}/sweep"]

    def composed(jobs):
        return [(job.overrides, config_dict(job.cfg, resolve=True), job.output_dir, job.log) for job in jobs]

    forks: list[int] = []
    pool = sweeps.multiprocessing.get_context

    def counted(method):
        forks.append(1)
        return pool(method)

    monkeypatch.setattr(sweeps, "usable_cpus", lambda: 2)
    with sweep_loader(args) as (loader, master):
        here = composed(expand_sweep(loader, master))
        monkeypatch.setattr(sweeps, "JOBS_PER_COMPOSER", 4)
        monkeypatch.setattr(sweeps.multiprocessing, "get_context", counted)
        forked = composed(expand_sweep(loader, master))
    assert len(here) == 10 and forked == here and forks == [1]
    assert len({config["output_dir"] for _, config, _, _ in here}) == 10  # each job's nodes its own (the deep copy)


def _signals_here(*_: object) -> tuple[object, object]:
    return signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)


def test_forked_composers_end_by_sigterm_default_and_ignore_ctrl_c(monkeypatch):
    """The composers of a large sweep do not inherit ``kvbench``'s stop handlers (a Python handler can miss the SIGTERM
    that ends a pool's worker, whose end then waits for ever; seen on ``+experiment=leaderboard``): SIGTERM at its
    default, SIGINT ignored; the sweep's own process keeps its handlers. The pool is ended 30 times as its composers
    start (with a composer's handling set after it was forked, not before it, one of two runs of 600 such ends under
    load hung at the 9th); a hang ends the test's process after 60 s rather than waiting."""
    import faulthandler

    import kvbench.launch.sweeps as sweeps
    from kvbench.cli import on_stop_signal

    monkeypatch.setattr(sweeps, "usable_cpus", lambda: 2)
    monkeypatch.setattr(sweeps, "JOBS_PER_COMPOSER", 4)
    monkeypatch.setattr(sweeps, "compose_job", _signals_here)
    previous = {number: signal.signal(number, on_stop_signal) for number in STOP_SIGNALS}  # as kvbench.cli.main
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        with sweep_loader(["policy=snapkv,h2o", "budget=10pct,20pct,40pct,64"]) as (loader, master):
            seen = [expand_sweep(loader, master) for _ in range(30)]
        assert _signals_here() == (on_stop_signal, on_stop_signal)
    finally:
        faulthandler.cancel_dump_traceback_later()
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert seen == [[(signal.SIG_DFL, signal.SIG_IGN)] * 8] * 30
