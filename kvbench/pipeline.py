"""Text in, answers out: a context and its questions answered by a model through a compressed cache, in the shape a
kvpress user knows (``pipeline(context, question=..., press=...)``)::

    from kvbench import pipeline

    answers = pipeline(context, ["What is the key?", "Who wrote it?"], policy="snapkv", budget="20pct")
    answers[0].text, answers[0].kv.after_prefill_bytes

The user turn is ``prompt`` filled with the context and the question, in the model's chat template (as the ``qa``
task renders it; its answer prefix after the generation prompt). Query-aware (the default), each question is read
with its context and the two are compressed together; ``query_agnostic=True`` compresses the context once per
policy and reads each question after it, without evicting (:func:`~kvbench.engine.shared.prefill_questions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbench.engine import Engine
from kvbench.engine.rows import decode_rows
from kvbench.engine.shared import Prompt, prefill_questions
from kvbench.engine.sizes import CacheSizes
from kvbench.errors import KVBenchError
from kvbench.models import LoadedModel, load_model, model_config
from kvbench.policies import build_policy
from kvbench.tasks import prompts

#: the user turn of a question about a context (the ``qa`` task's default prompt)
PROMPT = "{context}\n\nAnswer the question based on the text above.\n\nQuestion: {question}"


@dataclass
class Answer:
    """One question's answer: its ``text``, its token ids, the prompt's token count, the cache's sizes (``kv``:
    tokens and bytes held per layer after the prefill, the peak, the full cache's bytes) and, where asked, the
    positions each layer and head kept (``kept[layer][head]``)."""

    question: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    kv: CacheSizes
    kept: list[list[list[int]]] | None = None
    context_shared_by: int = 1  # questions answered from one compression of the context


def pipeline(
    context: str,
    questions: str | Sequence[str],
    *,
    model: str | LoadedModel = "smollm2_135m",
    policy: str = "snapkv",
    budget: str | int = "128",
    answer_prefix: str = "",
    max_new_tokens: int = 32,
    query_agnostic: bool = False,
    prompt: str = PROMPT,
    record_kept: bool = False,
    **settings,
) -> list[Answer]:
    """The answers to ``questions`` (one string or several) about ``context``, greedy, up to ``max_new_tokens`` each
    (stopping at the model's end of turn), by ``model`` (a configured name, or a :func:`~kvbench.models.load_model`
    result) keeping ``budget`` tokens per layer (``"128"``, ``"20pct"``, ...) by ``policy`` (a spec, ``settings`` its
    own: ``window=16``); see the module's docstring for the two modes."""
    if (
        "{context}" not in prompt
        or "{question}" not in prompt
        or not prompt.index("{context}") < prompt.index("{question}")
    ):
        raise KVBenchError(f"pipeline prompt {prompt!r} needs {{context}} and then {{question}}")
    loaded = model if isinstance(model, LoadedModel) else load_model(model_config(model))
    asked = [questions] if isinstance(questions, str) else list(questions)
    engine = Engine(
        loaded.model, build_policy(policy, settings), budget, tokenizer=loaded.tokenizer, record_kept=record_kept
    )
    template = prompts.HF_CHAT if loaded.tokenizer.chat_template is not None else "raw"
    made = [
        prompt_of(loaded, template, context, question, prompt, answer_prefix, max_new_tokens, query_agnostic)
        for question in asked
    ]
    if query_agnostic:
        rows = prefill_questions([engine], made)
    else:
        rows = [engine.prefilled_row(one.input_ids, one.max_new_tokens, one.stop_token_ids) for one in made]
    outputs = decode_rows(rows, len(rows))
    return [
        Answer(
            question,
            str(loaded.tokenizer.decode(output.token_ids, skip_special_tokens=True)).strip(),
            output.token_ids,
            output.prompt_tokens,
            output.kv,
            output.kept,
            output.context_shared_by,
        )
        for question, output in zip(asked, outputs)
    ]


def prompt_of(
    loaded: LoadedModel,
    template: str,
    context: str,
    question: str,
    prompt: str,
    answer_prefix: str,
    max_new_tokens: int,
    split: bool,
) -> Prompt:
    """One question's prompt: ``prompt`` filled in ``template`` (the chat template, or the raw text where the model
    has none), the answer prefix after it; with ``split``, where its question starts (the context before it)."""
    text = prompt.format(context=context, question=question)
    rendered, special_tokens = prompts.rendered(loaded.tokenizer, loaded.name, template, text, answer_prefix)
    if not split:
        ids = list(loaded.tokenizer(rendered, add_special_tokens=special_tokens)["input_ids"])
        return Prompt(ids, max_new_tokens, loaded.stop_token_ids)
    asked = prompt.split("{context}")[1].format(question=question)
    ids, start = prompts.split_question(loaded.tokenizer, rendered, special_tokens, asked)
    return Prompt(ids, max_new_tokens, loaded.stop_token_ids, question_start=start)
