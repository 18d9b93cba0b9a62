"""The math tasks (``gsm8k``, ``math500``, ``aime24``, ``aime25``): the question in one chat turn with the \\boxed{}
instruction, the final answer read from the trace and matched as a number against GSM8K's ``#### N`` or judged by
math-verify, and a real run's records saying how long each trace ran."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

import kvbench
from kvbench.errors import KVBenchError
from kvbench.metrics.math import final_answer, gsm8k_match, last_boxed, math_verify_match
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.math import MathTask
from tests.helpers import refused
from tests.test_qa_task import tokenizer, write_rows  # noqa: F401  (the fixture)

ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?",
     "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 1,000 pencils. How many are in 2 boxes?", "answer": "2 * 1000 = 2000\n#### 2,000"},
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "boxed"),
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # nested braces kept
        ("first \\boxed{3}, then \\boxed{4}", "4"),  # several boxes: the last
        ("\\boxed{{a}{b}} and text", "{a}{b}"),
        ("no box at all: 12", None),
        ("cut inside \\boxed{\\frac{1}{", None),  # unclosed
    ],
)
def test_the_last_box_is_read_with_its_braces_balanced(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    ("prediction", "solution", "score"),
    [
        ("3 + 4 = 7, so the answer is \\boxed{7}.", "#### 7", 1.0),
        ("The answer is \\boxed{1,234}", "x\n#### 1234", 1.0),  # thousands separators on either side
        ("He pays $18.00 in total.", "#### 18", 1.0),  # no box: the last number, $ and decimals read as a number
        ("It is 5 then 7.", "#### 7", 1.0),
        ("It is 7 then 5.", "#### 7", 0.0),  # the last number, not any
        ("\\boxed{7} but later \\boxed{8}", "#### 7", 0.0),
        ("\\boxed{x + 1}", "#### 1", 1.0),  # the box's first number
        ("\\boxed{x}", "#### 1", 0.0),  # a box without a number matches nothing
        ("\\boxed{-3}", "#### -3", 1.0),
        ("nothing numeric", "#### 0", 0.0),
    ],
)
def test_gsm8k_match_hand_computed(prediction, solution, score):
    assert gsm8k_match(prediction, [solution]) == score


@pytest.mark.parametrize(
    ("prediction", "answer", "score"),
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),  # a fraction equals its decimal
        ("\\boxed{\\sqrt{\\frac{3}{4}}}", "\\frac{\\sqrt{3}}{2}", 1.0),  # nested braces, symbolic equality
        (
            "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
            1.0,
        ),  # MATH-500's tuples
        ("The answer is 7.", "7", 1.0),  # no box: the last expression
        ("\\boxed{5}", "7", 0.0),
        ("", "7", 0.0),
        ("first \\boxed{3} then \\boxed{4}", "4", 0.0),  # several boxes: math-verify reads one set {3, 4}
        ("first \\boxed{3} then \\boxed{4}", "\\{3, 4\\}", 1.0),
        ("\\boxed{204}", "204", 1.0),  # AIME's integers
    ],
)
def test_math_verify_as_documented(prediction, answer, score):
    assert math_verify_match(prediction, [answer]) == score


def test_a_final_answer_is_the_box_else_the_last_number():
    assert final_answer("a 1 b \\boxed{2} c 3") == "2" and final_answer("a 1 b 3.5.") == "3.5"
    assert final_answer("none") is None


def make_task(tokenizer, path, **overrides) -> MathTask:  # noqa: F811
    cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / "gsm8k.yaml")
    cfg.path = str(path)
    for key, value in overrides.items():
        cfg[key] = value
    return MathTask(cfg, ModelInfo("test", tokenizer, 4096))


def test_the_question_is_one_chat_turn_with_the_boxed_instruction(tokenizer, tmp_path):  # noqa: F811
    task = make_task(tokenizer, write_rows(tmp_path / "rows.jsonl", ROWS))
    samples = list(task.samples())
    instruction = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    for sample, row in zip(samples, ROWS):
        chat = [{"role": "user", "content": row["question"] + instruction}]
        assert sample.input_ids == tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        assert sample.answers == [row["answer"]] and sample.max_new_tokens == 512
    assert [sample.id for sample in samples] == ["gsm8k-0", "gsm8k-1"] and samples[0].subtask == "gsm8k"
    assert task.score(samples[1], "2 boxes of 1000: \\boxed{2000}") == 1.0
    # no context: the problems share none, so each is its own cluster of the bootstrap intervals
    assert all(sample.context_id is None for sample in samples)


def test_math500_rows_read_their_problem_column_and_are_judged_by_math_verify(tokenizer, tmp_path):  # noqa: F811
    rows = [{"problem": "What is $1/2 + 1/4$?", "answer": "\\frac{3}{4}", "unique_id": "test/algebra/1.json"}]
    cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / "math500.yaml")
    cfg.path = str(write_rows(tmp_path / "math.jsonl", rows))
    task = MathTask(cfg, ModelInfo("test", tokenizer, 8192))
    (sample,) = list(task.samples())
    instruction = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    chat = [{"role": "user", "content": rows[0]["problem"] + instruction}]
    assert sample.input_ids == tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert sample.id == "math500-0" and sample.max_new_tokens == 4096
    assert task.score(sample, "so $\\boxed{0.75}$") == 1.0 and task.score(sample, "\\boxed{3/5}") == 0.0
    for name in ("aime24", "aime25"):
        aime = OmegaConf.load(kvbench.CONF_DIR / "task" / f"{name}.yaml")
        assert aime.metric == "math_verify" and aime.columns.question == "problem" and aime.dataset == name


def test_a_prompt_without_the_question_is_one_line(tokenizer, tmp_path):  # noqa: F811
    with pytest.raises(KVBenchError, match=r"^task.prompt=Solve it.: must be a text with \{question\}"):
        MathTask.check(
            OmegaConf.merge(OmegaConf.load(kvbench.CONF_DIR / "task" / "gsm8k.yaml"), {"prompt": "Solve it."})
        )


@pytest.mark.parametrize("task", ["gsm8k", "math500", "aime25"])
def test_agnostic_is_refused_in_one_line_naming_the_task(task, capsys, tmp_path):
    """A math prompt is its question: ``task.query_mode=agnostic`` has no context to compress and is refused before
    anything loads, the task named by its own name (one class serves the four)."""
    rows = write_rows(tmp_path / "rows.jsonl", [{"question": "1+1?", "problem": "1+1?", "answer": "#### 2"}])
    run = ["run", "model=tiny_llama", f"task={task}", f"task.path={rows}", "task.query_mode=agnostic"]
    line = refused(capsys, [*run, f"output_dir={tmp_path / 'run'}"], tmp_path / "run")
    assert f"task.query_mode=agnostic: must be aware (task {task} cannot split its prompts" in line


@pytest.mark.model
def test_a_streaming_run_records_each_traces_length(tmp_path):
    """``kvbench run task=gsm8k`` on SmolLM2, H2O evicting while it decodes: each record's generated tokens and whether
    the model stopped before the cap, their mean in metrics.json."""
    from kvbench.cli import main

    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "run"
    main(["run", "model=smollm2_135m", "task=gsm8k", f"task.path={path}", "task.max_new_tokens=24", "policy=h2o",
          "budget=64", "engine.regime=streaming", f"output_dir={out}"])  # fmt: skip
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    metrics = json.loads((out / "metrics.json").read_text())
    assert [record["id"] for record in records] == ["gsm8k-0", "gsm8k-1"] and set(metrics["scores"]) == {"gsm8k"}
    for record in records:
        assert 0 < record["generated_tokens"] <= 24 and record["stopped"] == (record["generated_tokens"] < 24)
        assert max(record["kv"]["peak_tokens_per_layer"]) <= 64 + 1  # the budget, and the token being written
        over = record["kv"]["generation"]  # the evicting cache's bytes after each decode step
        assert len(over["curve"]) == record["generated_tokens"] - 1 and over["peak_bytes"] <= record["kv"]["peak_bytes"]
    assert metrics["generation"]["mean_generated_tokens"] == sum(r["generated_tokens"] for r in records) / 2


@pytest.mark.model
@pytest.mark.filterwarnings("error::DeprecationWarning:kvbench")  # e.g. pandas 4 refusing what pandas 3 warns of
def test_the_leaderboards_decode_track_at_smoke_scale(tmp_path, capsys):
    """``+experiment=leaderboard_reasoning_smoke`` on hand-written GSM8K rows: one grouped sweep, the full cache, H2O
    and R-KV evicting while they decode (every 8 tokens back to 32), then ``kvbench leaderboard``'s cells with the
    mean trace length and the cache's mean peak beside each score; every job of the paper-scale sweep is valid."""
    from kvbench.cli import main

    path = write_rows(tmp_path / "rows.jsonl", ROWS)
    main(["run", "-m", "+experiment=leaderboard_reasoning_smoke", f"task.path={path}", f"hydra.sweep.dir={tmp_path}"])
    runs = sorted(path.parent.name for path in tmp_path.glob("smollm2_135m/gsm8k/*/metrics.json"))
    assert [name.split("-")[0] for name in runs] == ["full", "h2o", "rkv"]
    for name in runs:
        records = [
            json.loads(line) for line in next(tmp_path.glob(f"*/*/{name}/predictions.jsonl")).read_text().splitlines()
        ]
        assert len(records) == 2 and all(0 < record["generated_tokens"] <= 32 for record in records)
        if not name.startswith("full"):  # evicting while it decodes: the budget and at most an interval more
            for kv in (record["kv"] for record in records):
                layers, kept = len(kv["after_prefill_tokens_per_layer"]), sum(kv["after_prefill_tokens_per_layer"])
                assert (
                    kept == 32 * layers and kv["generation"]["peak_bytes"] <= (32 + 8) / 32 * kv["after_prefill_bytes"]
                )
    capsys.readouterr()
    main(["leaderboard", str(tmp_path)])
    cells = capsys.readouterr().out
    assert all(cost in cells for cost in ("generated", "kv_peak_mib", "kv_mean_mib")) and cells.count("| gsm8k ") >= 3
    main(["plan", "-m", "+experiment=leaderboard_reasoning", f"task.path={path}"])
    assert "12 jobs, 0 invalid" in capsys.readouterr().err
