"""``kvbench.pipeline``: a context and its questions in, answers out, on the offline SmolLM2 (the README's example)."""

from __future__ import annotations

import pytest

from kvbench.engine.runner import Runner
from kvbench.errors import KVBenchError
from kvbench.pipeline import pipeline

CONTEXT = "The grass is green. " * 100 + "The key is 7341."


def test_the_pipeline_answers_a_question_from_the_cut_cache():
    """The README's question: SnapKV + CAOTE at 128 tokens a layer (of a 559-token prompt) still answers it."""
    (answer,) = pipeline(CONTEXT, "What is the key?", policy="snapkv+caote", budget="128", max_new_tokens=12)
    assert "7341" in answer.text
    assert answer.kv.after_prefill_tokens_per_layer == [128] * 30 and answer.prompt_tokens > 500


def test_query_agnostic_answers_two_questions_from_one_compression(monkeypatch):
    """Two questions of one context, query-agnostic: the context is prefilled (and compressed) once, each question
    read after it; each answers its own question."""
    prefills: list[int] = []
    prefill = Runner.prefill
    monkeypatch.setattr(
        Runner, "prefill", lambda runner, cache, ids: prefills.append(len(ids)) or prefill(runner, cache, ids)
    )
    answers = pipeline(
        CONTEXT, ["What is the key?", "What color is the grass?"], budget="128", max_new_tokens=12, query_agnostic=True
    )
    assert len(prefills) == 1 and [answer.context_shared_by for answer in answers] == [2, 2]
    assert "7341" in answers[0].text and "green" in answers[1].text


def test_a_prompt_without_its_fields_is_one_line():
    with pytest.raises(KVBenchError, match=r"needs \{context\} and then \{question\}"):
        pipeline(CONTEXT, "What is the key?", prompt="{question} {context}")
