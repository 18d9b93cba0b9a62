"""The eviction-aware generation engine: prefill and decode through a budgeted cache.

Regimes:

* ``oneshot``   — prefill the whole prompt, evict every layer to its budget once; decode appends.
* ``chunked``   — prefill in blocks of ``block_size``; evict after each block and every decode step
  (CAOTE's protocol: the live cache never exceeds budget + block).
* ``streaming`` — token by token, evict every step (StreamingLLM's perplexity protocol).

The engine knows nothing about benchmarks: it takes token ids and returns token ids or NLLs.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from kvbench.domains import FLAG, Domain, choice, integer, is_int, optional
from kvbench.engine import attention
from kvbench.engine.cache import CacheSizes, EvictionCache, RowBatch, SharedPrefill, prefill_key
from kvbench.engine.memory import free_memory
from kvbench.engine.reconstruction import RepeatPrompt, reconstruct
from kvbench.engine.threads import THREADS
from kvbench.errors import KVBenchError, choose
from kvbench.policies.base import Full, LayerWeights, Policy
from kvbench.policies.budgets import Budget

REGIMES = ["oneshot", "chunked", "streaming"]


def evicts_decoding(regime: str, decode_evict: bool | None) -> bool:
    """Whether the cache evicts while it decodes: ``engine.decode_evict``, by default every regime but oneshot."""
    return regime != "oneshot" if decode_evict is None else decode_evict


#: ``engine.batch_size=auto``: the rows' caches take at most this share of the free memory, and at most
#: ``AUTO_MAX_ROWS`` rows decode together (:func:`batch_rows`; more rows held at once, of several samples of a group,
#: were slower here: 51 s against 45 s for the 18-job grid of the README)
AUTO_MEMORY_SHARE = 0.5
AUTO_MAX_ROWS = 32

#: the engine settings (``engine.<key>``, defaults in conf/config.yaml) and their domains
ENGINE_SETTINGS: dict[str, Domain] = {
    "regime": choice(*REGIMES),
    "block_size": integer(1, "a token count"),
    "decode_evict": optional(FLAG, "the regime's: false for oneshot, true for chunked and streaming"),
    "score_block": Domain("auto or a query count ≥ 1", lambda value: value == "auto" or (is_int(value) and value >= 1)),
    "save_kept": FLAG,
    "batch_size": Domain("auto or a row count ≥ 1", lambda value: value == "auto" or (is_int(value) and value >= 1)),
    "threads": THREADS,
}


@dataclass
class GenerationOutput:
    """``policy_stats``: per-sample statistics of the policy (``EvictionCache.policy_stats``), e.g.
    CaliDrop's ``recompute_rate`` or the CAKE / VABS ``layer_preference``; empty for most policies.
    ``kept``: with ``Engine(record_kept=True)``, the positions each layer and cache head holds after prefill,
    ``kept[layer][head]`` sorted (per query head in the KV-repeated layout)."""

    token_ids: list[int]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    kv: CacheSizes = field(default_factory=CacheSizes)
    policy_stats: dict = field(default_factory=dict)
    kept: list[list[list[int]]] | None = None
    prefill_shared_by: int = 1  # variants whose prefill was one forward (generate_shared): prefill_seconds is a share
    context_shared_by: int = 1  # questions answered from one compression of their context (prefill_questions)
    scoring_seconds: float = 0.0  # of prefill_seconds, the context's reconstruction (KVzip; shared like the prefill)


@dataclass
class PerplexityOutput:
    nlls: list[float]
    prefill_seconds: float
    decode_seconds: float
    kv: CacheSizes = field(default_factory=CacheSizes)
    policy_stats: dict = field(default_factory=dict)


def score_block_size(setting: int | str | None) -> int | None:
    """``engine.score_block``: queries per block of attention statistics, or ``auto``/``None`` (128 on CPU,
    sized by memory on an accelerator: ``AttentionStats.block_queries``)."""
    if setting is None or setting == "auto":
        return None
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
        raise KVBenchError(f"engine.score_block must be a positive number of queries or auto, got {setting!r}")
    return setting


def layer_weights(model, query_heads: int, num_layers: int) -> list[LayerWeights] | None:
    """Each attention layer's weights that a score may read, in layer order: its modules with an output projection
    (``o_proj``, the Llama/Qwen2/Mistral layout) and a ``layer_idx``, and the model's rotary embedding where it has
    one (``rotary_emb``); None for a model laid out otherwise."""
    layers = [module for module in model.modules() if hasattr(module, "o_proj") and hasattr(module, "layer_idx")]
    if len(layers) != num_layers:
        return None
    rotary = [module for name, module in model.named_modules() if name.endswith("rotary_emb")]
    shared = rotary[0] if len(rotary) == 1 else None
    ordered = sorted(layers, key=lambda m: m.layer_idx)
    return [LayerWeights(layer.o_proj.weight, query_heads, shared) for layer in ordered]


class Engine:
    """Runs a causal LM with ``policy`` keeping ``budget`` tokens per layer under ``regime``."""

    def __init__(
        self,
        model,
        policy: Policy,
        budget: Budget | str | int,
        regime: str = "oneshot",
        block_size: int = 128,
        decode_evict: bool | None = None,
        attn_backend: str = "sdpa",
        score_block: int | str | None = "auto",
        record_kept: bool = False,
        tokenizer=None,
    ):
        choose("engine.regime", regime, REGIMES)
        self.model = model
        #: the forward's cache argument: ``cache`` in recent transformers 5 releases, ``past_key_values`` before
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.policy = policy
        self.budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
        self.regime = regime
        self.block_size = {"oneshot": None, "chunked": block_size, "streaming": 1}[regime]
        self.decode_evict = evicts_decoding(regime, decode_evict)
        self.attn_backend = attn_backend
        self.score_block = score_block_size(score_block)
        self.record_kept = record_kept
        self.tokenizer = tokenizer
        self._repeat_prompt: RepeatPrompt | None = None
        config = model.config.get_text_config()
        self.num_layers = config.num_hidden_layers
        self.num_query_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        model.set_attn_implementation(attention.register())
        self.device = next(model.parameters()).device
        self.layer_weights = layer_weights(model, self.num_query_heads, self.num_layers)

    # -- public API ----------------------------------------------------------------------------------
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

    def row_bytes(self, prompt_tokens: int, new_tokens: int) -> int:
        """The most memory one row of a ``prompt_tokens`` prompt holds while it decodes ``new_tokens``: the full cache
        of the prompt and its answer in the policy's head layout (no row holds more: CaliDrop's offloaded entries and
        the kept ones together are that), and its float32 logits."""
        config = self.model.config.get_text_config()
        heads = self.num_query_heads if self.policy.gqa == "repeat" else self.num_kv_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        element = next(self.model.parameters()).element_size()
        per_token = 2 * self.num_layers * heads * head_dim * element
        return (prompt_tokens + new_tokens) * per_token + 4 * config.vocab_size

    def shares_prefill(self, cache: EvictionCache) -> bool:
        """Whether ``cache`` can take its prefill from one of :func:`generate_shared`'s forwards: oneshot and a prompt
        of more than one token (it shares with the variants of its head layout)."""
        return self.regime == "oneshot" and cache.prompt_len > 1

    @torch.inference_mode()
    def perplexity(self, input_ids: list[int], context_tokens: int = 0) -> PerplexityOutput:
        """Per-token NLLs of ``input_ids[context_tokens+1:]`` (all but the first token when 0).

        The first ``context_tokens`` are prefilled under the regime (oneshot: one block, then evict);
        the rest are fed in blocks (chunked) or one at a time (oneshot, streaming), evicting as in decode.
        """
        return perplexity_rows([self], input_ids, context_tokens)[0]

    def new_cache(self, prompt_len: int, context: bool = False) -> EvictionCache:
        """A cache for a prompt of ``prompt_len`` tokens (``context``: a context, its question read after it is
        compressed); a budget ≥ the prompt means no eviction. Dynamic layer budgets (``cake``, ``vabs``) start
        uniform and are re-allocated by the cache during prefill. A policy not defined here is a one-line error."""
        refusal = self.policy.refusal(self.regime, context, self.decode_evict)
        if refusal is not None:
            raise KVBenchError(refusal)
        budget = self.budget.resolve(prompt_len)
        policy = self.policy if self.policy.compresses(budget, prompt_len) else Full(gqa=self.policy.gqa)
        policy.check_budget(budget, prompt_len)
        budgets = policy.layer_budget.allocate(budget, self.num_layers, policy.reserved(budget, prompt_len), prompt_len)
        return EvictionCache(
            policy,
            budgets,
            prompt_len,
            self.num_query_heads,
            self.num_kv_heads,
            self.attn_backend,
            self.score_block,
            decode_evict=self.decode_evict,
            layer_weights=self.layer_weights,
        )

    @torch.inference_mode()
    def prefill(self, cache: EvictionCache | SharedPrefill, input_ids: list[int]) -> torch.Tensor:
        """Feed the prompt into ``cache`` under the regime (one block, or blocks of ``block_size`` /
        single tokens), evicting after each (a policy scoring by reconstruction: once it is reconstructed,
        :func:`reconstruct`); returns the last forward's logits ``[1,1,V]``."""
        block = self.block_size or len(input_ids)
        for begin in range(0, len(input_ids), block):
            logits = self.step(cache, input_ids[begin : begin + block], begin, evict=True)
        reconstruct(self, cache.caches if isinstance(cache, SharedPrefill) else [cache], input_ids)
        return logits

    @torch.inference_mode()
    def step(
        self,
        cache: EvictionCache | SharedPrefill,
        token_ids: list[int],
        start: int,
        evict: bool | None = None,
        all_logits: bool = False,
    ) -> torch.Tensor:
        """One model forward over ``token_ids`` at absolute positions ``start..`` (``evict``: whether the cache
        evicts after it; default the regime's decode setting); returns the logits ``[1,q|1,V]``."""
        evict = self.decode_evict if evict is None else evict
        positions = torch.arange(start, start + len(token_ids), device=self.device)
        cache.begin_forward(positions, evict=evict, decoding=start >= cache.prompt_len)
        return self.forward(cache, torch.tensor([token_ids], device=self.device), positions[None], all_logits)

    def forward(
        self,
        cache: EvictionCache | SharedPrefill | RowBatch,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        all_logits: bool,
    ) -> torch.Tensor:
        """The model over ``input_ids [N,q]`` at ``positions [N,q]`` through ``cache`` (its forward declared):
        the logits ``[N,q|1,V]``."""
        output = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
            kvbench_cache=cache,
            **{self.cache_argument: cache},
        )
        return output.logits

    def repeat_prompt(self) -> RepeatPrompt:
        """The reconstruction forwards' token pieces for the model's tokenizer (the ``reconstruction`` statistic)."""
        if self._repeat_prompt is None:
            if self.tokenizer is None:
                raise KVBenchError(f"policy {self.policy.spec} repeats the context: the engine needs the tokenizer")
            self._repeat_prompt = RepeatPrompt.of(self.tokenizer)
        return self._repeat_prompt

    # -- measuring, for the engine and the schedulers that run it (rows, shared prefills, questions) -----------
    @staticmethod
    def nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Each token's negative log-likelihood ``[N]`` from ``logits [N,V]`` (float32) and ``targets [N]``."""
        return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")

    def cache_sizes(self, cache: EvictionCache, after_prefill: CacheSizes, total_tokens: int) -> CacheSizes:
        """``after_prefill`` (:meth:`EvictionCache.sizes_now` then) with the peaks and the full cache's bytes."""
        bytes_per_token = sum(
            2 * self.num_kv_heads * layer.keys.shape[-1] * layer.keys.element_size() for layer in cache.eviction_layers
        )
        return replace(
            after_prefill,
            peak_tokens_per_layer=[layer.peak_tokens for layer in cache.eviction_layers],
            peak_bytes=cache.peak_bytes,
            full_bytes=bytes_per_token * total_tokens,
        )

    def now(self) -> float:
        """The time, once the device has finished what it was given (a timing's end or start)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


@torch.inference_mode()
def generate_shared(
    engines: list[Engine],
    input_ids: list[int],
    max_new_tokens: int,
    stop_token_ids=(),
    min_new_tokens: int = 0,
    batch_size: int = 1,
    question_start: int | None = None,
) -> list[GenerationOutput]:
    """:meth:`Engine.generate` of each engine (its own policy and budget; one model, one regime) on one prompt,
    the variants that :meth:`Engine.shares_prefill` prefilled by one forward (:class:`SharedPrefill`) per head
    layout (:func:`~kvbench.engine.cache.prefill_key`), whatever their policies and budgets, the others (chunked,
    streaming) feeding the prompt's blocks as rows; then the variants decode as rows, ``batch_size`` at a time
    (:func:`decode_rows`). Each output reports the shared prefill's time divided among the variants that shared it.
    Outputs equal :meth:`Engine.generate`'s."""
    rows = prefill_shared(
        engines, input_ids, max_new_tokens, stop_token_ids, min_new_tokens, batch_size, question_start
    )
    return decode_rows(rows, batch_size)


