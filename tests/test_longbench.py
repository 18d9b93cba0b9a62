"""LongBench: the official metrics (checked against direct library calls and hand-computed values),
prompt building, truncation, chat templates, data loading and aggregation."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import jieba
import pytest
import torch
from hydra.utils import get_class
from omegaconf import OmegaConf
from rouge import Rouge

import kvbench
from kvbench import hub
from kvbench.errors import KVBenchError
from kvbench.metrics import longbench as metrics
from kvbench.metrics.longbench import DATASET_METRIC, length_bucket, normalize_answer, normalize_zh_answer, score_sample
from kvbench.models import load_model, load_tokenizer, model_config
from kvbench.run import run_sample
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.longbench import DATASETS, E_DATASETS, MAX_NEW_TOKENS, LongBenchTask
from kvbench.tasks.longbench_prompts import PROMPTS
from tests.helpers import engine, local_data, random_prompt, tiny_model

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Using slow pure-python SequenceMatcher": the backend the official scorer ran
    from fuzzywuzzy import fuzz

FIXTURES = Path(__file__).parent / "fixtures" / "longbench"
REAL_DATA = local_data("KVBENCH_LONGBENCH_DIR", "data", "longbench")
TREC_CLASSES = ["Abbreviation", "City", "Date", "Other location", "Other number", "Reason"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|user|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def official_rouge(prediction: str, ground_truth: str) -> float:
    """The official call, made directly on the ``rouge`` package."""
    try:
        return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except Exception:
        return 0.0


def jieba_words(text: str) -> str:
    return " ".join(jieba.cut(text, cut_all=False))


# --- metrics -----------------------------------------------------------------------------------------


def test_every_dataset_has_a_metric_a_prompt_and_a_length():
    assert set(DATASET_METRIC) == set(PROMPTS) == set(MAX_NEW_TOKENS) == set(DATASETS)
    assert len(DATASETS) == 21
    assert set(E_DATASETS) <= set(DATASETS) and len(E_DATASETS) == 13


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Cat, the Hat!", "cat hat"),
        ("  An  apple\ta day ", "apple day"),
        ("theater is another place", "theater is another place"),  # articles only as whole words
        ("", ""),
        ("Über—“quotes”", "über—“quotes”"),  # only ASCII punctuation is removed
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_normalize_zh_answer_keeps_what_the_official_set_lacks():
    # "《" and the full-width full stop are not in the official punctuation set; "》" is.
    assert normalize_zh_answer("《三体》，第一部．Ｈｉ ！") == "《三体第一部．ｈｉ"
    assert normalize_zh_answer("“厦门 大学。”") == "厦门大学"


QA_CASES = [
    # prediction, answers, expected (hand-computed token F1 after normalisation)
    ("The cat sat on the mat.", ["a cat on a mat"], 2 * 0.75 * 1.0 / 1.75),  # "cat sat on mat" vs "cat on mat"
    ("Tarvik", ["Tarvik"], 1.0),
    ("", ["Tarvik"], 0.0),
    ("Oslo", ["Tarvik"], 0.0),
    ("It opened in 1911", ["1911", "in 1911"], 2 * 0.5 * 1.0 / 1.5),  # best of 1/2 and 2/3
    ("yes yes", ["yes"], 2 * 0.5 * 1.0 / 1.5),  # repeated tokens count once each
    ("the", ["a"], 0.0),  # both normalise to nothing
]


@pytest.mark.parametrize(
    "dataset", ["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"]
)
@pytest.mark.parametrize("prediction, answers, expected", QA_CASES)
def test_qa_f1(dataset, prediction, answers, expected):
    assert score_sample(dataset, prediction, answers) == pytest.approx(expected)


@pytest.mark.parametrize(
    "prediction, answers, expected",
    [
        ("厦门大学。", ["厦门大学。"], 1.0),
        ("厦门大学", ["厦门大学。"], 1.0),  # the full stop is punctuation
        ("北京大学和清华大学", ["清华大学"], 0.5),  # 北京大学 / 和 / 清华大学: P = 1/3, R = 1
        ("我在厦门大学读书", ["厦门大学"], 0.4),  # 我 / 在 / 厦门大学 / 读书: P = 1/4, R = 1
        ("", ["厦门大学"], 0.0),
        ("。！", ["厦门大学"], 0.0),
        ("上海", ["北京", "上海"], 1.0),
    ],
)
def test_qa_f1_zh(prediction, answers, expected):
    assert jieba.lcut("北京大学和清华大学") == ["北京大学", "和", "清华大学"]
    assert score_sample("multifieldqa_zh", prediction, answers) == pytest.approx(expected)


ROUGE_CASES = [
    ("the cat sat", ["the cat sat on the mat"]),
    (
        "The report finds costs rose. Funding fell in 2020.",
        ["Costs rose sharply. The report says funding fell in 2020."],
    ),
    ("", ["anything at all"]),  # empty hypothesis: rouge raises, the official scorer gives 0
    ("...", ["a b c"]),  # no sentence left after splitting at "."
    ("a b c", ["a b c", "x y z"]),  # the best reference counts
    ("word " * 40, ["word word word"]),
]


@pytest.mark.parametrize("dataset", ["gov_report", "qmsum", "multi_news"])
@pytest.mark.parametrize("prediction, answers", ROUGE_CASES)
def test_rouge_l_matches_direct_rouge_calls(dataset, prediction, answers):
    expected = max(official_rouge(prediction, answer) for answer in answers)
    assert score_sample(dataset, prediction, answers) == expected


def test_rouge_l_hand_checked():
    assert score_sample("gov_report", "a b c", ["a b c"]) == pytest.approx(1.0, abs=1e-7)
    assert score_sample("gov_report", "", ["a b c"]) == 0.0
    assert score_sample("gov_report", "d e f", ["a b c"]) == 0.0


@pytest.mark.parametrize("dataset", ["dureader", "vcsum"])
@pytest.mark.parametrize(
    "prediction, answers",
    [
        ("会议讨论了预算。", ["会议讨论了明年的预算。"]),
        ("", ["会议讨论了预算。"]),
        ("今天天气很好", ["今天天气很好", "明天下雨"]),
        ("The meeting discussed the budget.", ["会议讨论了预算。"]),
    ],
)
def test_rouge_l_zh_matches_direct_rouge_calls(dataset, prediction, answers):
    expected = max(official_rouge(jieba_words(prediction), jieba_words(answer)) for answer in answers)
    assert score_sample(dataset, prediction, answers) == expected


def test_rouge_l_zh_hand_checked():
    # 会议 讨论 了 预算 。 vs 会议 讨论 了 明年 的 预算 。: LCS 5, P = 1, R = 5/7, F = 2PR/(P+R) = 5/6.
    assert score_sample("vcsum", "会议讨论了预算。", ["会议讨论了明年的预算。"]) == pytest.approx(5 / 6, abs=1e-7)


OFFICIAL_STACK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jieba
    from rouge import Rouge

    def rouge_score(prediction, ground_truth):
        try:
            return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
        except:
            return 0.0

    def rouge_zh_score(prediction, ground_truth):
        return rouge_score(" ".join(jieba.cut(prediction)), " ".join(jieba.cut(ground_truth)))

    def scorer(metric, pairs):  # a plain loop, as eval.py (a comprehension would add a frame before 3.12)
        scores = []
        for prediction, ground_truth in pairs:
            scores.append(metric(prediction, ground_truth))
        return scores

    pairs = json.loads(sys.stdin.read())
    print(json.dumps({"en": scorer(rouge_score, pairs), "zh": scorer(rouge_zh_score, pairs)}))
    """
)


