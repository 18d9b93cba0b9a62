"""``task=qa``: rows of context/question/answer from a file, prompted as kvpress prompts them, cut as LongBench cuts,
split for query-agnostic runs, and scored by the metric the dataset names."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow
import pyarrow.parquet
import pytest
from omegaconf import OmegaConf

import kvbench
from kvbench.errors import KVBenchError
from kvbench.metrics.qa import chosen_letter, qa_score
from kvbench.models import load_tokenizer, model_config
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.qa import QATask, answers_of
from tests.helpers import refused
from tests.test_longbench import CHAT_TEMPLATE

ROWS = [
    {"context": "The lighthouse keeper was called Ada Brook.", "question": " Who kept the lighthouse?",
     "answer": "Ada Brook", "answer_prefix": "Answer:"},
    {"context": "The lighthouse keeper was called Ada Brook.", "question": " What did Ada keep?",
     "answer": ["the lighthouse", "a lighthouse"], "max_new_tokens": 8},
    {"context": "Boats leave the harbour at six.", "question": " When do boats leave?", "answer": "six"},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny model's byte tokenizer (BOS prepended) with a small chat template."""
    chat = copy.deepcopy(load_tokenizer(model_config("tiny_llama")))
    chat.chat_template = CHAT_TEMPLATE
    return chat


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def make_task(tokenizer, path: Path | None, window: int = 4096, **overrides) -> QATask:
    cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / "qa.yaml")
    cfg.path = None if path is None else str(path)
    for key, value in overrides.items():
        cfg[key] = value
    return QATask(cfg, ModelInfo("test", tokenizer, window))


def kvpress_preprocess(tokenizer, context, questions, answer_prefix, max_context_length):
    """NVIDIA/kvpress ``kvpress/pipeline.py`` lines 139-171 at 8bb29b9, ``KVPressTextGenerationPipeline.preprocess``
    (copied; its warning and ``enable_thinking`` dropped, ids as lists)."""
    if tokenizer.chat_template is None:
        bos_token = getattr(tokenizer, "bos_token", "")
        context = bos_token + context
        question_suffix = "\n"  # to separate the question from the answer
    else:
        separator = "#" * (len(context) + 10)
        context = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + separator}],
            add_generation_prompt=True,
            tokenize=False,
        )
        context, question_suffix = context.split(separator)
    questions = [question + question_suffix + answer_prefix for question in questions]
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    question_ids = [tokenizer.encode(question, add_special_tokens=False) for question in questions]
    if len(context_ids) > max_context_length:
        context_ids = context_ids[:max_context_length]
    return {"context_ids": context_ids, "questions_ids": question_ids}


def kvpress_prompt(tokenizer, context: str, question: str, answer_prefix: str = "", max_length=10**10) -> list[int]:
    """The ids kvpress's pipeline prefills and then feeds for one question: the context's, then the question's."""
    made = kvpress_preprocess(tokenizer, context, [question], answer_prefix, max_length)
    return made["context_ids"] + made["questions_ids"][0]


@pytest.mark.parametrize(
    ("metric", "prediction", "answers", "expected"),
    [
        ("exact_match", "The Ada Brook.", ["ada brook"], 1.0),
        ("exact_match", "Ada Brook, keeper", ["ada brook"], 0.0),
        ("contains", "It was Ada Brook.", ["ada brook", "nobody"], 1.0),
        ("contains_all", "It was Ada Brook.", ["ada brook", "nobody"], 0.5),
        ("choice", "The correct answer is (C)", ["C"], 1.0),
        ("choice", "**The correct answer is B**", ["C"], 0.0),
        ("choice", "C. Because the text says so", ["C"], 0.0),  # LongBench-v2 reads only its own sentence
        ("letter", "C. Because the text says so", ["C"], 1.0),
        ("letter", "I cannot tell", ["C"], 0.0),
        ("f1", "the cat sat", ["cat sat on mat", "dog"], 2 / 3),  # 2 shared of 2 and 4 tokens
        ("rouge", "cat sat", ["cat sat on mat"], 2 / 3),  # LCS 2: P 1, R 1/2
    ],
)
def test_metrics_hand_computed(metric, prediction, answers, expected):
    assert qa_score(metric, prediction, answers) == pytest.approx(expected, abs=1e-6)


def test_chosen_letter_follows_longbench_v2_first():
    assert chosen_letter("A is tempting. The correct answer is (D).") == "D"
    assert chosen_letter("(B) Paris") is None and chosen_letter("(B) Paris", leading=True) == "B"
    assert chosen_letter("Paris", leading=True) is None


def test_prompts_are_kvpress_prompts_token_for_token(tokenizer, tmp_path):
    task = make_task(tokenizer, write_rows(tmp_path / "rows.jsonl", ROWS))
    samples = list(task.samples())
    for sample, row in zip(samples, ROWS):
        assert sample.input_ids == kvpress_prompt(
            tokenizer, row["context"], row["question"], row.get("answer_prefix", "")
        )
    assert [sample.max_new_tokens for sample in samples] == [32, 8, 32]
    assert [sample.answers for sample in samples] == [["Ada Brook"], ["the lighthouse", "a lighthouse"], ["six"]]
    assert [sample.subtask for sample in samples] == ["rows"] * 3 and samples[0].id == "rows-0"
    assert samples[0].context_id == samples[1].context_id is not None and samples[2].context_id is None