def prefill_shared(
    engines: list[Engine],
    input_ids: list[int],
    max_new_tokens: int,
    stop_token_ids=(),
    min_new_tokens: int = 0,
    batch_size: int = 1,
    question_start: int | None = None,
) -> list[Row]:
    """The prefilled rows of :func:`generate_shared`, one per engine, ready for :func:`decode_rows`; the variants
    that do not share a forward (chunked, streaming) feed the prompt's blocks as rows, ``batch_size`` at a time.
    With ``question_start``, what is prefilled is the context ``input_ids[:question_start]``, and then every row
    reads the question without evicting (:func:`prefill_questions` of one question)."""
    if question_start is not None:
        question = Question(input_ids, question_start, max_new_tokens, stop_token_ids, min_new_tokens)
        return prefill_questions(engines, [question], batch_size)
    rows = compressed_rows(engines, input_ids, batch_size, context=False)
    for row in rows:
        row.max_new_tokens, row.stop_token_ids, row.min_new_tokens = max_new_tokens, stop_token_ids, min_new_tokens
    return rows


@dataclass(frozen=True)
class Question:
    """A prompt answered from a compressed context: ``input_ids[:question_start]`` the context, the rest the question,
    decoded as :meth:`Engine.generate` decodes."""

    input_ids: list[int]
    question_start: int
    max_new_tokens: int
    stop_token_ids: Sequence[int] = ()
    min_new_tokens: int = 0

    @property
    def context(self) -> list[int]:
        return self.input_ids[: self.question_start]


