"""The eviction-aware generation engine: prefill and decode through a budgeted cache (:class:`Engine`).

Regimes:

* ``oneshot``   — prefill the whole prompt, evict every layer to its budget once; decode appends.
* ``chunked``   — prefill in blocks of ``block_size``; evict after each block and every decode step
  (CAOTE's protocol: the live cache never exceeds budget + block).
* ``streaming`` — token by token, evict every step (StreamingLLM's perplexity protocol).

The engine knows nothing about benchmarks: it takes token ids and returns token ids or NLLs. Its parts: the runner
(a cache, a prefill, a step: :mod:`~kvbench.engine.runner`), the rows that decode together (:mod:`~kvbench.engine.rows`)
and the shared prefills and questions (:mod:`~kvbench.engine.shared`).
"""

from __future__ import annotations

import torch

from kvbench.engine.rows import Row, decode_rows, perplexity_rows
from kvbench.engine.runner import GenerationOutput, PerplexityOutput, Runner
from kvbench.engine.shared import read_question


class Engine(Runner):
    """A :class:`~kvbench.engine.runner.Runner` that generates and scores text, one prompt at a time."""

    @torch.inference_mode()
    def generate(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        stop_token_ids=(),
        min_new_tokens: int = 0,
        question_start: int | None = None,
    ) -> GenerationOutput:
        """Greedy decoding of up to ``max_new_tokens`` after the prompt; stops at any of ``stop_token_ids``, which
        cannot be chosen among the first ``min_new_tokens`` (Hugging Face's ``min_length``: their logits are
        masked, the best other token is taken). ``question_start``: query-agnostic (:meth:`prefilled_row`)."""
        row = self.prefilled_row(input_ids, max_new_tokens, stop_token_ids, min_new_tokens, question_start)
        return decode_rows([row], 1)[0]

    @torch.inference_mode()
    def prefilled_row(
        self,
        input_ids: list[int],
        max_new_tokens: int,
        stop_token_ids=(),
        min_new_tokens: int = 0,
        question_start: int | None = None,
    ) -> Row:
        """:meth:`generate`'s prompt prefilled into a new cache under the regime: a row for :func:`decode_rows`.
        With ``question_start`` the context ``input_ids[:question_start]`` alone is prefilled and evicted (the budget
        a share of it), then the question is read without evicting (:func:`read_question`)."""
        context = input_ids[:question_start]
        cache = self.new_cache(len(context), question_start is not None)
        start = self.now()
        logits = self.prefill(cache, context)[0, -1]
        row = Row(self, cache, logits, len(input_ids), max_new_tokens, stop_token_ids, min_new_tokens)
        row.prefill_seconds, row.scoring_seconds = self.now() - start, cache.scoring_seconds
        if question_start is not None:
            read_question([row], input_ids, question_start, 1)
        return row

    @torch.inference_mode()
    def perplexity(self, input_ids: list[int], context_tokens: int = 0) -> PerplexityOutput:
        """Per-token NLLs of ``input_ids[context_tokens+1:]`` (all but the first token when 0).

        The first ``context_tokens`` are prefilled under the regime (oneshot: one block, then evict);
        the rest are fed in blocks (chunked) or one at a time (oneshot, streaming), evicting as in decode.
        """
        return perplexity_rows([self], input_ids, context_tokens)[0]