def _deep(depth: int, function, *args):
    return function(*args) if depth == 0 else _deep(depth - 1, function, *args)


def test_rouge_recursion_limit_matches_the_official_scorer_at_any_call_depth():
    """Long sentences overflow the ``rouge`` package's recursion; the score is then 0, exactly where
    a script with the official call structure (module -> scorer -> metric) gets 0."""
    # One reference word against an n-word prediction: the LCS walk recurses about n deep.
    pairs = [[" ".join(f"w{i}" for i in range(n)), "w0"] for n in range(984, 996)]
    run = subprocess.run(
        [sys.executable, "-c", OFFICIAL_STACK_SCRIPT],
        input=json.dumps(pairs),
        capture_output=True,
        text=True,
        check=True,
    )
    official = json.loads(run.stdout)
    limit = sys.getrecursionlimit()
    for scores in official.values():  # the threshold lies inside the range
        assert scores[0] > 0 and scores[-1] == 0
    for depth in (0, 300):
        assert [_deep(depth, metrics.rouge_l, p, g) for p, g in pairs] == official["en"]
        assert [_deep(depth, metrics.rouge_l_zh, p, g) for p, g in pairs] == official["zh"]
    assert sys.getrecursionlimit() == limit  # restored after each call


CLASSIFICATION_CASES = [
    ("City", "City", 1.0),
    ("Type: City", "City", 1.0),
    ("City or Date", "City", 0.5),  # two classes named, one right
    ("Date", "City", 0.0),
    ("Citty", "City", 0.0),  # no class named: 0 (the official difflib fallback is unreachable)
    ("", "City", 0.0),
    ("Other location", "Other location", 1.0),
    ("Other number", "Other location", 0.0),
]


@pytest.mark.parametrize("prediction, truth, expected", CLASSIFICATION_CASES)
def test_classification(prediction, truth, expected):
    assert score_sample("trec", prediction, [truth], TREC_CLASSES) == expected


def test_classification_reproduces_the_official_list_walk():
    # "Other" and "number" are both substrings of the truth; the official loop removes "Other" and
    # then skips "number" (the list shifted under it), so two matches remain: 1/2, not 1.
    assert score_sample("trec", "Other number", ["Other number"], ["Other", "number", "Other number"]) == 0.5
    assert score_sample("trec", "Other number", ["Other number"], ["Other", "Other number"]) == 1.0