def prefill_questions(engines: list[Engine], questions: Sequence[Question], batch_size: int = 1) -> list[Row]:
    """Rows of every (question, engine), question by question: the context the ``questions`` share compressed once
    per engine (:func:`compressed_rows`), then each question read into its own copy of each engine's compressed cache
    (:func:`read_question`), so each answers from the context as if it were the only one; the compression's time is
    divided among the questions (``Row.context_shared_by``)."""
    context = questions[0].context
    if any(question.context != context for question in questions):
        raise ValueError("questions answered from one compressed context must share its tokens")
    compressed = compressed_rows(engines, context, batch_size)
    rows: list[Row] = []
    for number, question in enumerate(questions):
        asked = [
            replace(
                row,
                cache=row.cache if number == len(questions) - 1 else copy.deepcopy(row.cache),
                prompt_tokens=len(question.input_ids),
                max_new_tokens=question.max_new_tokens,
                stop_token_ids=question.stop_token_ids,
                min_new_tokens=question.min_new_tokens,
                prefill_seconds=row.prefill_seconds / len(questions),
                scoring_seconds=row.scoring_seconds / len(questions),
                context_shared_by=len(questions),
                generated=[],
            )
            for row in compressed
        ]
        read_question(asked, question.input_ids, question.question_start, batch_size)
        rows += asked
    return rows


