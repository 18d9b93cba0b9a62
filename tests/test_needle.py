"""Kamradt's needle-in-a-haystack task: the grid, the insertion, the prompts, the scorers and the heatmap."""

import json
import re

import pytest
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.metrics.needle import rouge1, substring_match
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.needle import NEEDLE, NeedleTask, rounded_depths

SENTENCE = re.compile(r"[^.]*\.")
ESSAYS = {
    "b_growth.txt": "Startups are companies designed to grow fast. Growth is the thing that matters most. ",
    "a_cities.txt": "Great cities attract ambitious people. Each city sends a message to those who live there. ",
    "c_writing.txt": "Writing an essay is a way to figure out what you think. The first draft is never right. ",
}


def niah_cfg(**overrides):
    """niah.yaml, raw prompts (the byte tokenizer has no chat template) unless overridden."""
    cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "task" / "niah.yaml")
    return OmegaConf.merge(cfg, {"prompt_format": "raw", **overrides})


@pytest.fixture
def essay_dir(tmp_path):
    for name, text in ESSAYS.items():
        (tmp_path / name).write_text(text * 8, encoding="utf-8")
    return str(tmp_path)


def byte_model(max_context=4096):
    return ModelInfo("tiny_llama", byte_tokenizer(max_context), max_context)


@pytest.fixture
def byte_task(essay_dir):
    return NeedleTask(niah_cfg(context_lengths=[1024, 2048], depth_steps=5, essay_dir=essay_dir), byte_model())


# --- grid and insertion (byte tokenizer: one token per byte) ------------------------------------


def test_depths_are_the_testers_rounded_linspace():
    assert rounded_depths(10) == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    assert rounded_depths(3) == [0, 50, 100]
    assert rounded_depths(1) == [0]


def test_the_grid_is_lengths_times_depths_with_stable_ids(byte_task):
    samples = list(byte_task.samples())
    assert len(samples) == 2 * 5
    assert [s.id for s in samples[:5]] == [
        "niah-1024-0",
        "niah-1024-25",
        "niah-1024-50",
        "niah-1024-75",
        "niah-1024-100",
    ]
    assert samples[5].id == "niah-2048-0"
    assert [s.metadata["context_length"] for s in samples] == [1024] * 5 + [2048] * 5
    assert all(s.mode == "generate" and s.max_new_tokens == 300 for s in samples)
    assert samples[0].answers == [NEEDLE.strip()]
    explicit = NeedleTask(
        niah_cfg(context_lengths=[1024], depths=[10, 90], essay_dir=byte_task.settings.essay_dir), byte_model()
    )
    assert [s.id for s in explicit.samples()] == ["niah-1024-10", "niah-1024-90"]


@pytest.mark.parametrize("length", [1024, 2048])
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_needle_sits_at_the_sentence_boundary_before_the_depth(byte_task, length, depth):
    context, info = byte_task.context(length, depth)
    assert context.count(NEEDLE) == 1
    haystack = context.replace(NEEDLE, "")
    assert len(haystack) == info["haystack_tokens"] == length - byte_task.buffer - len(NEEDLE)
    position = context.index(NEEDLE)
    assert position == info["needle_token_index"]
    target = int(len(haystack) * depth / 100)
    longest_sentence = max(len(sentence) for sentence in SENTENCE.findall(haystack))
    if depth == 100:
        assert position == len(haystack)
    else:
        assert target - longest_sentence <= position <= target
        assert position == 0 or haystack[position - 1] == "."  # right after a period
        assert "." not in haystack[position:target]  # the nearest period before the depth point


def test_the_haystack_is_the_essay_files_in_name_order_glued_and_repeated(byte_task):
    text = byte_task.model.decode(byte_task.haystack_ids)
    files = [ESSAYS[name] * 8 for name in sorted(ESSAYS)]
    assert text.startswith("".join(files)[:2048])
    assert len(byte_task.haystack_ids) >= 2048