def test_classification_chinese():
    classes = ["体育", "财经", "娱乐", "国际体育"]
    assert score_sample("lsht", "类别：财经", ["财经"], classes) == 1.0
    assert score_sample("lsht", "国际体育", ["国际体育"], classes) == 1.0  # "体育" is a substring of the truth
    assert score_sample("lsht", "体育", ["国际体育"], classes) == 0.0


@pytest.mark.parametrize(
    "dataset, prediction, answers, all_classes, expected",
    [
        ("trec", "\n\nCity\nDate", ["City"], TREC_CLASSES, 1.0),  # leading newlines, then the first line
        ("trec", "Date\nCity", ["City"], TREC_CLASSES, 0.0),
        ("triviaqa", "\nParis\nThe answer is London", ["London"], None, 0.0),
        ("triviaqa", "Paris\nLondon", ["Paris"], None, 1.0),
        ("lsht", "财经\n体育", ["财经"], ["体育", "财经"], 1.0),
        ("hotpotqa", "Paris\nLondon", ["London"], None, 2 * 0.5 * 1.0 / 1.5),  # no first-line rule
        ("triviaqa", "\n\n", ["Paris"], None, 0.0),
    ],
)
def test_first_line_rule(dataset, prediction, answers, all_classes, expected):
    assert score_sample(dataset, prediction, answers, all_classes) == pytest.approx(expected)


def test_first_line_rule_samsum():
    prediction = "\nAnn and Bob will have lunch.\nDialogue: Cy: hi"
    answer = "Ann and Bob will have lunch at noon."
    assert score_sample("samsum", prediction, [answer]) == official_rouge("Ann and Bob will have lunch.", answer)
    assert score_sample("samsum", prediction, [answer]) != official_rouge(prediction, answer)


@pytest.mark.parametrize(
    "prediction, answer, expected",
    [
        ("Paragraph 3", "Paragraph 3", 1.0),
        ("Paragraph 3 and Paragraph 30", "Paragraph 3", 0.5),
        ("The answer is Paragraph 12, not 1 or 12", "Paragraph 12", 2 / 3),
        ("None of them", "Paragraph 12", 0.0),
        ("", "Paragraph 7", 0.0),
        ("Paragraph 007", "Paragraph 7", 0.0),  # numbers compare as strings
    ],
)
def test_retrieval_en(prediction, answer, expected):
    assert score_sample("passage_retrieval_en", prediction, [answer]) == pytest.approx(expected)


@pytest.mark.parametrize(
    "prediction, answer, expected",
    [
        ("段落5", "段落5", 1.0),
        ("答案是段落5或段落15", "段落5", 0.5),
        ("第三段", "段落3", 0.0),
    ],
)
def test_retrieval_zh(prediction, answer, expected):
    assert score_sample("passage_retrieval_zh", prediction, [answer]) == pytest.approx(expected)


@pytest.mark.parametrize(
    "prediction, answer, expected",
    [
        ("12", "12", 1.0),
        ("There are 12 unique paragraphs.", 12, 1.0),
        ("12 or 13", "12", 0.5),
        ("1, 2, 3", "3", 1 / 3),
        ("", "4", 0.0),
        ("twelve", "12", 0.0),
    ],
)
def test_count(prediction, answer, expected):
    assert score_sample("passage_count", prediction, [answer]) == pytest.approx(expected)


CODE_CASES = [
    # prediction, the line the official scorer compares
    ("    return x + 1\n", "    return x + 1"),
    ("\n\nreturn x + 1", "return x + 1"),
    ("# add one\nreturn x + 1", "return x + 1"),
    ("s = '#'\ny = 2", "y = 2"),  # "#" anywhere on the line disqualifies it
    ("```python\nfoo()\n```", "foo()"),
    ("// comment\nint a = 0;", "int a = 0;"),
    ("url = 'http://x'\nz = 3", "z = 3"),
    ("# only\n// comments", ""),
    ("", ""),
]


@pytest.mark.parametrize("dataset", ["lcc", "repobench-p"])
@pytest.mark.parametrize("prediction, line", CODE_CASES)
@pytest.mark.parametrize("answer", ["return x + 1", "y = 2", "foo()", ""])
def test_code_sim_matches_fuzzywuzzy(dataset, prediction, line, answer):
    assert score_sample(dataset, prediction, [answer]) == fuzz.ratio(line, answer) / 100


def test_code_sim_hand_checked():
    assert score_sample("lcc", "return x + 1", ["return x + 1"]) == 1.0
    assert score_sample("lcc", "# nothing", ["x = 1"]) == 0.0
    assert score_sample("lcc", "", [""]) == 1.0  # equal strings are 100 even when empty (fuzzywuzzy)
    assert score_sample("lcc", "abcd", ["abce"]) == 0.75  # difflib: 2 * 3 matches / 8 characters