def test_raw_prompts_are_kvpress_without_a_chat_template(tokenizer, tmp_path):
    """``prompt_format=raw``: kvpress's prompt for a tokenizer without a chat template, the BOS text before the
    context and a newline after the question."""
    task = make_task(tokenizer, write_rows(tmp_path / "rows.jsonl", ROWS), prompt_format="raw")
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    for sample, row in zip(task.samples(), ROWS):
        expected = kvpress_prompt(plain, row["context"], row["question"], row.get("answer_prefix", ""))
        assert sample.input_ids == expected
    assert sample.input_ids[0] == tokenizer.bos_token_id and tokenizer.decode(sample.input_ids).endswith("?\n")


def test_agnostic_splits_at_the_question_and_groups_contexts(tokenizer, tmp_path):
    rows = [ROWS[0], ROWS[2], ROWS[1]]
    task = make_task(tokenizer, write_rows(tmp_path / "rows.jsonl", rows), query_mode="agnostic")
    samples = list(task.samples())
    assert [sample.id for sample in samples] == ["rows-0", "rows-2", "rows-1"]  # one context's rows together
    for sample, row in zip(samples, [ROWS[0], ROWS[1], ROWS[2]]):  # kvpress's context ids, then its question ids
        made = kvpress_preprocess(tokenizer, row["context"], [row["question"]], row.get("answer_prefix", ""), 10**9)
        assert sample.input_ids[: sample.question_start] == made["context_ids"]
        assert sample.input_ids[sample.question_start :] == made["questions_ids"][0]
    aware = make_task(tokenizer, tmp_path / "rows.jsonl")
    assert sorted(s.input_ids for s in aware.samples()) == sorted(s.input_ids for s in samples)


@pytest.mark.parametrize("prompt_format", ["hf_chat", "raw"])
def test_long_contexts_keep_their_first_tokens_as_kvpress(tokenizer, tmp_path, prompt_format):
    """A context past ``task.max_length`` (kvpress's ``max_context_length``) keeps its first tokens, the template's
    included; the question follows whole. By default the context leaves the question and the answer room in the
    window."""
    row = {"context": "".join(f"line {n}. " for n in range(400)), "question": " Which line?", "answer": "7"}
    task = make_task(tokenizer, write_rows(tmp_path / "rows.jsonl", [row]), max_length=200, prompt_format=prompt_format)
    (sample,) = task.samples()
    kvpress_tokenizer = tokenizer if prompt_format == "hf_chat" else copy.deepcopy(tokenizer)
    if prompt_format == "raw":
        kvpress_tokenizer.chat_template = None
    assert sample.input_ids == kvpress_prompt(kvpress_tokenizer, row["context"], row["question"], "", 200)
    window = make_task(tokenizer, tmp_path / "rows.jsonl", window=300, prompt_format=prompt_format)
    assert len(next(window.samples()).input_ids) == 300 - 32  # the window less the answer


def test_columns_map_other_names_and_parquet_reads(tokenizer, tmp_path):
    rows = [
        {"document": row["context"], "query": row["question"], "answers": answers_of(row["answer"]), "task": "t"}
        for row in ROWS
    ]
    path = tmp_path / "other.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    columns = {"context": "document", "question": "query", "answer": "answers"}
    task = make_task(tokenizer, path, columns=columns, subtask_column="task", num_samples=2)
    samples = list(task.samples())
    assert len(samples) == 2 and {sample.subtask for sample in samples} == {"t"}
    assert samples[1].answers == ["the lighthouse", "a lighthouse"]
    with pytest.raises(KVBenchError, match="has no column 'context'.*task.columns.context=COLUMN"):
        list(make_task(tokenizer, path).samples())


def test_bad_settings_are_one_line_errors(tokenizer, tmp_path):
    with pytest.raises(KVBenchError, match=r"task.path=FILE .* or task.hub=DATASET_ID"):
        make_task(tokenizer, None)
    with pytest.raises(KVBenchError, match="is not a file"):
        make_task(tokenizer, tmp_path / "missing.jsonl")
    with pytest.raises(KVBenchError, match="task.metric=bleu: must be one of exact_match"):
        make_task(tokenizer, write_rows(tmp_path / "rows.jsonl", ROWS), metric="bleu")
    with pytest.raises(KVBenchError, match="task.prompt=.*{context} before {question}"):
        make_task(tokenizer, tmp_path / "rows.jsonl", prompt="{question}{context}")


def test_a_malformed_line_of_a_jsonl_file_is_named_by_its_line(tokenizer, tmp_path):
    """The 4th line of a rows file malformed (a blank line before it): the error names line 4 of the file, not the
    position inside the line it parsed."""
    path = write_rows(tmp_path / "rows.jsonl", ROWS[:2])
    path.write_text(path.read_text() + "\n" + '{"context": "c", "question": "q", "answer": }\n', encoding="utf-8")
    with pytest.raises(KVBenchError, match=r"rows.jsonl is not valid jsonl \(Expecting value, line 4, column 45\)"):
        list(make_task(tokenizer, path).samples())