def compressed_rows(engines: list[Engine], prompt: list[int], batch_size: int, context: bool = True) -> list[Row]:
    """Each engine's ``prompt`` (``context``: a context, as :meth:`Engine.new_cache`) prefilled and evicted under its
    regime into a new cache, as a row (its decoding settings left to the caller): the variants that
    :meth:`Engine.shares_prefill` by one forward per head layout, the others feeding the prompt's blocks as rows,
    ``batch_size`` at a time; then the contexts that a reconstruction scores (:func:`reconstruct`)."""
    rows = [Row(engine, engine.new_cache(len(prompt), context), torch.empty(0), len(prompt), 0) for engine in engines]
    sharing: dict[bool, list[Row]] = {}  # prefill_key -> the variants of one forward
    alone = []  # the variants that feed their prompt in blocks (chunked, streaming): in lockstep, as rows
    for index, row in enumerate(rows):
        if row.engine.shares_prefill(row.cache):
            sharing.setdefault(prefill_key(row.cache.policy), []).append(row)
        else:
            alone.append(index)
    for indices in lockstep_groups(engines, alone, batch_size):
        lockstep = [rows[index] for index in indices]
        start = engines[indices[0]].now()
        logits = prefill_rows([row.engine for row in lockstep], [row.cache for row in lockstep], prompt)
        seconds = (engines[indices[0]].now() - start) / len(lockstep)
        for row, last in zip(lockstep, logits):
            row.logits, row.prefill_seconds = last[-1], seconds
    for group in sharing.values():
        lead = group[0].engine
        start = lead.now()
        shared = lead.prefill(SharedPrefill([row.cache for row in group]), prompt)[0, -1]
        seconds = (lead.now() - start) / len(group)
        for row in group:
            row.logits, row.prefill_seconds, row.prefill_shared_by = shared, seconds, len(group)
            row.scoring_seconds = row.cache.scoring_seconds
    return rows