def test_fuzz_ratio_is_fuzzywuzzy_on_difflib():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fuzzywuzzy import fuzz as fuzz_module
    assert fuzz_module.SequenceMatcher is difflib.SequenceMatcher, "python-Levenshtein must not be installed"
    words = [
        "",
        "a",
        "ab",
        "abc",
        "x = 1",
        "x=1",
        "for i in range(10):",
        "for j in range(100):",
        "返回值",
        "return None",
    ]
    for a in words:
        for b in words:
            assert metrics._fuzz_ratio(a, b) == fuzz.ratio(a, b), (a, b)


def test_score_sample_edge_cases():
    assert score_sample("hotpotqa", "anything", []) == 0.0
    with pytest.raises(KVBenchError, match="unknown LongBench dataset 'nq'"):
        score_sample("nq", "x", ["x"])


@pytest.mark.parametrize(
    "length, bucket", [(0, "0-4k"), (3999, "0-4k"), (4000, "4-8k"), (7999, "4-8k"), (8000, "8k+"), (31000, "8k+")]
)
def test_length_bucket(length, bucket):
    assert length_bucket(length) == bucket


# --- task --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """The byte-level tokenizer of the tiny test model: one token per byte, BOS prepended like Llama."""
    return load_tokenizer(model_config("tiny_llama"))


@pytest.fixture(scope="module")
def chat_tokenizer(tokenizer):
    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    return chat


def make_task(tokenizer, window=4096, hf_id=None, config="longbench", **overrides):
    cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / f"{config}.yaml")
    cfg.data_dir = str(FIXTURES)
    for key, value in overrides.items():
        cfg[key] = value
    return LongBenchTask(cfg, ModelInfo("test", tokenizer, window, hf_id))


def fixture_records(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines()]


def test_config_files_instantiate_the_task(tokenizer):
    for config, datasets in (("longbench", 16), ("longbench_e", 13)):
        cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / f"{config}.yaml")
        assert {
            "name",
            "_target_",
            "datasets",
            "data_dir",
            "num_samples",
            "prompt_format",
            "max_length",
            "min_length_datasets",
            "seed",
            "subtasks",
            "e",
        } <= set(cfg)
        task = get_class(cfg._target_)(cfg, ModelInfo("test", tokenizer, 4096))
        assert len(task.datasets) == datasets and task.prompt_format == "longbench_official"
        assert task.max_length("qasper") == 4096 - 128 and task.min_length_datasets == {"samsum"}
    assert make_task(tokenizer, config="longbench_e").datasets == list(E_DATASETS)


def test_prompt_uses_the_official_template(tokenizer):
    task = make_task(tokenizer, datasets=["hotpotqa"])
    sample = next(task.samples())
    record = fixture_records("hotpotqa.jsonl")[0]
    expected = (
        "Answer the question based on the given passages. Only give me the answer and do not output any other words."
        "\n\nThe following are given passages.\n" + record["context"] + "\n\n"
        "Answer the question based on the given passages. Only give me the answer and do not output any other words."
        "\n\nQuestion: Which city hosts the Blue Owl Library?\nAnswer:"
    )
    assert sample.input_ids == tokenizer(expected).input_ids
    assert sample.input_ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(sample.input_ids, skip_special_tokens=True) == expected
    assert sample.id == "fixture-hotpotqa-0" and sample.subtask == "hotpotqa"
    assert sample.answers == ["Tarvik"] and sample.max_new_tokens == 32 and sample.mode == "generate"
    assert sample.min_new_tokens == 0 and sample.metadata == {"all_classes": None, "length": 31}


def official_cut(tokenizer, prompt, max_length):
    """pred.py's truncation: measure with special tokens, decode each half on its own, join, tokenize again."""
    ids = tokenizer(prompt, truncation=False).input_ids
    if len(ids) <= max_length:
        return ids
    half = int(max_length / 2)
    kept = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )
    return tokenizer(kept, truncation=False).input_ids


def test_truncation_keeps_the_first_and_last_halves(tokenizer):
    record = fixture_records("hotpotqa.jsonl")[0]
    full = tokenizer(PROMPTS["hotpotqa"].format(**record)).input_ids
    assert len(full) > 100
    for max_length in (64, 65):
        task = make_task(tokenizer, datasets=["hotpotqa"], max_length=max_length)
        ids = task.prompt_ids("hotpotqa", record)
        half = max_length // 2
        assert ids == full[:half] + full[-half:]  # ASCII bytes: decoding and re-tokenizing changes nothing
        assert len(ids) == 2 * half and ids[0] == tokenizer.bos_token_id
    short = make_task(tokenizer, datasets=["hotpotqa"], max_length=len(full))
    assert short.prompt_ids("hotpotqa", record) == full  # at the limit: untouched