@pytest.mark.model
@pytest.mark.parametrize("query_mode", ["aware", "agnostic"])
def test_a_real_run_of_a_file_made_from_the_shipped_text(tmp_path, query_mode):
    """``kvbench run task=qa`` on SmolLM2 over two questions about the bench's paragraph: a run directory with a record
    per row, scored by the named metric; agnostic, the two questions answered from one compression."""
    from kvbench.bench.sections import PARAGRAPH
    from kvbench.cli import main

    rows = [
        {"context": PARAGRAPH, "question": " How many times did the ferry sound its horn?", "answer": "twice"},
        {"context": PARAGRAPH, "question": " When did the baker open his shutters?", "answer": ["six", "6"]},
    ]
    path = write_rows(tmp_path / "harbour.jsonl", rows)
    out = tmp_path / "run"
    run = ["run", "model=smollm2_135m", "task=qa", f"task.path={path}", "policy=snapkv", "budget=64"]
    main([*run, "task.max_new_tokens=12", f"task.query_mode={query_mode}", f"output_dir={out}"])
    metrics = json.loads((out / "metrics.json").read_text())
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [record["id"] for record in records] == ["harbour-0", "harbour-1"] and set(metrics["scores"]) == {"harbour"}
    assert all(record["score"] in (0.0, 1.0) and record["prediction"] for record in records)
    assert metrics["scores"]["harbour"] == 50.0 * sum(record["score"] for record in records)


# --- LongBench-v2 ------------------------------------------------------------------------------------------------

#: LongBench-v2's ``prompts/0shot.txt``, as ``pred.py`` reads it
ZERO_SHOT_TXT = (
    "Please read the following text and answer the question below.\n\n<text>\n$DOC$\n</text>\n\n"
    "What is the correct answer to this question: $Q$\nChoices:\n(A) $C_A$\n(B) $C_B$\n(C) $C_C$\n(D) $C_D$\n\n"
    'Format your response as follows: "The correct answer is (insert answer here)".'
)


def v2_record(index: int, difficulty: str, length: str, context: str = " The tide came in at noon. ") -> dict:
    """A record in LongBench-v2's format (written here, not taken from the dataset)."""
    return {
        "_id": f"q{index}", "domain": "Single-Document QA", "sub_domain": "Story", "difficulty": difficulty,
        "length": length, "question": " When did the tide come in? ", "choice_A": " At noon ",
        "choice_B": "At dawn", "choice_C": "At dusk", "choice_D": "At midnight", "answer": "A", "context": context,
    }  # fmt: skip


def pred_py_prompt(tokenizer, record: dict, max_len: int) -> list[int]:
    """LongBench-v2 ``pred.py``: the template's fields replaced by the stripped record, cut by ``query_llm`` (token ids
    with the special tokens, the first and last halves decoded together), sent as one user turn."""
    prompt = ZERO_SHOT_TXT.replace("$DOC$", record["context"].strip()).replace("$Q$", record["question"].strip())
    for letter in "ABCD":
        prompt = prompt.replace(f"$C_{letter}$", record[f"choice_{letter}"].strip())
    input_ids = tokenizer.encode(prompt)
    if len(input_ids) > max_len:
        input_ids = input_ids[: max_len // 2] + input_ids[-max_len // 2 :]
        prompt = tokenizer.decode(input_ids, skip_special_tokens=True)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


def v2_task(tokenizer, path: Path, window: int = 4096, **overrides):
    from kvbench.tasks.longbench_v2 import LongBenchV2Task

    cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / "longbench_v2.yaml")
    cfg.path = str(path)
    for key, value in overrides.items():
        cfg[key] = value
    return LongBenchV2Task(cfg, ModelInfo("test", tokenizer, window))


@pytest.mark.parametrize("max_length", [1000, 1001])  # an odd length: pred.py keeps the extra token at the tail
def test_longbench_v2_prompts_and_cut_are_pred_py_token_for_token(tokenizer, tmp_path, max_length):
    long_context = "".join(f" Day {n}: the tide came in at noon." for n in range(120))
    quoting = {**v2_record(2, "easy", "short", " A note: $Q$ and $C_A$ and $DOC$. "), "question": " Which $C_B$? "}
    records = [v2_record(0, "easy", "short"), v2_record(1, "hard", "long", long_context), quoting]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    samples = list(v2_task(tokenizer, path, max_length=max_length).samples())
    expected = [pred_py_prompt(tokenizer, record, max_length) for record in records]  # the chain of replaces
    assert [sample.input_ids for sample in samples] == expected
    assert len(tokenizer.encode(ZERO_SHOT_TXT.replace("$DOC$", long_context))) > 1000  # the second one was cut
    assert [sample.id for sample in samples] == ["q0", "q1", "q2"] and samples[0].subtask == "Single-Document QA"
    assert samples[0].max_new_tokens == 128 and samples[0].answers == ["A"]
    agnostic = next(v2_task(tokenizer, path, query_mode="agnostic").samples())
    assert agnostic.input_ids == samples[0].input_ids
    assert tokenizer.decode(agnostic.input_ids[agnostic.question_start :]).startswith("</text>")


