"""Query-agnostic prompts (``task.query_mode=agnostic``): where the question starts, in every prompt format."""

from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from kvbench import CONF_DIR, PROJECT_ROOT
from kvbench.cli import main
from kvbench.config import compose
from kvbench.engine import Engine
from kvbench.engine.rows import decode_rows
from kvbench.engine.shared import Prompt, generate_shared, prefill_questions
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.finished import load_runs
from kvbench.job import resolve
from kvbench.models import load_model
from kvbench.policies import build_policy
from kvbench.results.intervals import bootstrap_mean, paired_difference
from kvbench.results.leaderboard import leaderboard_tables
from kvbench.results.table import benchmark_tables
from kvbench.run import build_engine, build_task, run, run_group, run_sample
from kvbench.tasks.base import ModelInfo, Task
from kvbench.tasks.longbench import LongBenchTask
from kvbench.tasks.ruler import RulerTask
from tests.helpers import VARIANTS, assert_each_as_alone, random_prompt, registry_engines, tiny_model
from tests.test_groups import TINY, outcome
from tests.test_longbench import FIXTURES
from tests.test_ruler import ruler_cfg

SUBTASKS = ["niah_single_1", "niah_multikey_1", "niah_multiquery", "vt", "fwe"]  # cwe: beyond 4k bytes
FORMATS = [  # RULER's prompt formats, each with a model whose template it picks
    ("ruler_official", "meta-llama/Llama-3.1-8B-Instruct"),
    ("ruler_official", "meta-llama/Llama-2-7b-chat-hf"),
    ("ruler_official", "Qwen/Qwen2.5-7B-Instruct"),
    ("kvcache_factory", "meta-llama/Meta-Llama-3-8B-Instruct"),
    ("raw", None),
]


def samples(model: ModelInfo, query_mode: str, **settings) -> dict[str, object]:
    settings = {"subtasks": SUBTASKS, "context_length": 4096, "num_samples": 2, "query_mode": query_mode, **settings}
    task = RulerTask(ruler_cfg(**settings), model)
    return {sample.id: sample for sample in task.samples()}


def check_split(model: ModelInfo, **settings) -> None:
    """The agnostic prompt's tokens are the aware prompt's; its context holds the haystack and nothing of the
    question, which starts its question part."""
    aware, agnostic = samples(model, "aware", **settings), samples(model, "agnostic", **settings)
    assert aware.keys() == agnostic.keys()
    for key, sample in agnostic.items():
        assert sample.input_ids == aware[key].input_ids and aware[key].question_start is None
        assert sample.question_start is not None and 0 < sample.question_start < len(sample.input_ids)
        context = model.decode(sample.input_ids[: sample.question_start])
        question = model.decode(sample.input_ids[sample.question_start :])
        first_line = question.strip().splitlines()[0]
        assert first_line.startswith(("What ", "Question:")), (key, question[:80])
        if sample.subtask != "cwe":  # cwe's worked example asks the same question
            assert first_line not in context, key
        if sample.subtask.startswith("niah"):
            assert "special magic" in context and "for" in question


@pytest.mark.parametrize(("prompt_format", "hf_id"), FORMATS)
def test_the_question_starts_where_the_context_ends_in_every_format(prompt_format, hf_id):
    check_split(ModelInfo("m", byte_tokenizer(4096), 4096, hf_id), prompt_format=prompt_format)


@pytest.mark.model
def test_the_question_starts_where_the_context_ends_in_a_chat_template():
    from kvbench.models import load_tokenizer, model_config

    cfg = model_config("smollm2_135m")
    model = ModelInfo(cfg.name, load_tokenizer(cfg), int(cfg.context_window), cfg.hf_id)
    check_split(model, prompt_format="hf_chat", subtasks=[*SUBTASKS, "cwe"])
    check_split(model, prompt_format="ruler_official")