def test_truncation_decodes_each_half_and_tokenizes_again(tokenizer, tmp_path):
    """pred.py re-tokenizes the decoded halves: a cut through a character is not the join of the id halves."""
    record = {
        "input": "问题？",
        "context": "长文本" * 40,
        "answers": ["长"],
        "length": 1,
        "all_classes": None,
        "_id": "zh-0",
    }
    (tmp_path / "multifieldqa_zh.jsonl").write_text(json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    prompt = PROMPTS["multifieldqa_zh"].format(**record)
    full = tokenizer(prompt).input_ids
    task = make_task(tokenizer, datasets=["multifieldqa_zh"], data_dir=str(tmp_path), max_length=101)
    [sample] = task.samples()
    assert sample.input_ids == official_cut(tokenizer, prompt, 101)
    assert sample.input_ids != full[:50] + full[-50:]  # the halves end inside three-byte characters
    assert "\ufffd" in tokenizer.decode(sample.input_ids)


@pytest.mark.parametrize(
    "hf_id, window, expected",
    [
        ("meta-llama/Llama-2-7b-chat-hf", 4096, 3500),  # official model2maxlen
        ("meta-llama/Meta-Llama-3-8B-Instruct", 8192, 7950),  # KVCache-Factory
        ("mistralai/Mistral-7B-Instruct-v0.2", 32768, 31500),  # KVCache-Factory
        ("meta-llama/Llama-3.1-8B-Instruct", 131072, 127500),  # CAKE
        ("Qwen/Qwen2.5-3B-Instruct", 32768, 32768 - 32),  # in no table: the window less hotpotqa's 32 new tokens
        (None, 50, 50 - 32),
    ],
)
def test_max_length_comes_from_the_model_table_or_its_window(tokenizer, hf_id, window, expected):
    task = make_task(tokenizer, window=window, hf_id=hf_id, datasets=["hotpotqa"], prompt_format="raw")
    assert task.max_length("hotpotqa") == expected
    assert make_task(tokenizer, window=window, hf_id=hf_id, max_length=77).max_length("hotpotqa") == 77


def test_max_length_null_cuts_to_the_window_less_the_generation(tokenizer):
    record = fixture_records("hotpotqa.jsonl")[0]
    full = tokenizer(PROMPTS["hotpotqa"].format(**record)).input_ids
    task = make_task(tokenizer, window=82, datasets=["hotpotqa"])
    assert task.prompt_ids("hotpotqa", record) == full[:25] + full[-25:]  # 82 - 32 new tokens = 50


def test_chat_template_applied_except_on_the_official_exceptions(chat_tokenizer):
    task = make_task(chat_tokenizer, prompt_format="hf_chat", datasets=["hotpotqa", "trec", "samsum"])
    by_dataset = {}
    for sample in task.samples():
        by_dataset.setdefault(sample.subtask, sample)
    hotpot = fixture_records("hotpotqa.jsonl")[0]
    prompt = PROMPTS["hotpotqa"].format(**hotpot)
    templated = f"<bos><|user|>\n{prompt}\n<|assistant|>\n"
    assert by_dataset["hotpotqa"].input_ids == chat_tokenizer(templated, add_special_tokens=False).input_ids
    assert by_dataset["hotpotqa"].input_ids.count(chat_tokenizer.bos_token_id) == 1  # the template's BOS only
    for dataset, name in (("trec", "trec.jsonl"), ("samsum", "samsum.jsonl")):
        plain = chat_tokenizer(PROMPTS[dataset].format(**fixture_records(name)[0])).input_ids
        assert by_dataset[dataset].input_ids == plain
    assert task.template("hotpotqa") == "hf_chat"
    assert {task.template(d) for d in ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")} == {"raw"}


def test_raw_format_never_templates(chat_tokenizer):
    task = make_task(chat_tokenizer, prompt_format="raw", datasets=["hotpotqa"])
    record = fixture_records("hotpotqa.jsonl")[0]
    assert task.prompt_ids("hotpotqa", record) == chat_tokenizer(PROMPTS["hotpotqa"].format(**record)).input_ids


def test_chat_template_wraps_the_truncated_prompt(chat_tokenizer):
    record = fixture_records("hotpotqa.jsonl")[0]
    full = chat_tokenizer(PROMPTS["hotpotqa"].format(**record)).input_ids
    task = make_task(chat_tokenizer, prompt_format="hf_chat", datasets=["hotpotqa"], max_length=64)
    ids = task.prompt_ids("hotpotqa", record)
    kept = chat_tokenizer.decode(full[:32], skip_special_tokens=True) + chat_tokenizer.decode(
        full[-32:], skip_special_tokens=True
    )
    assert chat_tokenizer.decode(ids) == f"<bos><|user|>\n{kept}\n<|assistant|>\n"
    assert kept.startswith("Answer the question") and kept.endswith("Answer:")


LLAMA2 = "meta-llama/Llama-2-7b-chat-hf"
LLAMA3 = "meta-llama/Meta-Llama-3-8B-Instruct"
LLAMA31 = "meta-llama/Llama-3.1-8B-Instruct"
MISTRAL = "mistralai/Mistral-7B-Instruct-v0.3"
LLAMA3_TURN = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)


@pytest.mark.parametrize(
    "prompt_format, hf_id, hotpotqa, trec",
    [
        # LongBench pred.py build_chat: Llama-2 only, not on the few-shot / code datasets
        ("longbench_official", LLAMA2, "[INST]{}[/INST]", "{}"),
        ("longbench_official", LLAMA3, "{}", "{}"),
        ("longbench_official", MISTRAL, "{}", "{}"),
        # KVCache-Factory run_longbench.py: [INST] only for "llama2" in the path (on every dataset)
        ("kvcache_factory", LLAMA2, "{}", "{}"),
        ("kvcache_factory", "/models/llama2-7b-chat", "[INST] {} [/INST]", "[INST] {} [/INST]"),
        ("kvcache_factory", LLAMA3, "{}", "{}"),
        # CAKE pred_cake.py build_chat: its own strings, written before the tokenizer's BOS is added
        ("cake", LLAMA31, LLAMA3_TURN, "{}"),
        ("cake", LLAMA2, "[INST]{}[/INST]", "{}"),
        ("cake", MISTRAL, "<s>[INST] {} [/INST]", "{}"),
    ],
)
def test_pipeline_formats_wrap_as_their_code(tokenizer, prompt_format, hf_id, hotpotqa, trec):
    task = make_task(tokenizer, hf_id=hf_id, prompt_format=prompt_format, datasets=["hotpotqa", "trec"])
    samples = {sample.id: sample for sample in task.samples()}
    samples = {dataset: samples[f"fixture-{dataset}-0"] for dataset in ("hotpotqa", "trec")}
    for dataset, wrapper in (("hotpotqa", hotpotqa), ("trec", trec)):
        prompt = PROMPTS[dataset].format(**fixture_records(f"{dataset}.jsonl")[0])
        assert tokenizer.decode(samples[dataset].input_ids) == "<bos>" + wrapper.format(prompt)


def test_unknown_prompt_format_and_chat_without_template_are_one_line_errors(tokenizer):
    with pytest.raises(
        KVBenchError,
        match=r"^task.prompt_format=chat: must be one of longbench_official, kvcache_factory, cake, hf_chat, raw$",
    ):
        make_task(tokenizer, prompt_format="chat")
    with pytest.raises(
        KVBenchError, match="task.prompt_format=hf_chat needs a chat template but the tokenizer of model test has none"
    ):
        make_task(tokenizer, prompt_format="hf_chat")


def test_samsum_stops_at_newline(tokenizer):
    task = make_task(tokenizer, datasets=["samsum", "trec"])
    samples = {sample.subtask: sample for sample in task.samples()}
    assert samples["samsum"].stop_strings == ["\n"]
    assert samples["samsum"].max_new_tokens == 128
    assert samples["trec"].stop_strings == []
    assert samples["trec"].metadata["all_classes"] == TREC_CLASSES and samples["trec"].max_new_tokens == 64


def test_min_length_datasets_set_one_new_token(tokenizer):
    def samples(**options):
        return {
            s.subtask: s.min_new_tokens for s in make_task(tokenizer, datasets=["samsum", "trec"], **options).samples()
        }

    assert samples() == {"samsum": 1, "trec": 0}  # pred.py: min_length = context + 1 on samsum only
    assert samples(min_length_datasets="all") == {"samsum": 1, "trec": 1}  # KVCache-Factory: every dataset
    assert samples(min_length_datasets=[]) == {"samsum": 0, "trec": 0}
    with pytest.raises(KVBenchError, match=r"^task.min_length_datasets=\['sam'\]: must be one of all or a list"):
        make_task(tokenizer, min_length_datasets=["sam"])


def test_engine_min_new_tokens_is_hf_min_new_tokens():
    """A stop token cannot come first: the same tokens as transformers' generate(min_new_tokens=1)."""
    model = tiny_model("llama")
    prompt = random_prompt(40)
    first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
    reference = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=8,
        do_sample=False,
        min_new_tokens=1,
        eos_token_id=[first],
        pad_token_id=first,
    )[0, len(prompt) :].tolist()
    runner = engine(model, "full", 64)
    assert runner.generate(prompt, 8, [first]).token_ids == []
    output = runner.generate(prompt, 8, [first], min_new_tokens=1).token_ids
    assert output and first not in output
    assert output == (reference[: reference.index(first)] if first in reference else reference)


