"""Query-agnostic prompts (``task.query_mode=agnostic``): where the question starts, in every prompt format."""

from __future__ import annotations

import pytest
import torch

from kvbench.config import compose
from kvbench.engine import Engine
from kvbench.engine.engine import Question, decode_rows, generate_shared, prefill_questions
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.policies import build_policy
from kvbench.run import run, run_group
from kvbench.tasks.base import ModelInfo, Task
from kvbench.tasks.ruler import RulerTask
from tests.helpers import random_prompt, tiny_model
from tests.test_groups import TINY, VARIANTS, assert_each_as_alone, outcome
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
    engines = []
    for spec in VARIANTS:
        for budget in budgets:
            try:
                engine = Engine(model, build_policy(spec), budget, record_kept=True)
                engine.generate(PROMPT, 1, question_start=QUESTION_START)
            except KVBenchError:  # a budget the policy's reserved window fills, or settings it needs the model for
                continue
            engines.append(engine)
    return engines


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
    specs = ["full", "snapkv", "h2o+caote", "tova+calidrop"]
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
    questions = [Question(context + random_prompt(length, seed=length), QUESTION_START, 6) for length in (30, 12, 21)]
    rows = prefill_questions(engines, questions, batch_size=5)
    assert [row.context_shared_by for row in rows] == [3] * len(rows)
    outputs = decode_rows(rows, batch_size=7)
    for number, question in enumerate(questions):
        alone = [engine.generate(question.input_ids, 6, question_start=QUESTION_START) for engine in engines]
        assert_each_as_alone(engines, alone, outputs[number * len(engines) : (number + 1) * len(engines)])
    with pytest.raises(ValueError, match="share its tokens"):
        prefill_questions(engines[:1], [questions[0], Question(random_prompt(150, seed=9), QUESTION_START, 6)])