def test_a_task_that_cannot_split_its_prompts_refuses_agnostic_in_one_line(tmp_path):
    """Every task but RULER has no context/question split: ``query_mode=agnostic`` is refused before anything
    loads; RULER's files have none either."""
    from kvbench.tasks.needle import NeedleTask
    from kvbench.tasks.ppl import PerplexityTask

    for task in (PerplexityTask, NeedleTask):
        with pytest.raises(KVBenchError, match=rf"task.query_mode=agnostic: must be aware \(task {task.name} cannot"):
            task.check({"query_mode": "agnostic"})
    RulerTask.check({"query_mode": "agnostic"})
    with pytest.raises(KVBenchError, match="must be one of aware, agnostic"):
        RulerTask.check({"query_mode": "both"})
    with pytest.raises(KVBenchError, match="task.query_mode=agnostic needs generated samples"):
        RulerTask(ruler_cfg(query_mode="agnostic", data_dir=str(tmp_path)), ModelInfo("m", byte_tokenizer(4096), 4096))
    assert Task.splits_prompts is False


# --- the engine: the context compressed alone, the question read after it -----------------------------------------

PROMPT, QUESTION_START = random_prompt(160), 130


def variants(model, budgets) -> list[Engine]:
    """Every base × {none, each applicable modifier} at ``budgets`` that it can run (as tests/test_groups.py)."""
    cases = [(budget, "oneshot", {}) for budget in budgets]
    return registry_engines(model, cases, QUESTION_START, (True,), record_kept=True)[0]


def test_agnostic_with_a_budget_that_holds_the_context_is_the_full_cache():
    """A budget ≥ the context evicts nothing: every variant gives the full cache's tokens, and the full cache read as
    context then question gives what it gives read at once (the same logits to float32 rounding)."""
    model = tiny_model()
    full = Engine(model, build_policy("full"), 512)
    aware = full.generate(PROMPT, 8)
    agnostic = full.generate(PROMPT, 8, question_start=QUESTION_START)
    assert agnostic.token_ids == aware.token_ids
    at_once = full.prefilled_row(PROMPT, 1).logits
    in_two = full.prefilled_row(PROMPT, 1, question_start=QUESTION_START).logits
    assert torch.allclose(at_once, in_two, atol=1e-5)
    engines = variants(model, [QUESTION_START])
    assert len(engines) > len(VARIANTS) / 2
    for engine in engines:
        output = engine.generate(PROMPT, 8, question_start=QUESTION_START)
        assert output.token_ids == agnostic.token_ids, engine.policy.spec


def test_agnostic_evicts_from_the_context_alone_and_keeps_the_question():
    """At a budget below the context, the cache after prefill holds the budget's share of the context and every
    question token; SnapKV's observation window is then the context's end, not the question, so it keeps other
    tokens than when it sees the question."""
    model = tiny_model()
    engine = Engine(model, build_policy("snapkv"), 48, record_kept=True)
    row = engine.prefilled_row(PROMPT, 1, question_start=QUESTION_START)
    question = len(PROMPT) - QUESTION_START
    assert row.cache.tokens_per_layer() == [48 + question] * engine.num_layers
    kept = [positions[0].tolist() for positions in row.cache.kept_positions()]  # [layer][kv head][slot]
    heads = [head for layer in kept for head in layer]
    assert all(head[-question:] == list(range(QUESTION_START, len(PROMPT))) for head in heads)
    assert all(max(head[:48]) < QUESTION_START for head in heads)
    aware = engine.generate(PROMPT, 1)
    assert engine.generate(PROMPT, 1, question_start=QUESTION_START).kept == kept != aware.kept


def test_agnostic_variants_sharing_a_prefill_give_what_each_gives_alone():
    """:func:`generate_shared` with a question: one forward of the context for the variants, then the question read
    by each as a row: every variant's tokens, kept sets, cache sizes and policy statistics equal its own run's."""
    engines = variants(tiny_model(), [32, 48])
    alone = [engine.generate(PROMPT, 6, question_start=QUESTION_START) for engine in engines]
    shared = generate_shared(engines, PROMPT, 6, batch_size=4, question_start=QUESTION_START)
    assert_each_as_alone(engines, alone, shared)