def test_samsum_prediction_is_not_empty_when_the_first_greedy_token_is_a_newline():
    """pred.py's min_length on samsum: the newline stop cannot end the answer before it starts."""
    loaded = load_model(model_config("tiny_llama"))
    model = copy.deepcopy(loaded.model)
    newline = loaded.tokenizer.encode("\n", add_special_tokens=False)[-1]
    task = make_task(loaded.tokenizer, datasets=["samsum"])
    [sample] = task.samples()
    runner = engine(model, "full", 4096)
    first = runner.generate(sample.input_ids, 1).token_ids[0]
    assert first < 256 and first != newline  # a byte: it decodes to a non-empty string
    head = model.lm_head.weight.detach().clone()
    assert float(model(torch.tensor([sample.input_ids])).logits[0, -1, first]) > 0
    head[newline] = 2 * head[first]  # the newline now outscores the model's own first token
    model.lm_head.weight = torch.nn.Parameter(head)
    assert runner.generate(sample.input_ids, 1).token_ids == [newline]
    newline_first = dataclasses.replace(loaded, model=model)
    record, _ = run_sample(runner, task, sample, newline_first)
    assert record["prediction"] != "" and record["prediction"][0] == loaded.tokenizer.decode([first])
    no_rule = make_task(loaded.tokenizer, datasets=["samsum"], min_length_datasets=[])
    [unruled] = no_rule.samples()
    assert run_sample(runner, no_rule, unruled, newline_first)[0]["prediction"] == ""


