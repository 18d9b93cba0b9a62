"""NeedleBench v1: generation on handwritten fixtures in the hub layout, the official scorers, aggregation."""

import json
import random

import pytest
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT, hub
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.metrics.needlebench import levenshtein, multi_reasoning_score, multi_retrieval_score, single_needle_score
from kvbench.tasks import needlebench
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.needlebench import NeedleBenchTask, guided_question, retrieval_question, truncated_depths

FIXTURES = PROJECT_ROOT / "tests" / "fixtures" / "needlebench"
MODEL = ModelInfo("tiny_llama", byte_tokenizer(4096), 4096)


def nb_cfg(**overrides):
    cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "task" / "needlebench.yaml")
    cfg.data_dir = str(FIXTURES)
    cfg.grid = "4k"
    cfg.prompt_format = "raw"  # the byte tokenizer has no chat template
    return OmegaConf.merge(cfg, overrides)


def fixture_lines(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text(encoding="utf-8").splitlines() if line.strip()]


def text_of(sample):
    return MODEL.tokenizer.decode(sample.input_ids, skip_special_tokens=True)


# --- official grids and scorers ------------------------------------------------------------------


def test_official_depths_and_grids():
    assert truncated_depths(20) == [0, 5, 10, 15, 21, 26, 31, 36, 42, 47, 52, 57, 63, 68, 73, 78, 84, 89, 94, 100]
    assert needlebench.GRIDS["8k"].lengths == (5000, 6000, 7000, 8000)
    assert needlebench.GRIDS["8k"].buffers["reasoning"] == {"en": 1000, "zh": 200}
    task = NeedleBenchTask(nb_cfg(context_lengths=None, depths=None, subtasks=["single_en"]), MODEL)
    assert task.context_lengths == [1000, 2000, 3000, 4000] and len(task.depths) == 20
    assert task.repeats("single") == 10 and task.repeats("retrieval") == 25


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "abc") == 0
    assert levenshtein("flaw", "lawn") == 2


def test_single_needle_score_is_keyword_or_a_fifth_of_the_similarity():
    needle = "\nThe vault holds the Silver Compass.\n"
    assert single_needle_score("It keeps the Silver Compass.", needle, "Silver Compass") == 1.0
    assert (
        single_needle_score("It keeps the silver compass.", needle, "Silver Compass") != 1.0
    )  # case-sensitive keyword
    # whitespace removed: "Thevaultholds" vs "ThevaultholdstheSilverCompass." (30 chars): 17 insertions
    assert single_needle_score("The vault holds", needle, "Silver Compass") == pytest.approx(0.2 * (1 - 17 / 30))
    assert single_needle_score("", needle, "Silver Compass") == 0.0
    assert single_needle_score("abcdxyz", "abcd efgh", "zzz") == pytest.approx(0.2 * (1 - 4 / 8))


def test_multi_needle_scores():
    keywords = ["Stardust Shard", "Silver Compass", "Crimson Gull"]
    assert multi_retrieval_score("Stardust Shard、Crimson Gull", keywords) == pytest.approx(2 / 3)
    assert multi_retrieval_score("stardust shard", keywords) == 0.0  # case-sensitive as the official evaluator
    assert multi_retrieval_score("x", []) == 0.0
    assert multi_reasoning_score("The river is the DOURO river.", "Douro River") == 1.0
    assert multi_reasoning_score("It is the Douro.", "Douro River") == 0.5
    assert multi_reasoning_score("浙江省", "浙江省") == 1.0 and multi_reasoning_score("anything", "") == 0.0


# --- generation on the fixtures ------------------------------------------------------------------


def test_haystack_order_applies_the_loaders_cumulative_shuffles():
    task = NeedleBenchTask(nb_cfg(), MODEL)
    expected = list(range(len(fixture_lines("PaulGrahamEssays.jsonl"))))
    for counter in range(3):
        random.seed(counter)
        random.shuffle(expected)
    assert task.order("en", 2) == expected


def test_single_needle_samples_follow_the_official_draw_and_insertion():
    task = NeedleBenchTask(
        nb_cfg(context_lengths=[1000], depths=[0, 50, 100], num_repeats=2, subtasks=["single_en", "single_zh"]), MODEL
    )
    samples = list(task.samples())
    assert [s.id for s in samples[:3]] == ["single_en-L1000-D0-0", "single_en-L1000-D0-1", "single_en-L1000-D50-0"]
    assert len(samples) == 2 * 3 * 2
    for sample in samples:
        language = sample.metadata["language"]
        entry = random.Random(sample.metadata["repeat"]).choice(
            [line for line in fixture_lines("needles.jsonl") if line["language"] == language]
        )
        needle = "\n" + entry["needle"] + "\n"
        assert sample.answers == [entry["arg2"]] and sample.metadata["needle"] == needle
        text = text_of(sample)
        assert text.count(needle) == 1
        haystack_tokens = 1000 - task.buffer("single", sample.subtask[-2:]) - len(task.model.encode(needle))
        assert sample.metadata["insertion_points"] == [int(haystack_tokens * sample.metadata["depth"] / 100)]
    english = text_of(samples[0])
    assert english.startswith("You are an intelligent AI assistant skilled in answering user questions.\n")
    assert (
        "Before answering, please consider what in the document is most relevant to this question. "
        "Please answer in the format of '" in english
    )
    chinese = text_of(samples[-1])
    assert chinese.startswith("你是一个善于回答用户问题的智能AI助手\n") and "现在请问：" in chinese
    assert "在回答之前，请思考文档中与此问题最相关的内容是什么。请按照'" in chinese