def test_an_agnostic_sweep_gives_what_its_runs_give_alone(tmp_path):
    """``task.query_mode=agnostic`` through ``kvbench run``: a grouped sweep and one run each write the same records."""
    specs = ["full", "snapkv", "h2o+caote", "tova+calidrop", "kvzip"]
    cfgs = [compose([*TINY, "task.query_mode=agnostic", f"policy={spec}", "budget=64"]) for spec in specs]
    for number, cfg in enumerate(cfgs):
        run(cfg, tmp_path / "separate" / str(number))
    run_group([(cfg, tmp_path / "grouped" / str(number)) for number, cfg in enumerate(cfgs)], True)
    for number, spec in enumerate(specs):
        assert outcome(tmp_path / "grouped" / str(number)) == outcome(tmp_path / "separate" / str(number)), spec


def test_each_question_of_a_context_is_answered_as_if_it_were_alone():
    """Three questions of one context through :func:`prefill_questions`: the context compressed once per variant, each
    question read into its own copy of the compressed cache — question 2 after question 1 gives what question 2 gives
    alone (tokens, kept sets, cache sizes, policy statistics), for every variant, so the cache is really restored."""
    engines = variants(tiny_model(), [32, 48])
    context = PROMPT[:QUESTION_START]
    questions = [
        Prompt(context + random_prompt(length, seed=length), 6, question_start=QUESTION_START)
        for length in (30, 12, 21)
    ]
    rows = prefill_questions(engines, questions, batch_size=5)
    assert [row.context_shared_by for row in rows] == [3] * len(rows)
    outputs = decode_rows(rows, batch_size=7)
    for number, question in enumerate(questions):
        alone = [engine.generate(question.input_ids, 6, question_start=QUESTION_START) for engine in engines]
        assert_each_as_alone(engines, alone, outputs[number * len(engines) : (number + 1) * len(engines)])
    with pytest.raises(ValueError, match="share its tokens"):
        prefill_questions(
            engines[:1], [questions[0], Prompt(random_prompt(150, seed=9), 6, question_start=QUESTION_START)]
        )


def test_several_questions_ask_about_one_haystack():
    """``task.questions_per_context=4`` on niah_multikey_1: four consecutive samples share a haystack and a
    ``context_id``, each asks about another of its four keys (its answer a needle of the haystack), and in
    ``agnostic`` their context tokens are one; one question per context is the sample of today."""
    model = ModelInfo("m", byte_tokenizer(4096), 4096, "meta-llama/Llama-3.1-8B-Instruct")
    settings = {"subtasks": ["niah_multikey_1"], "num_samples": 6}
    asked = list(samples(model, "agnostic", questions_per_context=4, **settings).values())
    assert [sample.context_id for sample in asked] == ["niah_multikey_1-context-0"] * 4 + [
        "niah_multikey_1-context-1"
    ] * 2
    first = asked[:4]
    contexts = {tuple(sample.input_ids[: sample.question_start]) for sample in first}
    assert len(contexts) == 1 and len({sample.answers[0] for sample in first}) == 4
    context = model.decode(list(contexts.pop()))
    assert all(sample.answers[0] in context for sample in first)
    aware = list(samples(model, "aware", questions_per_context=4, **settings).values())
    assert [sample.input_ids for sample in aware] == [sample.input_ids for sample in asked]
    alone = samples(model, "aware", **settings)
    assert all(sample.context_id is None for sample in alone.values())
    assert (
        alone["niah_multikey_1-0"].input_ids
        == samples(model, "aware", subtasks=["niah_multikey_1"], num_samples=1)["niah_multikey_1-0"].input_ids
    )


def test_more_questions_than_a_haystack_holds_are_refused_in_one_line():
    """A subtask whose haystack holds fewer questions, RULER's files, or no question at all."""
    model = ModelInfo("m", byte_tokenizer(4096), 4096)
    with pytest.raises(
        KVBenchError,
        match=r"^task.questions_per_context=2: RULER niah_single_1 can be asked 1 .*"
        r"subtasks that hold 2: niah_multikey_1$",
    ):
        RulerTask(ruler_cfg(subtasks=["niah_single_1"], questions_per_context=2), model)
    with pytest.raises(KVBenchError, match="hold 5: none"):
        RulerTask(ruler_cfg(subtasks=["niah_multikey_1"], questions_per_context=5), model)
    with pytest.raises(KVBenchError, match="task.questions_per_context=2 needs generated samples"):
        RulerTask(ruler_cfg(subtasks=["niah_multikey_1"], questions_per_context=2, data_dir="/tmp"), model)
    with pytest.raises(KVBenchError, match="task.questions_per_context=0: must be a question count"):
        RulerTask.check({"questions_per_context": 0})


