"""NeedleBench v1's prompts as OpenCompass builds them: the guide sentence, the v1 prompt (question at the end),
the joint retrieval question and the unique-needle draw (``get_unique_entries``)."""

from __future__ import annotations

import json
import random
from typing import Any

_GUIDE = {
    "English": "Before answering, please consider what in the document is most relevant to this question.",
    "Chinese": "在回答之前，请思考文档中与此问题最相关的内容是什么。",
}
_FORMAT_MARKER = {"English": "Please answer in the format", "Chinese": "请按照"}
_ASSISTANT = {
    "English": (
        "You are an intelligent AI assistant skilled in answering user questions.\n"
        "Please keep your answers concise and clear. Do not talk about irrelevant topics or repeat your answers.\n"
    ),
    "Chinese": (
        "你是一个善于回答用户问题的智能AI助手\n请保持你的回答简洁清楚。不要说和下面文档中的无关的话，或重复你的回答\n"
    ),
}


def guided_question(question: str, language: str, kind: str) -> str:
    """The question with OpenCompass's guide sentence (before the answer-format request; reasoning: after)."""
    guide = _GUIDE[language]
    if kind == "reasoning":
        return question + guide
    marker = _FORMAT_MARKER[language]
    if marker not in question:
        return question + guide
    parts = question.split(marker)  # as OpenCompass: the text before the marker and after its first use
    return parts[0] + (guide + " " if language == "English" else guide) + marker + parts[1]


def needlebench_prompt(context: str, question: str, language: str, kind: str) -> str:
    """The v1 prompt (question at the end) of a single-needle, reasoning or retrieval sample."""
    if kind == "retrieval":
        if language == "English":
            return (
                f"{_ASSISTANT[language]}The document given to you by the user is {context}\n\n"
                f"Now, the questions are: {question}\n"
            )
        return (
            f"{_ASSISTANT[language]}请先仔细阅读下面的文档再依次回答最后提出的问题\n"
            f"用户现在给你的文档是{context}\n\n现在请问：{question}\n"
        )
    if language == "English":
        return (
            f"{_ASSISTANT[language]}The document given to you by the user is {context}\n\n"
            f"Now, the question is: {question}"
        )
    return f"{_ASSISTANT[language]}用户现在给你的文档是{context}\n\n现在请问：{question}"


def retrieval_question(needles: list[dict[str, Any]], language: str) -> str:
    """The joint question of a multi-needle retrieval sample, built from each needle's question."""
    if language == "Chinese":
        questions = "、".join(item["retrieval_question"].split("？")[0] + "？" for item in needles)
        formats = "、".join(item["retrieval_question"].split("'")[1].split("。")[0] for item in needles)
        return questions + "请按照'" + formats + "'的格式回答。"
    questions = "、".join(item["retrieval_question"].split("?")[0] + "?" for item in needles)
    formats = "、".join(item["retrieval_question"].split("'")[1].split(".")[0] for item in needles)
    return questions + "Please answer in the format of '" + formats + "'"


def unique_needles(lines: list[str], count: int, language: str, rng: random.Random) -> list[dict[str, Any]]:
    """``get_unique_entries``: up to ``count`` needles of ``language`` with distinct ``arg1``, ``arg2``
    and (arg1, arg2), taken from the shuffled lines of ``needles.jsonl``."""
    lines = list(lines)
    rng.shuffle(lines)
    seen_first, seen_second, found = set(), set(), []
    for line in lines:
        try:
            entry = json.loads(line.strip())
        except json.JSONDecodeError:
            continue
        if entry.get("language") != language:
            continue
        first, second = entry.get("arg1", ""), entry.get("arg2", "")
        if first in seen_first or second in seen_second:  # a new pair follows from both being new
            continue
        seen_first.add(first)
        seen_second.add(second)
        found.append(entry)
        if len(found) == count:
            break
    return found