def read_question(rows: list[Row], input_ids: list[int], question_start: int, batch_size: int) -> None:
    """Query-agnostic: each row reads its prompt's question ``input_ids[question_start:]`` into the cache its context
    was compressed into, at the question's own positions and without evicting, ``batch_size`` rows a forward; the
    question's last logits become the row's, its time is added to the row's prefill."""
    question = input_ids[question_start:]
    for begin in range(0, len(rows), batch_size):
        group = rows[begin : begin + batch_size]
        lead = group[0].engine
        start = lead.now()
        caches, count = [row.cache for row in group], len(group)
        logits = forward_rows(lead, caches, [question] * count, [question_start] * count, [False] * count)
        seconds = (lead.now() - start) / count
        for row, last in zip(group, logits):
            row.logits, row.prefill_seconds = last[-1], row.prefill_seconds + seconds


@dataclass
class Row:
    """One (sample, variant) to decode greedily: its engine (model, policy, budget, regime), prefilled cache and the
    prompt's last logits ``[V]``; up to ``max_new_tokens``, stopping at any of ``stop_token_ids`` once
    ``min_new_tokens`` are generated (:meth:`Engine.generate`)."""

    engine: Engine
    cache: EvictionCache
    logits: torch.Tensor  # [V]
    prompt_tokens: int
    max_new_tokens: int
    stop_token_ids: Sequence[int] = ()
    min_new_tokens: int = 0
    prefill_seconds: float = 0.0
    prefill_shared_by: int = 1
    context_shared_by: int = 1  # questions answered from one compression of the context (prefill_questions)
    scoring_seconds: float = 0.0  # of prefill_seconds, the context's reconstruction
    generated: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0

    def next_token(self) -> int | None:
        """The greedy choice from the row's logits, or None when the row is done (a stop token, or its last)."""
        if len(self.generated) >= self.max_new_tokens:
            return None
        scores = self.logits
        stop = self.stop_token_ids
        if len(self.generated) < self.min_new_tokens and len(stop):
            banned = torch.tensor(sorted(set(stop)), dtype=torch.long, device=scores.device)
            scores = scores.index_fill(0, banned, float("-inf"))
        token = int(scores.argmax())
        if token in stop:
            return None
        self.generated.append(token)
        return None if len(self.generated) == self.max_new_tokens else token


@torch.inference_mode()
def decode_rows(rows: list[Row], batch_size: int) -> list[GenerationOutput]:
    """:func:`finished_rows`' outputs in the order of ``rows``; one row at a time gives :meth:`Engine.generate`'s."""
    return [output for _, output in sorted(finished_rows(rows, batch_size), key=lambda finished: finished[0])]