def records_alone(cfg) -> list[dict]:
    """The records of ``cfg``'s samples, each question answered by a run of its own (one sample at a time, its
    context compressed for it alone), less their timings."""
    job = resolve(cfg)
    loaded = load_model(job.model)
    task = build_task(job.cfg, loaded.tokenizer)
    engine = build_engine(job, loaded)
    records = []
    for sample in task.samples():
        record, _ = run_sample(engine, task, sample, loaded)
        record.pop("timing")
        records.append(record)
    return records


def test_a_run_compresses_each_context_once_and_answers_each_question_as_alone(tmp_path):
    """``kvbench run`` with four questions per context, agnostic: one compression per context and variant (the
    records' shares of it sum to the contexts), each question's prediction what the engine gives it alone; a grouped
    sweep writes what its runs write."""
    settings = ["task.subtasks=[niah_multikey_1]", "task.questions_per_context=4", "task.num_samples=6"]
    settings += ["task.context_length=1024", "task.tokens_to_generate=8"]
    specs = ["full", "snapkv", "h2o+caote", "tova+calidrop", "kvzip"]
    cfgs = [compose([*TINY, *settings, "task.query_mode=agnostic", f"policy={spec}", "budget=64"]) for spec in specs]
    for number, cfg in enumerate(cfgs):
        run(cfg, tmp_path / "separate" / str(number))
    run_group([(cfg, tmp_path / "grouped" / str(number)) for number, cfg in enumerate(cfgs)], True)
    alone = records_alone(cfgs[1])
    assert outcome(tmp_path / "separate" / "1")["records"] == alone
    for number, spec in enumerate(specs):
        assert outcome(tmp_path / "grouped" / str(number)) == outcome(tmp_path / "separate" / str(number)), spec
        lines = (tmp_path / "grouped" / str(number) / "predictions.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [record["context_id"] for record in records] == [record["context_id"] for record in alone]
        assert sum(1 / record["timing"].get("context_shared_by", 1) for record in records) == pytest.approx(2)


def test_the_tables_put_aware_and_agnostic_side_by_side_and_cluster_by_context(tmp_path):
    """``kvbench table`` on runs of both query modes: the RULER table keeps them apart, ``query_modes`` puts their
    averages side by side with the difference and the agnostic run's compressions (one per context); the
    leaderboard gives the agnostic runs cells of their own, their intervals resampling whole contexts."""
    settings = ["task.subtasks=[niah_multikey_1]", "task.questions_per_context=4", "task.num_samples=8"]
    settings += ["task.context_length=1024", "task.tokens_to_generate=8", "budget=64"]
    for mode in ("aware", "agnostic"):
        for spec in ("full", "snapkv"):
            run(compose([*TINY, *settings, f"task.query_mode={mode}", f"policy={spec}"]), tmp_path / mode / spec)
    runs = load_runs([tmp_path])
    tables = benchmark_tables(runs)
    assert sorted(tables["ruler"]["query_mode"]) == ["agnostic", "agnostic", "aware", "aware"]
    side = tables["query_modes"].set_index("policy")
    assert list(side.columns[-10:-4]) == ["aware", "agnostic", "agnostic − aware", "Δ low", "Δ high", "n"]
    assert side.loc["full", "aware"] == side.loc["full", "agnostic"]  # nothing evicted: the same predictions
    assert side.loc["full", "Δ low"] == side.loc["full", "Δ high"] == 0
    assert list(side["agnostic compressions"]) == list(side["contexts"]) == [2.0, 2.0]  # two contexts of 4 questions
    for policy in ("full", "snapkv"):
        by_mode = {run.query_mode: run for run in runs if run.metrics["policy"] == policy}
        averages = {mode: run.metrics["average"] for mode, run in by_mode.items()}
        assert side.loc[policy, "agnostic − aware"] == pytest.approx(averages["agnostic"] - averages["aware"])
        scores = {mode: {r["id"]: 100.0 * r["score"] for r in run.records} for mode, run in by_mode.items()}
        clusters = {r["id"]: r["context_id"] for r in by_mode["agnostic"].records}
        paired = paired_difference(scores["agnostic"], scores["aware"], clusters=clusters)
        assert (side.loc[policy, "Δ low"], side.loc[policy, "Δ high"]) == (paired.low, paired.high)
    cells = leaderboard_tables(runs)["leaderboard_cells"]
    agnostic = cells[(cells["task"] == "ruler-agnostic") & (cells["policy"] == "snapkv")].iloc[0]
    snapkv = next(run for run in runs if run.query_mode == "agnostic" and run.metrics["policy"] == "snapkv")
    scores = [100.0 * record["score"] for record in snapkv.records]
    contexts = [record["context_id"] for record in snapkv.records]
    assert (agnostic["low"], agnostic["high"]) == pytest.approx(
        (bootstrap_mean(scores, clusters=contexts).low, bootstrap_mean(scores, clusters=contexts).high)
    )
    assert set(cells["task"]) == {"ruler", "ruler-agnostic"}


LONGBENCH_FORMATS = [  # LongBench's prompt formats, each with a model whose template it picks
    ("longbench_official", "meta-llama/Llama-3.1-8B-Instruct"),
    ("kvcache_factory", "meta-llama/Meta-Llama-3-8B-Instruct"),
    ("cake", "meta-llama/Llama-2-7b-chat-hf"),
    ("raw", None),
]


def longbench_records(folder) -> list[dict]:
    """The fixture's hotpotqa records, and two more questions about the first one's context, written to ``folder``:
    three questions share a context, the file order interleaving them with the others."""
    records = [json.loads(line) for line in (FIXTURES / "hotpotqa.jsonl").read_text().splitlines()]
    shared = records[0]
    more = [
        {**shared, "_id": "again-1", "input": "Where is the Blue Owl Library?"},
        {**shared, "_id": "again-2", "input": "Which library opened in 1911 in the northern port city?"},
    ]
    records = [records[0], records[1], more[0], records[2], more[1]]
    (folder / "hotpotqa.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return records


def longbench(folder, query_mode: str, prompt_format: str = "longbench_official", hf_id=None) -> list:
    cfg = OmegaConf.load(CONF_DIR / "task" / "longbench.yaml")
    cfg.merge_with({"data_dir": str(folder), "datasets": ["hotpotqa"], "query_mode": query_mode})
    cfg.prompt_format = prompt_format
    return list(LongBenchTask(cfg, ModelInfo("m", byte_tokenizer(4096), 4096, hf_id)).samples())


@pytest.mark.parametrize(("prompt_format", "hf_id"), LONGBENCH_FORMATS)
def test_longbench_splits_its_prompts_and_groups_the_questions_of_one_context(tmp_path, prompt_format, hf_id):
    """LongBench agnostic: the tokens are the aware prompt's, the context holds the passages and nothing of the
    question (it starts the question part); records with one context carry one ``context_id`` and, agnostic, follow
    one another (file order within a context), their context tokens one."""
    records = longbench_records(tmp_path)
    aware = {sample.id: sample for sample in longbench(tmp_path, "aware", prompt_format, hf_id)}
    agnostic = longbench(tmp_path, "agnostic", prompt_format, hf_id)
    assert list(aware) == [record["_id"] for record in records]
    assert [sample.id for sample in agnostic] == ["fixture-hotpotqa-0", "again-1", "again-2"] + [
        "fixture-hotpotqa-1",
        "fixture-hotpotqa-2",
    ]
    model = ModelInfo("m", byte_tokenizer(4096), 4096)
    for sample in agnostic:
        assert sample.input_ids == aware[sample.id].input_ids and aware[sample.id].question_start is None
        assert sample.context_id == aware[sample.id].context_id
        context = model.decode(sample.input_ids[: sample.question_start])
        question = model.decode(sample.input_ids[sample.question_start :])
        assert "Passage 1:" in context and "Question:" not in context
        assert question.lstrip().startswith("Answer the question based on the given passages")
    first = agnostic[:3]
    assert len({sample.context_id for sample in first}) == 1 and first[0].context_id is not None
    assert len({tuple(sample.input_ids[: sample.question_start]) for sample in first}) == 1
    assert all(sample.context_id is None for sample in agnostic[3:])


def test_a_longbench_run_compresses_each_shared_context_once(tmp_path):
    """``kvbench run`` on LongBench, agnostic: the three questions of one context from one compression (the
    records' shares sum to 3 contexts for 5 questions), each record what the question gives answered alone; a
    grouped sweep writes what its runs write."""
    longbench_records(tmp_path)
    settings = ["model=tiny_llama", "task=longbench", f"task.data_dir={tmp_path}", "task.datasets=[hotpotqa]"]
    settings += ["task.query_mode=agnostic", "budget=48", "engine.save_kept=true"]
    cfgs = [compose([*settings, f"policy={spec}"]) for spec in ("snapkv", "tova+calidrop")]
    for number, cfg in enumerate(cfgs):
        run(cfg, tmp_path / "separate" / str(number))
    run_group([(cfg, tmp_path / "grouped" / str(number)) for number, cfg in enumerate(cfgs)], True)
    alone = records_alone(cfgs[0])
    assert outcome(tmp_path / "separate" / "0")["records"] == alone
    for number in range(len(cfgs)):
        assert outcome(tmp_path / "grouped" / str(number)) == outcome(tmp_path / "separate" / str(number))
        lines = (tmp_path / "grouped" / str(number) / "predictions.jsonl").read_text().splitlines()
        shares = [json.loads(line)["timing"].get("context_shared_by", 1) for line in lines]
        assert shares == [3, 3, 3, 1, 1]


def test_the_committed_shared_context_runs_regenerate_the_results_page_table(tmp_path):
    """``results/shared_context``'s run directories give its report's ``query_modes`` table byte for byte, and
    docs/results.md quotes it as it is (``kvbench table results/shared_context --layout query_modes``); it holds every
    job of the experiment."""
    from kvbench.launch.sweeps import sweeper_params

    committed = PROJECT_ROOT / "results" / "shared_context"
    if not (committed / "report").is_dir():
        pytest.skip("results/shared_context has no report")
    main(["table", str(committed), "--layout", "query_modes", "--output-dir", str(tmp_path)])
    made = (tmp_path / "query_modes.md").read_text()
    assert made == (committed / "report" / "query_modes.md").read_text()
    assert made.strip() in (PROJECT_ROOT / "docs" / "results.md").read_text()
    runs = load_runs([committed])
    params = sweeper_params("shared_context")  # every job of the experiment, its policies read from the registry
    assert len(runs) == math.prod(len(values.split(",")) for values in params.values())
    assert all(run.metrics["num_samples"] == 100 for run in runs)


@pytest.mark.slow  # 41 s; what it runs is tested piece by piece above
@pytest.mark.model
def test_make_shared_context_smoke(tmp_path):
    """``make shared-context SCALE=smoke``: SmolLM2 answers two haystacks' four questions in both modes, and the
    report puts them side by side: the full cache the same either way, two compressions per agnostic run."""
    command = ["make", "-o", ".venv/.installed", "shared-context", "SCALE=smoke", f"SHARED_CONTEXT_DIR={tmp_path}"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "report" / "query_modes.md").read_text().splitlines()
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]] for line in table[2:]}
    assert set(rows) == {"full", "snapkv"}
    header = [cell.strip() for cell in table[0].split("|")[2:-1]]
    full = dict(zip(header, rows["full"]))
    assert full["aware"] == full["agnostic"] and full["agnostic − aware"] == "0.00"
    assert [dict(zip(header, row))["agnostic compressions"] for row in rows.values()] == ["2.00", "2.00"]