def test_prompts_fit_the_length_and_end_with_the_question(essay_dir):
    # the 200-token buffer covers the template in real tokens; bytes need more room
    task = NeedleTask(
        niah_cfg(context_lengths=[1024, 2048], depth_steps=5, buffer=300, essay_dir=essay_dir), byte_model()
    )
    byte_task = task
    for sample in task.samples():
        assert len(sample.input_ids) <= sample.metadata["context_length"]
        text = byte_task.model.tokenizer.decode(sample.input_ids, skip_special_tokens=True)
        assert text.startswith("You are a helpful AI bot that answers questions for a user.")
        assert text.endswith(
            "What is the best thing to do in San Francisco? Don't give information outside "
            "the document or repeat your findings\n"
        )


def test_kvcache_factory_prompt_stops_at_a_newline(essay_dir):
    task = NeedleTask(
        niah_cfg(context_lengths=[1024], depths=[50], prompt_format="kvcache_factory", essay_dir=essay_dir),
        byte_model(),
    )
    [sample] = list(task.samples())
    text = task.model.tokenizer.decode(sample.input_ids, skip_special_tokens=True)
    assert text.startswith("<|im_start|> This is a very long story book: <book> ")
    assert text.endswith(
        "</book>.\n Based on the content of the book, Question: The best thing to do in San Francisco is: \nAnswer:"
    )
    assert sample.max_new_tokens == 30 and sample.stop_strings == ["\n"]
    assert sample.input_ids[0] == task.model.tokenizer.bos_token_id


@pytest.mark.model
def test_smollm2_prompts_use_the_chat_template_and_fit(tmp_path):
    from kvbench.models import load_tokenizer, model_config

    tokenizer = load_tokenizer(model_config("smollm2_135m"))
    task = NeedleTask(
        niah_cfg(context_lengths=[1024, 2048], depth_steps=3, prompt_format="hf_chat"),
        ModelInfo("smollm2_135m", tokenizer, 8192),
    )
    for sample in task.samples():
        text = tokenizer.decode(sample.input_ids)
        assert len(sample.input_ids) <= sample.metadata["context_length"]
        assert text.startswith("<|im_start|>system\nYou are a helpful AI bot")
        assert text.endswith("repeat your findings<|im_end|>\n<|im_start|>assistant\n")
        assert text.count("eat a sandwich and sit in Dolores Park on a sunny day.") == 1
        depth = sample.metadata["depth"]
        assert abs(sample.metadata["needle_depth"] - depth / 100) < 0.1  # within a sentence or two of tokens


# --- scorers -------------------------------------------------------------------------------------


def test_substring_scorer_needs_every_key_phrase():
    keys = ["sandwich", "dolores"]
    assert substring_match("Eat a SANDWICH in Dolores Park.", keys) == 1.0
    assert substring_match("eat a sandwich", keys) == 0.0
    assert substring_match("anything", []) == 0.0


def test_rouge1_matches_a_hand_count():
    # needle: 21 words; prediction: its first 12 words, all matched (stems agree on both sides)
    prediction = "The best thing to do in San Francisco is eat a sandwich."
    assert rouge1(NEEDLE, prediction) == pytest.approx(24 / 33)  # F = 2PR/(P+R), P = 1, R = 12/21
    assert rouge1(NEEDLE, prediction, "recall") == pytest.approx(12 / 21)
    assert rouge1(NEEDLE, prediction, "precision") == pytest.approx(1.0)
    assert rouge1(NEEDLE, "Sandwiches!") == pytest.approx(2 * (1 / 21) / (1 + 1 / 21))  # stemmed: sandwich
    assert rouge1(NEEDLE, "   ") == 0.0 and rouge1(NEEDLE, "") == 0.0
    assert rouge1(NEEDLE, NEEDLE) == pytest.approx(1.0)