def test_longbench_v2_scores_by_result_py_splits(tokenizer, tmp_path):
    records = [v2_record(0, "easy", "short"), v2_record(1, "hard", "short"), v2_record(2, "hard", "long")]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    task = v2_task(tokenizer, path)
    predictions = ["The correct answer is (A)", "The correct answer is B", "**The correct answer is (A)**"]
    rows = [task.evaluate(sample, text) for sample, text in zip(task.samples(), predictions)]
    assert [row["score"] for row in rows] == [1.0, 0.0, 1.0] and rows[0]["difficulty"] == "easy"
    scores = task.aggregate([{**row, "subtask": "x"} for row in rows])
    assert scores == pytest.approx({"overall": 200 / 3, "easy": 100.0, "hard": 50.0, "short": 50.0, "long": 100.0})


def test_longbench_v2_empty_answers_score_0_or_are_left_out_as_pred_py_leaves_them(tokenizer, tmp_path):
    """An empty answer is a wrong one by default; ``task.empty_answers=skipped`` leaves it out of every split, as
    ``pred.py`` writes no record for it (``if output == '': continue``)."""
    records = [v2_record(0, "easy", "short"), v2_record(1, "hard", "short"), v2_record(2, "hard", "long")]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records), encoding="utf-8")
    predictions = ["The correct answer is (A)", "", "The correct answer is (B)"]
    for setting, expected in (
        ("wrong", {"overall": 100 / 3, "easy": 100.0, "hard": 0.0, "short": 50.0, "long": 0.0}),
        ("skipped", {"overall": 50.0, "easy": 100.0, "hard": 0.0, "short": 100.0, "long": 0.0}),
    ):
        task = v2_task(tokenizer, path, empty_answers=setting)
        rows = [{**task.evaluate(sample, text), "subtask": "x"} for sample, text in zip(task.samples(), predictions)]
        assert task.aggregate(rows) == pytest.approx(expected), setting


@pytest.mark.parametrize(
    ("task", "download", "variable"),
    [
        ("longbench_v2", "download data.json of THUDM/LongBench-v2", "KVBENCH_LONGBENCH_V2_PATH"),
        ("infinitebench", "download <subset>.jsonl of xinrongzhang2022/InfiniteBench", "KVBENCH_INFINITEBENCH_DIR"),
        ("loogle", "LooGLE-testdata/<subset>.jsonl of bigai-nlco/LooGLE", "KVBENCH_LOOGLE_DIR"),
        ("scbench", "download data/<subset>.jsonl of microsoft/SCBench", "KVBENCH_SCBENCH_DIR"),
        ("qa", "set task.path=FILE", "KVBENCH_QA_PATH"),
    ],
)
def test_plan_names_what_to_download_without_the_hub(monkeypatch, capsys, task, download, variable):
    """``kvbench plan`` of each named dataset with the hub unreachable: the job is invalid, its one line saying what to
    download and which variable names a local copy."""
    from kvbench import hub
    from kvbench.plan import plan_main as main

    monkeypatch.setattr(hub, "hub_online", lambda: False)
    monkeypatch.setattr("kvbench.tasks.qa.hub_online", lambda: False)
    monkeypatch.delenv(variable, raising=False)
    hub_id = ["task.hub=someone/rows"] if task == "qa" else []
    with pytest.raises(SystemExit) as exited:
        main(["model=tiny_llama", f"task={task}", "task.prompt_format=raw", *hub_id, "policy=snapkv", "budget=64"])
    assert exited.value.code == 2
    (line,) = [json.loads(text) for text in capsys.readouterr().out.splitlines()]
    assert any(download in error and variable in error for error in line["errors"]), line["errors"]


# --- InfiniteBench -------------------------------------------------------------------------------------------------


def infinitebench_rows() -> dict[str, list[dict]]:
    """A record of each subset in the hub's format (written here, not taken from the dataset)."""
    haystack = "The grass is green. The sky is blue. " * 20
    book = "Chapter one. Ada kept the lighthouse on the northern cape for forty years. " * 8
    return {
        "passkey": [{"id": 0, "context": haystack + "The pass key is 71432. Remember it. " + haystack,
                     "input": "What is the pass key?", "answer": ["71432"], "options": []}],
        "number_string": [{"id": 0, "context": haystack, "input": "What is the sequence number?",
                           "answer": ["4432109"], "options": []}],
        "kv_retrieval": [{"id": 0, "context": '{"a1b2": "c3d4", "e5f6": "g7h8"}', "input": "Key: \"e5f6\"\nThe value:",
                          "answer": ["g7h8"], "options": []}],
        "longbook_choice_eng": [{"id": 0, "context": book, "input": "Who kept the lighthouse?",
                                 "answer": ["Ada"], "options": ["Bo", "Ada", "Cy", "Di"]}],
        "longbook_qa_eng": [{"id": 0, "context": book, "input": "How long did Ada keep it?",
                             "answer": ["forty years"], "options": []}],
    }  # fmt: skip


def subsets_task(name: str, tokenizer, folder: Path, rows: dict[str, list[dict]], **overrides):
    """Task ``name`` (a :class:`~kvbench.tasks.qa.SubsetsTask`) from its conf file over ``rows`` written to
    ``folder`` as ``<subset>.jsonl``, the subsets those of ``rows``."""
    from hydra.utils import get_class

    for subset, subset_rows in rows.items():
        write_rows(folder / f"{subset}.jsonl", subset_rows)
    cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / f"{name}.yaml")
    cfg.data_dir, cfg.subtasks = str(folder), list(rows)
    for key, value in overrides.items():
        cfg[key] = value
    return get_class(cfg._target_)(cfg, ModelInfo("test", tokenizer, 4096))


