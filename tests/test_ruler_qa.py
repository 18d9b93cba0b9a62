"""RULER qa_1 (SQuAD) and qa_2 (HotpotQA) from tiny files in RULER's (the official datasets') layout."""

import json

import pytest
from omegaconf import OmegaConf

from kvbench import PROJECT_ROOT, hub
from kvbench.engine.tokenizers import byte_tokenizer
from kvbench.errors import KVBenchError
from kvbench.tasks import ruler_qa
from kvbench.tasks.base import ModelInfo
from kvbench.tasks.ruler import RulerTask
from kvbench.tasks.ruler_generators import QA_ANSWER_PREFIX
from kvbench.tasks.ruler_qa import qa_dataset, read_hotpotqa, read_squad

FIXTURES = PROJECT_ROOT / "tests" / "fixtures" / "ruler_qa"
MODEL = ModelInfo("tiny_llama", byte_tokenizer(4096), 4096)


def qa_cfg(**overrides):
    cfg = OmegaConf.load(PROJECT_ROOT / "conf" / "task" / "ruler.yaml")
    cfg.qa_dir = str(FIXTURES)
    cfg.num_samples = 4
    return OmegaConf.merge(cfg, overrides)


def test_read_squad_keeps_answerable_questions_and_article_paragraphs():
    qas, docs = read_squad(json.loads((FIXTURES / "squad.json").read_text()))
    assert len(docs) == 5 and docs == sorted(docs)
    assert [qa["query"] for qa in qas][:2] == [
        "In what country is Normandy located?",
        "What did the Norman dynasty have a major impact on?",
    ]
    assert len(qas) == 5  # the impossible question is dropped
    first = qas[0]
    assert first["outputs"] == ["France"] and docs[first["context"][0]].startswith("The Normans were")
    assert [docs[i] for i in first["more_context"]] == [
        "The Norman dynasty had a major political, cultural and military impact on medieval Europe."
    ]
    assert qas[1]["outputs"] == ["medieval Europe", "Europe"]


def test_read_hotpotqa_joins_titles_and_sentences_without_duplicates():
    qas, docs = read_hotpotqa(json.loads((FIXTURES / "hotpotqa.json").read_text()))
    assert len(docs) == 5  # "Porto" appears in both questions once
    assert "The Glass Garden\nThe Glass Garden is a novel by Ana Duarte. It was published in 1999." in docs
    assert [docs[i].split("\n")[0] for i in qas[0]["context"]] == ["The Glass Garden", "Ana Duarte", "Porto"]
    assert qas[1]["outputs"] == ["no"]


@pytest.mark.parametrize("subtask, dataset", [("qa_1", "squad"), ("qa_2", "hotpotqa")])
def test_qa_samples_hold_the_gold_documents_template_and_prefix(subtask, dataset):
    task = RulerTask(qa_cfg(subtasks=[subtask], context_length=2048), MODEL)
    qas, docs = qa_dataset(dataset, str(FIXTURES))
    for sample in task.samples():
        assert len(sample.input_ids) <= 2048 - 32 and sample.max_new_tokens == 32
        text = MODEL.tokenizer.decode(sample.input_ids, skip_special_tokens=True)
        assert text.startswith(
            "Answer the question based on the given documents. Only give me the answer and do not output any other "
            "words.\n\nThe following are given documents.\n\nDocument 1:\n"
        )
        assert text.endswith(QA_ANSWER_PREFIX) and "\n\nQuestion: " in text
        qa = next(q for q in qas if f"Question: {q['query']} Answer:" in text)
        assert sample.answers == qa["outputs"]
        assert all(docs[i] in text for i in qa["context"])  # the gold paragraph(s)
        assert sample.metadata["num_docs"] == len(docs)  # the tiny corpus fits whole
        assert text.count("Document ") == len(docs)
    assert task.score(sample, f"It is {sample.answers[-1]}.") == 1.0  # string_match_part
    assert task.score(sample, "unrelated") == 0.0


def test_a_short_context_keeps_the_gold_document_first():
    task = RulerTask(qa_cfg(subtasks=["qa_1"], context_length=700), MODEL)
    generated = task.generate("qa_1", 0)
    qas, docs = qa_dataset("squad", str(FIXTURES))
    assert len(generated.input_ids) <= 700 - 32
    assert generated.prompt.info["num_docs"] < len(docs)
    gold = next(q for q in qas if q["query"] in generated.text)
    assert docs[gold["context"][0]] in generated.text


def test_qa_is_named_explicitly_and_missing_data_is_one_line(tmp_path, monkeypatch):
    assert "qa_1" not in RulerTask(qa_cfg(subtasks=None), MODEL).subtasks
    task = RulerTask(qa_cfg(subtasks=["qa_2"], qa_dir=str(tmp_path), context_length=1024), MODEL)
    with pytest.raises(KVBenchError) as error:
        list(task.samples())
    message = str(error.value)
    assert "\n" not in message and "hotpotqa.json" in message and "task.qa_dir=" in message
    monkeypatch.setattr(hub, "hub_online", lambda: False)
    ruler_qa.qa_dataset.cache_clear()
    task = RulerTask(qa_cfg(subtasks=["qa_1"], qa_dir=None, context_length=1024), MODEL)
    with pytest.raises(KVBenchError) as error:
        list(task.samples())
    message = str(error.value)
    assert (
        "\n" not in message
        and "squad.json" in message
        and "rajpurkar/squad_v2" in message
        and "task.qa_dir=" in message
    )