def test_task_scores_records_and_aggregates(byte_task, essay_dir):
    samples = list(byte_task.samples())
    record = byte_task.evaluate(samples[2], "The best thing to do in San Francisco is eat a sandwich.")
    assert record["score"] == pytest.approx(24 / 33) and record["score_x10"] == pytest.approx(240 / 33)
    assert record["context_length"] == 1024 and record["depth"] == 50
    substring = NeedleTask(niah_cfg(context_lengths=[1024], scorer="substring", essay_dir=essay_dir), byte_model())
    assert substring.score(samples[0], "a sandwich in dolores park") == 1.0
    records = [
        {"context_length": 1024, "depth": 0, "score": 1.0},
        {"context_length": 1024, "depth": 100, "score": 0.5},
        {"context_length": 2048, "depth": 0, "score": 0.0},
        {"context_length": 2048, "depth": 100, "score": 0.25},
    ]
    assert byte_task.aggregate(records) == {
        "overall": pytest.approx(43.75),
        "1024": pytest.approx(75.0),
        "2048": pytest.approx(12.5),
    }
    assert byte_task.aggregate([]) == {}


def test_records_fit_the_heatmap_of_kvbench_plot(byte_task, tmp_path):
    from kvbench.results.plots import niah_figure, niah_grid, save

    samples = list(byte_task.samples())
    answers = {0: NEEDLE, 25: "", 50: NEEDLE, 75: "nothing", 100: NEEDLE}
    records = [
        {
            "id": s.id,
            "subtask": s.subtask,
            **byte_task.evaluate(s, answers[int(s.metadata["depth"])]),
            "answers": s.answers,
        }
        for s in samples
    ]
    matrix = niah_grid(json.loads(json.dumps(records)))  # as read back from predictions.jsonl
    assert list(matrix.columns) == [1024, 2048] and list(matrix.index) == [0.0, 25.0, 50.0, 75.0, 100.0]
    assert matrix.loc[50.0, 2048] == pytest.approx(100.0) and matrix.loc[25.0, 1024] == 0.0
    path = save(niah_figure(records, "niah"), tmp_path / "heatmap.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- errors --------------------------------------------------------------------------------------


def test_bad_options_are_one_line_errors(essay_dir, tmp_path):
    cases = [
        (dict(context_lengths=[8192]), "above the context window 4096"),
        (dict(context_lengths=[150]), "not above task.buffer=200"),
        (dict(depths=[120]), "task.depths=[120]: must be null (task.depth_steps points) or a number in [0, 100]"),
        (dict(scorer="bleu"), "task.scorer=bleu: must be one of "),
        (dict(prompt_format="chatty"), "task.prompt_format=chatty: must be one of "),
        (
            dict(prompt_format="hf_chat"),
            "task.prompt_format=hf_chat needs a chat template but the tokenizer of model tiny_llama has none",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(KVBenchError, match=re.escape(message)) as error:
            NeedleTask(niah_cfg(essay_dir=essay_dir, **{"context_lengths": [1024], **overrides}), byte_model())
        assert "\n" not in str(error.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    task = NeedleTask(niah_cfg(context_lengths=[1024], essay_dir=str(empty)), byte_model())
    with pytest.raises(KVBenchError) as error:
        list(task.samples())
    assert "\n" not in str(error.value) and "task.essay_dir=" in str(error.value)


def test_context_lengths_as_an_inclusive_range_like_kvcache_factory(essay_dir):
    task = NeedleTask(
        niah_cfg(context_range={"min": 1000, "max": 1300, "step": 100}, essay_dir=essay_dir), byte_model()
    )
    assert task.context_lengths == [1000, 1100, 1200, 1300]  # np.arange(s_len, e_len + 1, step)
    with pytest.raises(KVBenchError, match="task.context_range needs min, max and a positive step"):
        NeedleTask(niah_cfg(context_range={"min": 1000, "max": 1300}, essay_dir=essay_dir), byte_model())