def test_score_and_evaluate(tokenizer):
    task = make_task(tokenizer, datasets=["trec", "hotpotqa"])
    samples = list(task.samples())
    trec = samples[0]
    assert task.score(trec, "\nOther location\nCity") == 1.0
    assert task.evaluate(trec, "City") == {"prediction": "City", "score": 0.0, "length": 24}
    hotpot = [s for s in samples if s.id == "fixture-hotpotqa-1"][0]
    assert task.score(hotpot, "in 1911") == 1.0


def test_num_samples_draws_a_seeded_subset_in_file_order(tokenizer):
    ids = [
        [s.id for s in make_task(tokenizer, datasets=["hotpotqa"], num_samples=2, seed=seed).samples()]
        for seed in (1, 1, 7)
    ]
    assert ids[0] == ids[1] and len(ids[0]) == 2
    order = [r["_id"] for r in fixture_records("hotpotqa.jsonl")]
    for chosen in ids:
        assert chosen == sorted(chosen, key=order.index)
    assert len(list(make_task(tokenizer, datasets=["hotpotqa"], num_samples=10).samples())) == 3


def test_subtasks_alias_and_validation(tokenizer):
    assert make_task(tokenizer, subtasks=["trec"]).datasets == ["trec"]
    assert make_task(tokenizer, subtasks="trec").datasets == ["trec"]
    with pytest.raises(KVBenchError, match=r"^task.datasets=\['hotpot'\]: must be one of narrativeqa, "):
        make_task(tokenizer, datasets=["hotpot"])
    with pytest.raises(KVBenchError, match="unknown LongBench-E dataset 'narrativeqa'"):
        make_task(tokenizer, config="longbench_e", datasets=["narrativeqa"])
    message = r"^task.num_samples=0: must be null \(every record\) or a sample count ≥ 1$"
    with pytest.raises(KVBenchError, match=message):
        LongBenchTask.check({"num_samples": 0})


def test_missing_file_is_a_one_line_error(tokenizer):
    task = make_task(tokenizer, datasets=["qasper"])
    with pytest.raises(KVBenchError) as error:
        list(task.samples())
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"LongBench dataset 'qasper' not found: expected {FIXTURES / 'qasper.jsonl'}")
    assert "task.data_dir=DIR" in message


def test_malformed_file_is_a_one_line_error(tokenizer, tmp_path):
    (tmp_path / "trec.jsonl").write_text('{"input": "x"}\n', encoding="utf-8")
    task = make_task(tokenizer, datasets=["trec"], data_dir=str(tmp_path))
    with pytest.raises(KVBenchError, match=r"trec.jsonl:1 lacks context, answers, length, all_classes, _id"):
        list(task.samples())
    (tmp_path / "trec.jsonl").write_text("not json\n", encoding="utf-8")
    with pytest.raises(KVBenchError, match=r"trec.jsonl:1 is not valid JSON"):
        list(task.samples())


def test_hub_archive_is_read(tokenizer, tmp_path, monkeypatch):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.write(FIXTURES / "trec.jsonl", "data/trec.jsonl")
        zipped.write(FIXTURES / "qasper_e.jsonl", "data/qasper_e.jsonl")
    calls = []

    def download(repo_id, filename, repo_type, local_files_only=False):
        calls.append((repo_id, filename, repo_type))
        return str(archive)

    monkeypatch.setattr(hub.huggingface_hub, "hf_hub_download", download)
    local = [s.input_ids for s in make_task(tokenizer, datasets=["trec"]).samples()]
    hub_ids = [s.input_ids for s in make_task(tokenizer, datasets=["trec"], data_dir=None).samples()]
    assert hub_ids == local and calls == [("THUDM/LongBench", "data.zip", "dataset")]
    e_ids = [s.id for s in make_task(tokenizer, config="longbench_e", datasets=["qasper"], data_dir=None).samples()]
    assert e_ids == ["fixture-qasper-e-0", "fixture-qasper-e-1", "fixture-qasper-e-2"]
    with pytest.raises(KVBenchError, match="cannot read data/hotpotqa.jsonl from .*data.zip"):
        list(make_task(tokenizer, datasets=["hotpotqa"], data_dir=None).samples())
    archive.write_bytes(b"not a zip")
    with pytest.raises(KVBenchError, match="cannot read data/trec.jsonl from .*data.zip"):
        list(make_task(tokenizer, datasets=["trec"], data_dir=None).samples())