def infinitebench_task(tokenizer, folder: Path, **overrides):
    return subsets_task("infinitebench", tokenizer, folder, infinitebench_rows(), **overrides)


def official_infinitebench_prompt(tokenizer, subset: str, row: dict, templates: str, max_length: int) -> list[int]:
    """``create_prompt`` (the record's ``input`` as its question), ``truncate_input`` on the ids ("middle"), decoded,
    then gpt4's ``create_msgs`` turns in the chat template, or yarn-mistral's raw text with BOS."""
    from kvbench.tasks.infinitebench import TEMPLATES

    options = {f"OPTION_{letter}": option for letter, option in zip("ABCD", row["options"])}
    prompt = TEMPLATES[templates][subset].format(context=row["context"], input=row["input"], **options)
    ids = tokenizer.encode(prompt)
    if len(ids) > max_length:  # eval_utils.py's truncate_input (gpt4); eval_yarn_mistral.py's own (split both ends)
        tail = -max_length // 2 if templates == "gpt4" else -(max_length // 2)
        prompt = tokenizer.decode(ids[: max_length // 2] + ids[tail:], skip_special_tokens=True)
    if templates == "yarn_mistral":
        return tokenizer(prompt)["input_ids"]
    messages = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": prompt}]
    chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(chat, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("max_length", [600, 601])
@pytest.mark.parametrize(("templates", "prompt_format"), [("gpt4", "hf_chat"), ("yarn_mistral", "raw")])
def test_infinitebench_prompts_are_the_official_ones(tokenizer, tmp_path, templates, prompt_format, max_length):
    task = infinitebench_task(
        tokenizer, tmp_path, templates=templates, prompt_format=prompt_format, max_length=max_length
    )
    samples = list(task.samples())
    rows = infinitebench_rows()
    assert [sample.subtask for sample in samples] == list(rows)
    for sample in samples:
        row = rows[sample.subtask][0]
        expected = official_infinitebench_prompt(tokenizer, sample.subtask, row, templates, max_length)
        assert sample.input_ids == expected, sample.subtask
    assert [sample.max_new_tokens for sample in samples] == [6, 12, 50, 40, 40]
    assert samples[3].answers == ["Ada", "B"]  # get_answer: the option and its letter


@pytest.mark.parametrize(
    ("subset", "prediction", "answers", "expected"),
    [
        ("passkey", "The pass key is 71432.", ["71432"], 1.0),
        ("passkey", "7143 2", ["71432"], 0.0),  # the first run of digits only
        ("kv_retrieval", 'The value is "g7h8".', ["g7h8"], 1.0),
        ("kv_retrieval", "g7h8x", ["g7h8"], 0.0),
        ("longbook_choice_eng", "B", ["Ada", "B"], 1.0),
        ("longbook_choice_eng", "The answer is: Ada, of course", ["Ada", "B"], 1.0),
        ("longbook_choice_eng", "I think it is C here", ["Ada", "B"], 0.0),  # the first of A-D among the words
        ("longbook_choice_eng", "I think it is B here", ["Ada", "B"], 1.0),
        ("longbook_qa_eng", "for forty years", ["forty years"], 0.8),  # P 2/3, R 1
    ],
)
def test_infinitebench_scorers_hand_computed(subset, prediction, answers, expected):
    from kvbench.metrics.infinitebench import SCORERS

    assert SCORERS[subset](prediction, answers) == pytest.approx(expected)


# --- LooGLE --------------------------------------------------------------------------------------------------------


def loogle_rows() -> dict[str, list[dict]]:
    """Rows in the repository's ``LooGLE-testdata`` format (written here, not taken from the dataset)."""
    document = "Ada Brook kept the lighthouse on the northern cape. Her brother Tom sailed to Oslo. " * 6
    pairs = [{"Q": "Who kept the lighthouse?", "A": "Ada Brook"}, {"Q": "Where did Tom sail?", "A": "to Oslo"}]
    return {
        "shortdep_qa": [{"input": document, "title": "t", "qa_pairs": str(pairs), "output": "none"}],
        "shortdep_cloze": [{"input": document, "title": "t", "output": "none",
                            "qa_pairs": str([{"Q": "<mask-0> kept the lighthouse; <mask-1> sailed.",
                                              "A": ["Ada Brook", "Tom"]}])}],
        "longdep_summarization": [{"input": document, "title": "t", "qa_pairs": "none", "output": "A keeper's story."}],
    }  # fmt: skip


def loogle_task(tokenizer, folder: Path, **overrides):
    return subsets_task("loogle", tokenizer, folder, loogle_rows(), **overrides)


def test_loogle_prompts_are_pred_opensource_models(tokenizer, tmp_path):
    """``task2prompt.json`` filled with the document and question, cut as LongBench cuts (each half decoded alone),
    tokenized with BOS; a document's questions share its ``context_id``."""
    from kvbench.tasks.loogle import PROMPTS

    task = loogle_task(tokenizer, tmp_path, max_length=300)
    samples = list(task.samples())
    assert [sample.subtask for sample in samples] == [
        "shortdep_qa",
        "shortdep_qa",
        "shortdep_cloze",
        "longdep_summarization",
    ]
    document = loogle_rows()["shortdep_qa"][0]["input"]
    prompt = PROMPTS["shortdep_qa"].format(input=document, Q="Who kept the lighthouse?")
    ids = tokenizer(prompt)["input_ids"]
    assert len(ids) > 300
    cut = tokenizer.decode(ids[:150], skip_special_tokens=True) + tokenizer.decode(ids[-150:], skip_special_tokens=True)
    assert samples[0].input_ids == tokenizer(cut)["input_ids"]
    assert samples[0].context_id == samples[1].context_id is not None and samples[0].max_new_tokens == 300
    assert json.loads(samples[2].answers[0]) == {"<mask-0>": "Ada Brook", "<mask-1>": "Tom"}
    agnostic = list(loogle_task(tokenizer, tmp_path, query_mode="agnostic").samples())
    assert tokenizer.decode(agnostic[0].input_ids[agnostic[0].question_start :]).startswith("Question: Who kept")


def test_loogle_metrics_hand_computed(tokenizer, tmp_path):
    from kvbench.metrics.loogle import cloze_matches, text_metrics

    scores = text_metrics("Ada Brook kept it", "Ada kept the lighthouse")
    assert scores["rouge1"] == pytest.approx(2 / 4) and scores["rougeL"] == pytest.approx(2 / 4)
    assert scores["bleu1"] == pytest.approx(0.5)  # 2 of 4 unigrams match; the lengths are equal (no brevity penalty)
    reference = {"<mask-0>": "Ada Brook", "<mask-1>": "Tom"}
    assert cloze_matches(reference, "{'<mask-0>': 'Ada', '<mask-1>': 'Tom'}") == {"exact": 1, "partial": 2, "count": 2}
    assert cloze_matches(reference, "Ada and Tom") == {"exact": 0, "partial": 0, "count": 2}
    task = loogle_task(tokenizer, tmp_path)
    samples = list(task.samples())
    outputs = ["Ada Brook", "", "{'<mask-0>': 'Ada Brook', '<mask-1>': 'Bo'}", "A keeper's story."]
    records = [{**task.evaluate(sample, output), "subtask": sample.subtask} for sample, output in zip(samples, outputs)]
    assert [record["score"] for record in records] == [1.0, 0.0, 0.5, 1.0]
    assert task.aggregate(records) == pytest.approx(
        {"shortdep_qa": 50.0, "shortdep_cloze": 50.0, "longdep_summarization": 100.0}
    )


# --- SCBench -------------------------------------------------------------------------------------------------------


def scbench_rows() -> dict[str, list[dict]]:
    """A row of each subset in SCBench's format (written here, not taken from the dataset)."""
    pairs = '{"a1b2": "c3d4", "e5f6": "g7h8"}'
    book = "Ada kept the lighthouse on the northern cape for forty years. " * 10
    return {
        "scbench_kv": [{"id": 3, "context": pairs, "multi_turns": [
            {"input": 'Key: "a1b2"\nThe value associated with the specified key is:', "answer": "c3d4"},
            {"input": 'Key: "e5f6"\nThe value associated with the specified key is:', "answer": "g7h8"}]}],
        "scbench_qa_eng": [{"id": 0, "context": book, "multi_turns": [
            {"input": "Who kept the lighthouse?", "answer": "Ada"}]}],
        "scbench_choice_eng": [{"id": 0, "context": book, "multi_turns": [
            {"input": "Who kept it?", "answer": "Ada", "options": ["Bo", "Ada", "Cy", "Di"]}]}],
    }  # fmt: skip


def scbench_task(tokenizer, folder: Path, **overrides):
    return subsets_task("scbench", tokenizer, folder, scbench_rows(), **overrides)


def scdq_ids(tokenizer, context_prompt: str, query_prompt: str, max_length: int) -> tuple[list[int], list[int]]:
    """``create_scdq_prompt`` with the chat template, then ``test_scdq``'s ids: the context prompt's (``encode``, cut by
    ``truncate_input``) and the query's (no special tokens)."""
    delimiter = "[SEPSEPSEP]"
    context = tokenizer.apply_chat_template(
        [{"role": "user", "content": context_prompt + delimiter}], add_generation_prompt=True, tokenize=False
    ).split(delimiter)[0]
    query = tokenizer.apply_chat_template(
        [{"role": "system", "content": ""}, {"role": "user", "content": delimiter + query_prompt}],
        add_generation_prompt=True,
        tokenize=False,
    ).split(delimiter)[1]
    ids = tokenizer.encode(context)
    if len(ids) > max_length:
        ids = ids[: max_length // 2] + ids[-max_length // 2 :]
    return ids, tokenizer.encode(query, add_special_tokens=False)


def test_scbench_prompts_are_create_scdq_prompt_token_for_token(tokenizer, tmp_path):
    rows = scbench_rows()
    samples = list(scbench_task(tokenizer, tmp_path, max_length=300).samples())
    assert [sample.id for sample in samples] == [
        "scbench_kv-3-0", "scbench_kv-3-1", "scbench_qa_eng-0-0", "scbench_choice_eng-0-0"
    ]  # fmt: skip
    kv = rows["scbench_kv"][0]
    prompt = "Extract the value corresponding to the specified key in the JSON object below.\n\n" + kv["context"]
    for sample, turn in zip(samples[:2], kv["multi_turns"]):
        context, query = scdq_ids(tokenizer, prompt, turn["input"], 300)
        assert sample.input_ids == context + query and sample.question_start == len(context)
    assert samples[0].context_id == samples[1].context_id == "scbench_kv-3" and samples[0].answers == ["c3d4"]
    book = rows["scbench_qa_eng"][0]["context"]
    qa_prompt = "Read the book and answer the question. Be very concise in your answer.\n\n" + book
    context, query = scdq_ids(tokenizer, qa_prompt, "Question: Who kept the lighthouse?\nAnswer:", 300)
    assert len(tokenizer.encode(qa_prompt)) > 300 and samples[2].input_ids == context + query  # the context was cut
    assert samples[3].answers == ["Ada", "B"] and [s.max_new_tokens for s in samples] == [150, 150, 40, 40]
    aware = list(scbench_task(tokenizer, tmp_path, query_mode="aware").samples())
    assert aware[0].question_start is None


@pytest.mark.parametrize(
    ("subset", "prediction", "answers", "expected"),
    [
        ("scbench_kv", "The value is c3d4.", ["c3d4"], 1.0),
        ("scbench_kv", "c3d", ["c3d4"], 0.0),
        ("scbench_qa_eng", " it was ADA, surely", ["Ada"], 1.0),
        ("scbench_choice_eng", " Eve", ["Eve", "B"], 1.0),  # the whole (stripped) prediction is a label
        ("scbench_choice_eng", " Ada", ["Ada", "B"], 0.0),  # its first character, an option letter, decides first
        ("scbench_choice_eng", "Option C", ["Ada", "B"], 0.0),
        ("scbench_vt", "X1, X3", ["X1", "X2", "X3"], 0.67),
    ],
)
def test_scbench_scorers_hand_computed(subset, prediction, answers, expected):
    from kvbench.metrics.scbench import SCORERS

    assert SCORERS[subset](prediction, answers) == pytest.approx(expected)


def test_rows_sharing_an_id_are_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    """Two rows of one id would be one line of the run directory (the second never written, or taken for the
    first): refused before the directory is made."""

    rows = [{**ROWS[0], "id": "same"}, {**ROWS[2], "id": "same"}, {**ROWS[1], "id": "other"}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "run"
    run = ["run", "model=tiny_llama", "task=qa", f"task.path={path}", "task.prompt_format=raw", f"output_dir={out}"]
    assert "samples share the id 'same'" in refused(capsys, run, out)


def test_answers_may_be_numbers_and_anything_else_is_one_line(tokenizer, tmp_path):
    """A parquet column of ints (``answer: 42``) is the answer's text; a value that is none of text, a number or a
    list of them is a one-line error."""
    rows = [{"context": "The number is 42.", "question": " What is the number?", "answer": 42}]
    path = tmp_path / "numbers.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    (sample,) = make_task(tokenizer, path, prompt_format="raw").samples()
    assert sample.answers == ["42"] and answers_of(4.5) == ["4.5"] and answers_of(["a", 1]) == ["a", "1"]
    with pytest.raises(KVBenchError, match="a row's answer None is not text, a number or a list of them"):
        answers_of(None)


@pytest.mark.parametrize("prompt_format", ["hf_chat", "raw"])
@pytest.mark.parametrize("name", ["qa", "longbench_v2", "infinitebench", "loogle", "scbench"])
def test_a_default_cut_leaves_room_for_the_template_and_the_answer(name, prompt_format, tokenizer, tmp_path):
    """Contexts far longer than the window, cut by the task's default (``task.max_length: null``): every prompt as the
    model sees it (template included) plus the tokens it may generate fit the window, and fill it to within a few
    tokens (the cut is the window's, not a smaller one)."""
    window, long = 700, " The harbour bell rang twice at dawn and the gulls rose over the pier." * 40
    if name == "qa":
        rows = [{**ROWS[0], "context": long}, {**ROWS[2], "context": long}]
        task = make_task(tokenizer, write_rows(tmp_path / "rows.jsonl", rows), window, prompt_format=prompt_format)
    elif name == "longbench_v2":
        path = write_rows(tmp_path / "data.json", [])
        path.write_text(json.dumps([v2_record(0, "easy", "short", long)]))
        task = v2_task(tokenizer, path, window, prompt_format=prompt_format)
    else:
        rows = {"infinitebench": infinitebench_rows, "loogle": loogle_rows, "scbench": scbench_rows}[name]()
        for subset_rows in rows.values():
            for row in subset_rows:
                row["input" if name == "loogle" else "context"] = long + str(row.get("context", ""))
        task = subsets_task(name, tokenizer, tmp_path, rows, prompt_format=prompt_format)
        task.model = ModelInfo("test", tokenizer, window)
    samples = list(task.samples())
    assert samples
    for sample in samples:
        assert len(sample.input_ids) + sample.max_new_tokens <= window, sample.id
        assert len(sample.input_ids) + sample.max_new_tokens >= window - 40, sample.id


@pytest.mark.parametrize(
    "max_length,message",
    [
        (4090, "task.max_length=4090 and up to 32 generated tokens exceed the context window 4096 of model tiny_llama"),
        (4062, "beyond the context window 4096 of model tiny_llama; lower task.max_length"),  # the template's tokens
    ],
)
def test_a_users_cut_past_the_window_is_refused_in_one_line(max_length, message, tmp_path, capsys):
    """``task.max_length`` set so that prompt and answer cannot fit the model's window (from the settings alone, or
    once the prompt is built with its template): one line, exit 2, nothing written; ``plan`` says so too."""

    rows = [{**ROWS[0], "context": "The harbour bell rang twice at dawn. " * 200}]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    out = tmp_path / "run"
    run = ["run", "model=tiny_llama", "task=qa", f"task.path={path}", "task.prompt_format=raw",
           f"task.max_length={max_length}", f"output_dir={out}"]  # fmt: skip
    assert message in refused(capsys, run, out)


def test_infinitebench_templates_are_prompt_py_at_88b3daa():
    """The passkey templates as ``src/prompt.py`` has them at 88b3daa (copied here): yarn-mistral's after c27d624
    "Fix prompt template error", gpt4's unchanged."""
    from kvbench.tasks.infinitebench import TEMPLATES

    yarn = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you about the important information.\n\n{context}\n\n{input}\n\nThe pass key is"  # noqa: E501
    gpt4 = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you about the important information there.\n\n{context}\n\n{input}"  # noqa: E501
    assert TEMPLATES["yarn_mistral"]["passkey"] == yarn and TEMPLATES["gpt4"]["passkey"] == gpt4


def reference_longbook_choice_eng(pred, label) -> bool:
    """OpenBMB/InfiniteBench ``src/compute_scores.py`` lines 247-285 at 88b3daa, ``get_score_one_longbook_choice_eng``
    (copied; its unused ``model_name`` dropped)."""
    pred = pred.strip()
    if pred == "":
        return False
    if pred[0] in "ABCD":
        return pred[0] in label
    if pred in label:
        return True
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    ans_prefixes = ["answer is:", "answer:", "answer is", "option is"]
    for prefix in ans_prefixes:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        after_prefix = pred[idx + len(prefix) + 1 :]
        for s in label:
            if after_prefix.startswith(s):
                return True
        return False
    words = pred.split()
    for word in words:
        if word in "ABCD":
            return word in label
    return False


@pytest.mark.parametrize(
    "prediction",
    ["B", " B", "\nB. Ada", "Ada", " Ada\n", "Bo", "", "  ", "The answer is: Ada", "the answer is Ada", "answer:",
     "I think it is C here", "I think it is B here", "Ada Lovelace", "option is Ada.", "AB", "b"],
)  # fmt: skip
def test_infinitebench_choice_scorer_is_compute_scores_py(prediction):
    """En.MC against the reference's own lines, on predictions that take each of its branches (a leading newline or
    the option's text were scored 0 before)."""
    from kvbench.metrics.infinitebench import SCORERS

    labels = ["Ada", "B"]
    expected = float(reference_longbook_choice_eng(prediction, labels))
    assert SCORERS["longbook_choice_eng"](prediction, labels) == expected


def test_loogle_scores_an_empty_prediction_as_the_text_none(tokenizer, tmp_path):
    """``automatic_eval.py`` scores an empty prediction as ``'None'`` (lines 23-24 at 6734382): an answer that says
    None scores as it would against that text; the record keeps the empty prediction."""
    from kvbench.metrics.loogle import text_metrics

    task = loogle_task(tokenizer, tmp_path)
    sample = next(sample for sample in task.samples() if sample.subtask == "shortdep_qa")
    sample.answers = ["None of them"]
    record = task.evaluate(sample, "")
    assert record["prediction"] == "" and record["score"] == text_metrics("None of them", "None")["rougeL"] > 0


@pytest.mark.model
@pytest.mark.parametrize("prompt_format", ["hf_chat", "raw"])
def test_kvpress_rows_on_a_real_tokenizer_join_separately_tokenized_ids(prompt_format, tmp_path):
    """SmolLM2's BPE tokenizer, where tokenizing the context and the question apart differs from tokenizing the prompt
    at once (a word split at the join: " pass" + "word" vs " password"): the ids are kvpress's."""
    from kvbench.models import load_tokenizer

    real = load_tokenizer(model_config("smollm2_135m"))
    rows = [
        {"context": "The vault's secret is the pass", "question": "word written below.", "answer": "x"},
        {
            "context": "Boats leave the harbour at six. " * 3,
            "question": " When?",
            "answer": "six",
            "answer_prefix": "A:",
        },
    ]
    cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / "qa.yaml")
    cfg.path, cfg.prompt_format = str(write_rows(tmp_path / "rows.jsonl", rows)), prompt_format
    task = QATask(cfg, ModelInfo("smollm2_135m", real, 8192))
    kvpress_tokenizer = real if prompt_format == "hf_chat" else copy.deepcopy(real)
    if prompt_format == "raw":
        kvpress_tokenizer.chat_template = None
    for sample, row in zip(task.samples(), rows):
        assert sample.input_ids == kvpress_prompt(kvpress_tokenizer, row["context"], row["question"],
                                                  row.get("answer_prefix", ""))  # fmt: skip
    joint = real("The vault's secret is the password written below.", add_special_tokens=False)["input_ids"]
    apart = real.encode("The vault's secret is the pass", add_special_tokens=False)
    assert joint[: len(apart)] != apart  # the join splits a word: the two definitions differ here