def test_single_needle_depth_places_the_needle_at_that_token():
    task = NeedleBenchTask(nb_cfg(context_lengths=[1000], depths=[50], num_repeats=1, subtasks=["single_en"]), MODEL)
    [sample] = list(task.samples())
    needle_ids = task.model.encode(sample.metadata["needle"])
    target = 1000 - 600 - len(needle_ids)  # 4k grid, English single-needle buffer 600
    assert sample.metadata["insertion_points"] == [target // 2]
    text = text_of(sample)
    prefix = "The document given to you by the user is "
    context = text[text.index(prefix) + len(prefix) : text.index("\n\nNow, the question is:")]
    assert context.index(sample.metadata["needle"]) == target // 2  # bytes = tokens
    assert len(context) == target + len(needle_ids)


def test_multi_needle_retrieval_puts_one_needle_per_depth():
    task = NeedleBenchTask(
        nb_cfg(context_lengths=[2000], depths=[10, 50, 90], num_repeats=2, subtasks=["retrieval_en"]), MODEL
    )
    samples = list(task.samples())
    assert [s.id for s in samples] == ["retrieval_en-L2000-0", "retrieval_en-L2000-1"]
    english = {line["arg2"]: line for line in fixture_lines("needles.jsonl") if line["language"] == "English"}
    for sample in samples:
        assert len(sample.answers) == 3 and len(set(sample.answers)) == 3
        text = text_of(sample)
        positions = [text.index(english[keyword]["needle"]) for keyword in sample.answers]
        assert positions == sorted(positions)  # the i-th needle at the i-th depth
        question = retrieval_question([english[keyword] for keyword in sample.answers], "English")
        assert question.count("?、") == 2 and question.endswith("______'")
        assert text.endswith("Now, the questions are: " + guided_question(question, "English", "retrieval") + "\n")
    assert sorted(samples[0].answers) == sorted(samples[1].answers)  # same needles, shuffled per repeat
    assert task.score(samples[0], " ".join(samples[0].answers[:2])) == pytest.approx(2 / 3)


def test_multi_needle_reasoning_spaces_needles_by_diff():
    task = NeedleBenchTask(
        nb_cfg(
            context_lengths=[2000],
            depths=[20],
            num_repeats=1,
            needle_counts=[2, 3],
            subtasks=["reasoning_en", "reasoning_zh"],
        ),
        MODEL,
    )
    samples = list(task.samples())
    assert [s.id for s in samples] == [
        "reasoning_en-2needle-L2000-D20-0",
        "reasoning_en-3needle-L2000-D20-0",
        "reasoning_zh-2needle-L2000-D20-0",
        "reasoning_zh-3needle-L2000-D20-0",
    ]
    three = samples[1]
    record = next(
        r for r in json.loads((FIXTURES / "multi_needle_reasoning_en.json").read_text()) if r["derivation_count"] == 3
    )
    assert three.answers == ["Douro River"]
    needle_lengths = [len(task.model.encode("\n" + d + "\n")) for d in record["derivations"]]
    total = 2000 - 600 - sum(needle_lengths)  # available haystack (the fixture holds more)
    first, second, third = three.metadata["insertion_points"]
    assert first == int(total * 0.2)
    # OpenCompass computes each point after the previous needle (pre-insertion coordinates), then shifts
    # later points by every inserted needle: the gap after a needle is its length plus 10 % of the haystack
    assert second - first == 2 * needle_lengths[0] + int(total * 0.1)
    assert third - second == 2 * needle_lengths[1] + int(total * 0.1)
    text = text_of(three)
    assert text.endswith(
        record["question"] + "Before answering, please consider what in the document is most relevant to this question."
    )
    assert task.score(three, "It lies on the douro river") == 1.0


@pytest.mark.model
def test_chat_models_get_one_user_turn():
    from kvbench.models import load_tokenizer, model_config

    tokenizer = load_tokenizer(model_config("smollm2_135m"))
    task = NeedleBenchTask(
        nb_cfg(context_lengths=[1000], depths=[50], num_repeats=1, subtasks=["single_zh"], prompt_format="hf_chat"),
        ModelInfo("smollm2_135m", tokenizer, 8192),
    )
    [sample] = list(task.samples())
    text = tokenizer.decode(sample.input_ids)
    assert text.count("<|im_start|>user\n你是一个善于回答用户问题的智能AI助手") == 1
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


# --- aggregation ---------------------------------------------------------------------------------


def test_aggregate_follows_the_official_summarizer():
    def rec(subtask, score, length=1000, depth=0, count=None):
        return {"subtask": subtask, "score": score, "context_length": length, "depth": depth, "needle_count": count}

    records = [
        rec("single_en", 1.0),
        rec("single_en", 0.0),
        rec("single_en", 1.0, depth=50),
        rec("single_en", 1.0, depth=50),
        rec("single_zh", 0.5),
        rec("retrieval_en", 1.0, depth=None),
        rec("retrieval_zh", 0.0, depth=None),
        rec("reasoning_en", 1.0, count=2),
        rec("reasoning_en", 0.0, count=3),
        rec("reasoning_zh", 0.5, count=2),
    ]
    scores = NeedleBenchTask(nb_cfg(), MODEL).aggregate(records)
    assert scores["single_en"] == pytest.approx(75.0)  # datasets (L1000, D0) = 50 and (L1000, D50) = 100
    assert scores["single"] == pytest.approx((50 + 100 + 50) / 3)  # a plain mean over the three datasets
    assert scores["retrieval"] == pytest.approx(50.0)
    assert scores["reasoning2_en"] == 100.0 and scores["reasoning3_en"] == 0.0 and scores["reasoning2_zh"] == 50.0
    assert scores["reasoning_en"] == pytest.approx(50.0) and scores["reasoning"] == pytest.approx(50.0)
    assert scores["overall"] == pytest.approx(0.4 * 200 / 3 + 0.3 * 50 + 0.3 * 50)
    only = NeedleBenchTask(nb_cfg(), MODEL).aggregate(records[-3:])
    assert "overall" not in only and set(only) == {
        "reasoning_en",
        "reasoning_zh",
        "reasoning2_en",
        "reasoning3_en",
        "reasoning2_zh",
        "reasoning",
    }


# --- missing data --------------------------------------------------------------------------------


def test_missing_files_are_one_line_errors(tmp_path, monkeypatch):
    (tmp_path / "needles.jsonl").write_text((FIXTURES / "needles.jsonl").read_text(encoding="utf-8"), encoding="utf-8")
    task = NeedleBenchTask(
        nb_cfg(data_dir=str(tmp_path), subtasks=["single_zh"], context_lengths=[1000], depths=[0], num_repeats=1), MODEL
    )
    with pytest.raises(KVBenchError) as error:
        list(task.samples())
    message = str(error.value)
    assert "\n" not in message and "zh_finance.jsonl" in message and "task.data_dir=" in message

    monkeypatch.setattr(hub, "hub_online", lambda: False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    task = NeedleBenchTask(
        nb_cfg(data_dir=None, subtasks=["reasoning_en"], context_lengths=[1000], depths=[0], num_repeats=1), MODEL
    )
    with pytest.raises(KVBenchError) as error:
        list(task.samples())
    message = str(error.value)
    assert "\n" not in message and "opencompass/NeedleBench" in message and "task.data_dir=" in message

    with pytest.raises(KVBenchError, match="derivation_count=5") as error:
        list(
            NeedleBenchTask(
                nb_cfg(subtasks=["reasoning_en"], needle_counts=[5], context_lengths=[1000], depths=[0], num_repeats=1),
                MODEL,
            ).samples()
        )
    with pytest.raises(KVBenchError, match=r"^task.subtasks=\['single_fr'\]: must be null \(all six\) or one of "):
        NeedleBenchTask(nb_cfg(subtasks=["single_fr"]), MODEL)
    with pytest.raises(KVBenchError, match="above the context window 4096"):
        NeedleBenchTask(nb_cfg(grid="8k"), MODEL)


def test_answers_get_opencompass_1024_new_tokens_or_the_set_numbers():
    """OpenCompass's model configs (max_out_len=1024) for every kind, unless set per kind."""
    cells = dict(context_lengths=[1000], depths=[0], num_repeats=1, needle_counts=[2])
    samples = list(NeedleBenchTask(nb_cfg(**cells), MODEL).samples())
    assert {s.metadata["kind"] for s in samples} == {"single", "retrieval", "reasoning"}
    assert {s.max_new_tokens for s in samples} == {1024}
    per_kind = {"single": 64, "retrieval": 256, "reasoning": 2000}
    samples = list(NeedleBenchTask(nb_cfg(max_new_tokens=per_kind, **cells), MODEL).samples())
    assert {s.metadata["kind"]: s.max_new_tokens for s in samples} == per_kind
