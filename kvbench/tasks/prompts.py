"""Prompt formats: how the pipeline behind a paper's numbers turned a task's text into token ids.

A *template* is one way to wrap a prompt. A *prompt format* (``task.prompt_format``) names a reference
pipeline; it picks the template for a model from the model's Hugging Face id (``model.hf_id``), by the
same name tests as the pipeline's own code (which matched its model names). Templates:

* ``raw``: the text as it is.
* ``hf_chat``: the tokenizer's chat template around the task's turns (one user turn unless the task
  has more), with the generation prompt. Some templates add system text no reference pipeline sent:
  Llama-3.1's "Cutting Knowledge Date", Qwen2.5's and SmolLM2's default system prompts.
* ``inst_tight``: ``[INST]{prompt}[/INST]`` (LongBench ``pred.py`` and CAKE ``pred_cake.py``, Llama-2).
* ``inst``: ``[INST] {prompt} [/INST]`` (RULER ``template.py`` "meta-chat"; KVCache-Factory ``build_chat``).
* ``mistral_inst``: ``<s>[INST] {prompt} [/INST]`` (CAKE ``pred_cake.py``, Mistral).
* ``llama3_header``: the Llama-3 user/assistant header without system text (RULER ``template.py``
  "meta-llama3"; CAKE ``pred_cake.py``).

The text of every template but ``hf_chat`` is tokenized as those pipelines tokenize it, with the
tokenizer's special tokens (BOS): a template that writes BOS itself (``llama3_header``,
``mistral_inst``) therefore starts with two, as in RULER's and CAKE's Hugging Face code. ``hf_chat``
text holds its special tokens already and is tokenized without adding them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbench.errors import KVBenchError, choose

LLAMA3_HEADER = (
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{prompt}<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
TEMPLATES = {
    "raw": "{prompt}",
    "inst_tight": "[INST]{prompt}[/INST]",
    "inst": "[INST] {prompt} [/INST]",
    "mistral_inst": "<s>[INST] {prompt} [/INST]",
    "llama3_header": LLAMA3_HEADER,
}
HF_CHAT = "hf_chat"


def _family(hf_id: str | None, *names: str) -> bool:
    """Whether the lower-cased Hugging Face id contains every one of ``names``."""
    return hf_id is not None and all(name in hf_id.lower() for name in names)


def _longbench_official(hf_id: str | None) -> str:
    """LongBench ``pred.py`` ``build_chat``: Llama-2 chat gets ``[INST]{prompt}[/INST]``; the other
    families of our models (Llama-3, Mistral, Qwen) have no branch there and get the raw prompt."""
    return "inst_tight" if _family(hf_id, "llama-2", "chat") else "raw"


def _kvcache_factory(hf_id: str | None) -> str:
    """KVCache-Factory ``run_longbench.py`` / ``run_ruler.py`` up to ``ffac160`` (the 2024-25 code the papers
    ran): ``[INST] {prompt} [/INST]`` only when ``"llama2"`` is in the model path, which Hugging Face's
    ``Llama-2`` ids never contain; everything else, Llama-3 and Mistral included, is sent raw."""
    return "inst" if _family(hf_id, "llama2") else "raw"


def _cake(hf_id: str | None) -> str:
    """CAKE ``experiments/LongBench/pred_cake.py`` ``build_chat``: by family, Qwen through its chat template
    (CAKE's system message is Qwen2.5's default one)."""
    for names, template in (
        (("llama-3",), "llama3_header"),
        (("llama-2",), "inst_tight"),
        (("mistral",), "mistral_inst"),
        (("qwen",), HF_CHAT),
    ):
        if _family(hf_id, *names):
            return template
    return "raw"


def _ruler_official(hf_id: str | None) -> str:
    """RULER ``scripts/config_models.sh``: ``meta-llama3`` for Llama-3.1 (here the whole Llama-3 family),
    ``meta-chat`` for Llama-2 chat, ``base`` (the raw prompt) for the models it does not list."""
    if _family(hf_id, "llama-3"):
        return "llama3_header"
    return "inst" if _family(hf_id, "llama-2", "chat") else "raw"


PIPELINES: dict[str, Callable[[str | None], str]] = {
    "raw": lambda hf_id: "raw",
    HF_CHAT: lambda hf_id: HF_CHAT,
    "longbench_official": _longbench_official,
    "kvcache_factory": _kvcache_factory,
    "cake": _cake,
    "ruler_official": _ruler_official,
}
"""Prompt format -> the template it uses for a model's Hugging Face id."""


def template_for(prompt_format: str, valid: tuple[str, ...], hf_id: str | None) -> str:
    """The template ``prompt_format`` (one of the task's ``valid`` formats) uses for the model ``hf_id``."""
    choose("prompt format (task.prompt_format)", prompt_format, valid)
    return PIPELINES[prompt_format](hf_id)


def check_chat_template(tokenizer: Any, model_name: str) -> None:
    """Refuse ``hf_chat`` for a tokenizer without a chat template, in one line."""
    if tokenizer.chat_template is None:
        raise KVBenchError(
            f"task.prompt_format=hf_chat needs a chat template but the tokenizer of model {model_name} has none; "
            "use task.prompt_format=raw"
        )


def rendered(
    tokenizer: Any,
    model_name: str,
    template: str,
    text: str,
    answer_prefix: str = "",
    messages: list[dict[str, str]] | None = None,
) -> tuple[str, bool]:
    """The prompt's text: ``text`` in ``template``, with ``answer_prefix`` after it (after the generation prompt);
    and whether the tokenizer adds its special tokens to it (every template but ``hf_chat``, whose text holds them).

    ``messages`` are the chat turns for ``hf_chat`` (default: ``text`` as one user turn); a chat template
    that refuses a system turn gets the system text prepended to the first user turn.
    """
    if template != HF_CHAT:
        return TEMPLATES[template].format(prompt=text) + answer_prefix, True
    check_chat_template(tokenizer, model_name)
    messages = messages or [{"role": "user", "content": text}]
    try:
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception:  # a template without a system role (e.g. Mistral's): fold it into the first user turn
        if messages[0]["role"] != "system":
            raise
        first, *rest = messages[1:]
        merged = [{"role": "user", "content": f"{messages[0]['content']}\n{first['content']}"}, *rest]
        chat = tokenizer.apply_chat_template(merged, add_generation_prompt=True, tokenize=False)
    return chat + answer_prefix, False


def after_context(template: str, **values: Any) -> str:
    """The question of a task ``template``: its text after ``{context}``, filled in (``values``: the template's fields;
    others are ignored)."""
    return template.split("{context}")[1].format(**values)


def split_question(tokenizer: Any, prompt: str, special_tokens: bool, question: str) -> tuple[list[int], int]:
    """A :func:`rendered` prompt's ids and where its question starts in them: the index
    of the first token that ends past the start of ``question`` (the end of the task's text from where its question
    begins) in ``prompt``, so that a token straddling the boundary goes with the question and the context holds
    nothing of it."""
    begins = prompt.rfind(question.strip())
    if not question.strip() or begins < 0:
        raise KVBenchError(f"the question {question[:60]!r} is not in the rendered prompt")
    encoded = tokenizer(prompt, add_special_tokens=special_tokens, return_offsets_mapping=True, verbose=False)
    ends = [end for _, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), next(index for index, end in enumerate(ends) if end > begins)