def finished_rows(rows: list[Row], batch_size: int) -> Iterator[tuple[int, GenerationOutput]]:
    """Greedy decoding of ``rows`` (one model), up to ``batch_size`` at a time: every step feeds each active row's
    token at its own position through one forward of the model over a :class:`RowBatch`, where each row's cache
    attends, scores and evicts as alone (its engine's ``decode_evict``); a finished row leaves the batch, is yielded
    as ``(its index in rows, its output)``, and the next waiting row takes its place. Each row is charged its share of
    the steps it was in."""
    after_prefill = [row.cache.sizes_now() for row in rows]
    kept = [row.cache.kept_by_head() if row.engine.record_kept else None for row in rows]

    def output(index: int) -> tuple[int, GenerationOutput]:
        row = rows[index]
        kv = row.engine.cache_sizes(row.cache, after_prefill[index], row.prompt_tokens + len(row.generated))
        stats = row.cache.policy_stats()
        finished = GenerationOutput(
            row.generated, row.prompt_tokens, row.prefill_seconds, row.decode_seconds, kv, stats, kept[index]
        )
        finished.prefill_shared_by, finished.context_shared_by = row.prefill_shared_by, row.context_shared_by
        finished.scoring_seconds = row.scoring_seconds
        return index, finished

    waiting, active = deque(range(len(rows))), list[int]()
    lead = rows[0].engine if rows else None
    while lead is not None and (waiting or active):
        start = lead.now()
        stepping: list[tuple[int, int]] = []  # (row index, its next token)
        done: list[int] = []
        for index in active:
            if (token := rows[index].next_token()) is None:
                done.append(index)
            else:
                stepping.append((index, token))
        while waiting and len(stepping) < batch_size:  # waiting rows take the places of finished ones
            index = waiting.popleft()
            if (token := rows[index].next_token()) is None:
                done.append(index)
            else:
                stepping.append((index, token))
        if stepping:
            logits = step_rows([(rows[index], token) for index, token in stepping])  # [N,V]
            for place, (index, _) in enumerate(stepping):
                rows[index].logits = logits[place]
        active = [index for index, _ in stepping]
        share = (lead.now() - start) / max(len(stepping), 1)
        for index in active:
            rows[index].decode_seconds += share
        for index in done:
            yield output(index)


def step_rows(stepping: list[tuple[Row, int]]) -> torch.Tensor:
    """One forward of each row's next token at its position (the prompt's length plus what it generated before),
    evicting as its engine decodes; returns the logits ``[N,V]``."""
    rows = [row for row, _ in stepping]
    positions = [row.prompt_tokens + len(row.generated) - 1 for row in rows]
    evicts = [row.engine.decode_evict for row in rows]
    logits = forward_rows(rows[0].engine, [row.cache for row in rows], [[t] for _, t in stepping], positions, evicts)
    return logits[:, -1]


def forward_rows(
    lead: Engine,
    caches: list[EvictionCache],
    token_ids: list[list[int]],
    starts: list[int],
    evicts: list[bool],
    all_logits: bool = False,
) -> torch.Tensor:
    """One forward of ``lead``'s model over rows of as many tokens each, row ``r``'s ``token_ids[r]`` at positions
    ``starts[r]..`` into ``caches[r]``, which evicts after it if ``evicts[r]``: through a :class:`RowBatch`, each
    cache as :meth:`Engine.step` feeds it alone. Returns the logits ``[N,q|1,V]``."""
    length = len(token_ids[0])
    positions = torch.tensor([[start + offset for offset in range(length)] for start in starts], device=lead.device)
    for cache, where, evict in zip(caches, positions, evicts):
        cache.begin_forward(where, evict=evict, decoding=int(where[0]) >= cache.prompt_len)
    return lead.forward(RowBatch(caches), torch.tensor(token_ids, device=lead.device), positions, all_logits)


def prefill_rows(engines: list[Engine], caches: list[EvictionCache], input_ids: list[int]) -> torch.Tensor:
    """:meth:`Engine.prefill` of one prompt into each of ``caches``, the engines of one regime and block size feeding
    each block to every row in one forward (each cache evicting after it as alone); the last logits ``[N,1,V]``."""
    block = engines[0].block_size or len(input_ids)
    count = len(caches)
    for begin in range(0, len(input_ids), block):
        ids = input_ids[begin : begin + block]
        logits = forward_rows(engines[0], caches, [ids] * count, [begin] * count, [True] * count)
    return logits


