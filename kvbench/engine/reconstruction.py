"""Context reconstruction, the forwards behind the ``reconstruction`` statistic (KVzip §3.2; kvpress ``KVzipPress``).

After a context is prefilled whole, the model is asked to repeat it: one forward per chunk of the context (the chat
template's leading tokens left out), each reading a request, the end of the user's turn and the chunk itself after
the context, at the positions that follow it. Each layer records the attention the chunk receives and drops the
forward's tokens (:meth:`~kvbench.engine.cache.EvictionCache.reconstruct`); then every layer is evicted at once.
The caches of one context with the same reconstruction (chunk size, sinks, head layout) share one: a grid's budgets
cost one reconstruction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kvbench.engine.cache import EvictionCache

#: what the first chunk's forward asks, and every later one's (followed by the previous chunk's last tokens)
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
#: tokens of the previous chunk a later request ends with
OVERLAP = 8


@dataclass(frozen=True)
class RepeatPrompt:
    """The token pieces of a reconstruction forward for one tokenizer: ``prefix`` the chat template's tokens before a
    user message (left out of what is repeated), ``first``/``next`` the requests, ``suffix`` the template's tokens from
    the end of the user's message to the assistant's answer."""

    prefix: list[int]
    first: list[int]
    next: list[int]
    suffix: list[int]

    @classmethod
    def of(cls, tokenizer) -> RepeatPrompt:
        """The pieces as kvpress finds them: a dummy message through the chat template, split at the message (no
        template: no prefix, a newline before the answer)."""
        prefix, suffix = "", "\n"
        if tokenizer.chat_template is not None:
            dummy, separator = "dummy context", "\n" + "#" * len("dummy context")
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": dummy + separator}],
                add_generation_prompt=True,
                tokenize=False,
                enable_thinking=False,
            )
            before, suffix = text.split(separator)
            prefix = before.split(dummy)[0]

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        return cls(encode(prefix), encode(REPEAT_FIRST), encode(REPEAT_NEXT), encode(suffix))

    def forwards(self, context: list[int], chunk_size: int) -> list[tuple[slice, list[int]]]:
        """Each reconstruction forward of ``context``: the slots it repeats and its tokens. The template's prefix is
        skipped where the context starts with it."""
        start = len(self.prefix) if context[: len(self.prefix)] == self.prefix else 0
        length = len(context)
        chunks = [slice(begin, min(begin + chunk_size, length)) for begin in range(start, length, chunk_size)]
        forwards = []
        for index, chunk in enumerate(chunks):
            request = self.first if index == 0 else [*self.next, *context[chunks[index - 1]][-OVERLAP:]]
            forwards.append((chunk, [*request, *self.suffix, *context[chunk]]))
        return forwards


class Stepper(Protocol):
    """What a reconstruction needs of ``kvbench.engine.engine.Engine`` (which imports this module)."""

    def step(self, cache: EvictionCache, token_ids: list[int], start: int, evict: bool | None = None) -> torch.Tensor:
        """One forward over ``token_ids`` at positions ``start..``."""
        ...

    def repeat_prompt(self) -> RepeatPrompt: ...

    def now(self) -> float: ...


def reconstruct(engine: Stepper, caches: list[EvictionCache], context: list[int]) -> None:
    """Score and evict those of ``caches`` (``context`` prefilled into each, by ``engine``'s model) whose policy
    gathers the ``reconstruction`` statistic: one reconstruction per chunk size, sinks and head layout, its time
    shared among the caches it serves (``scoring_seconds``)."""
    groups: dict[tuple[int, int, bool], list[EvictionCache]] = {}
    for cache in caches:
        if cache.policy.statistic == "reconstruction":
            key = (cache.policy.reconstruction_chunk(), cache.policy.reserved_sinks(), cache.repeat_layout)
            groups.setdefault(key, []).append(cache)
    for (chunk_size, _, _), group in groups.items():
        start, lead = engine.now(), group[0]
        for chunk, token_ids in engine.repeat_prompt().forwards(context, chunk_size):
            lead.reconstruct(chunk)
            engine.step(lead, token_ids, len(context), evict=False)
        lead.reconstruct(None)
        received = lead.received()
        for cache in group:
            count_peak(cache, lead)  # as if it had reconstructed the context itself
            cache.evict_reconstructed(received)
        seconds = (engine.now() - start) / len(group)
        for cache in group:
            cache.scoring_seconds = seconds


def count_peak(cache: EvictionCache, other: EvictionCache) -> None:
    """Count ``other``'s peak sizes as ``cache``'s own where they are higher (a reconstruction run once for both,
    which ``cache`` alone would have run the same)."""
    cache.peak_bytes = max(cache.peak_bytes, other.peak_bytes)
    for layer, reconstructed in zip(cache.eviction_layers, other.eviction_layers):
        layer.peak_tokens = max(layer.peak_tokens, reconstructed.peak_tokens)