def test_hub_failure_is_a_one_line_error(tokenizer, monkeypatch):
    def download(repo_id, filename, repo_type, local_files_only=False):
        raise OSError("connection refused\nTraceback details")

    monkeypatch.setattr(hub.huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(hub, "hub_online", lambda: True)
    with pytest.raises(KVBenchError) as error:
        list(make_task(tokenizer, datasets=["trec"], data_dir=None).samples())
    message = str(error.value)
    assert "\n" not in message and "connection refused" in message and "task.data_dir=FOLDER" in message


def test_aggregate(tokenizer):
    task = make_task(tokenizer)
    records = [
        {"subtask": "trec", "score": 1.0, "length": 10},
        {"subtask": "trec", "score": 0.0, "length": 9000},
        {"subtask": "qasper", "score": 0.25, "length": 5000},
    ]
    assert task.aggregate(records) == {"trec": 50.0, "qasper": 25.0}
    e_task = make_task(tokenizer, config="longbench_e")
    assert e_task.aggregate(records) == {"trec@0-4k": 100.0, "trec@8k+": 0.0, "qasper@4-8k": 25.0}


def test_longbench_e_reads_e_files_and_buckets(tokenizer):
    task = make_task(tokenizer, config="longbench_e", datasets=["qasper"])
    samples = list(task.samples())
    assert [s.subtask for s in samples] == ["qasper"] * 3 and samples[0].max_new_tokens == 128
    records = [{"subtask": s.subtask, **task.evaluate(s, s.answers[0])} for s in samples]
    assert task.aggregate(records) == {"qasper@0-4k": 100.0, "qasper@4-8k": 100.0, "qasper@8k+": 100.0}


@pytest.mark.parametrize("dataset", ["multi_news", "multifieldqa_zh"])
def test_real_records(tokenizer, dataset, monkeypatch):
    """Official files through ``KVBENCH_LONGBENCH_DIR`` (the task file's data_dir), when they are present."""
    if not (REAL_DATA / f"{dataset}.jsonl").is_file():
        pytest.skip(f"no {dataset}.jsonl in {REAL_DATA} (set KVBENCH_LONGBENCH_DIR to a folder of LongBench files)")
    monkeypatch.setenv("KVBENCH_LONGBENCH_DIR", str(REAL_DATA))
    cfg = OmegaConf.load(kvbench.CONF_DIR / "task" / "longbench.yaml")
    cfg.merge_with({"datasets": [dataset], "num_samples": 25, "max_length": 2048})
    task = LongBenchTask(cfg, ModelInfo("test", tokenizer, 4096))
    samples = list(task.samples())
    assert len(samples) == 25 and len({s.id for s in samples}) == 25
    records = {record["_id"]: record for record in task.records(dataset)}
    for sample in samples:
        prompt = PROMPTS[dataset].format(**records[sample.id])
        assert sample.input_ids == official_cut(tokenizer, prompt, 2048)
        assert sample.max_new_tokens == MAX_NEW_TOKENS[dataset] and sample.answers
        assert task.score(sample, sample.answers[0]) == pytest.approx(1.0, abs=1e-6)
    assert all(len(record["answers"]) >= 1 for record in records.values())


def test_the_printed_config_holds_the_models_truncation_length():
    """job.resolve fills in task.max_length from the table for a model it has, so config.yaml shows what runs."""
    from kvbench.config import compose
    from kvbench.job import resolve

    def resolved(*overrides: str):
        return resolve(compose(["task=longbench", "policy=snapkv", "budget=128", *overrides])).cfg.task.max_length

    assert resolved("model=llama31_8b") == 127500  # the table's Llama-3.1-8B-Instruct entry
    assert resolved("model=llama31_8b", "task.max_length=1800") == 1800
    assert resolved("model=smollm2_135m") is None  # not in the table: per dataset, the window less its answer


def test_the_subset_draw_is_the_one_random_sample_made_and_grows_by_appending():
    """``drawn``: the indices ``Random(seed).sample`` gave for the sizes where it draws one by one (every run
    subsampled so far at up to 16 of 200 records keeps its samples), and a larger draw begins with a smaller one."""
    import random

    from kvbench.tasks.longbench import drawn

    for count in range(1, 17):
        assert drawn(200, count, 42) == random.Random(42).sample(range(200), count)
    assert drawn(200, 150, 7)[:40] == drawn(200, 40, 7) and len(set(drawn(200, 150, 7))) == 150