def lockstep_groups(engines: Sequence[Engine], indices: Sequence[int], batch_size: int) -> list[list[int]]:
    """``indices`` of ``engines`` in groups that can feed one text in lockstep: one regime and block size, at most
    ``batch_size`` rows."""
    by_block: dict[tuple[str, int | None], list[int]] = {}
    for index in indices:
        by_block.setdefault((engines[index].regime, engines[index].block_size), []).append(index)
    return [
        group[begin : begin + batch_size] for group in by_block.values() for begin in range(0, len(group), batch_size)
    ]


@torch.inference_mode()
def perplexity_rows(
    engines: list[Engine], input_ids: list[int], context_tokens: int = 0, batch_size: int = 1
) -> list[PerplexityOutput]:
    """:meth:`Engine.perplexity` of each engine on one text, up to ``batch_size`` engines of one regime and block
    size feeding it together (:func:`forward_rows`: each block one forward for all their rows). Outputs in the order
    of ``engines``, each reporting its share of the forwards."""
    outputs: list[PerplexityOutput | None] = [None] * len(engines)
    for group in lockstep_groups(engines, range(len(engines)), batch_size):
        for index, output in zip(group, _perplexity_together([engines[i] for i in group], input_ids, context_tokens)):
            outputs[index] = output
    return [output for output in outputs if output is not None]


def _perplexity_together(engines: list[Engine], input_ids: list[int], context_tokens: int) -> list[PerplexityOutput]:
    """:func:`perplexity_rows` of engines of one regime and block size, all together."""
    lead, count = engines[0], len(engines)
    caches = [engine.new_cache(max(context_tokens, 1) if context_tokens else len(input_ids)) for engine in engines]
    context_tokens = max(context_tokens, 1)
    start = lead.now()
    logits = prefill_rows(engines, caches, input_ids[:context_tokens])
    prefill_seconds = (lead.now() - start) / count
    after_prefill = [cache.sizes_now() for cache in caches]
    start = lead.now()
    nlls: list[list[torch.Tensor]] = [[] for _ in engines]
    step = lead.block_size if lead.regime == "chunked" else 1
    assert step is not None  # the chunked regime always has a block size
    targets = torch.tensor(input_ids, device=lead.device)
    evicts = [engine.decode_evict for engine in engines]
    for begin in range(context_tokens, len(input_ids), step):
        block = input_ids[begin : begin + step]
        for row in range(count):
            nlls[row].append(Engine.nll(logits[row, -1:], targets[begin : begin + 1]))
        if len(block) == 1 and begin == len(input_ids) - 1:
            break
        logits = forward_rows(lead, caches, [block] * count, [begin] * count, evicts, all_logits=len(block) > 1)
        for row in range(count):
            nlls[row].append(Engine.nll(logits[row, :-1], targets[begin + 1 : begin + len(block)]))
    decode_seconds = (lead.now() - start) / count
    outputs = []
    for engine, cache, sizes, values in zip(engines, caches, after_prefill, nlls):
        kv = engine.cache_sizes(cache, sizes, len(input_ids))
        nll = torch.cat(values).tolist() if values else []
        outputs.append(PerplexityOutput(nll, prefill_seconds, decode_seconds, kv, cache.policy_stats()))
    return outputs


def batch_rows(setting: int | str, engines: Sequence[Engine], prompt_tokens: int, new_tokens: int) -> int:
    """``engine.batch_size``: how many rows decode together — the number given, or for ``auto`` as many of the heaviest
    engine's rows of a ``prompt_tokens`` prompt generating ``new_tokens`` (:meth:`Engine.row_bytes`) as
    ``AUTO_MEMORY_SHARE`` of the free memory holds, at least 1 and at most ``AUTO_MAX_ROWS``."""
    if setting != "auto":
        return int(setting)
    heaviest = max(engine.row_bytes(prompt_tokens, new_tokens) for engine in engines)
    fits = int(AUTO_MEMORY_SHARE * free_memory(engines[0].device)) // heaviest
    return max(1, min(AUTO_MAX_ROWS, fits))
