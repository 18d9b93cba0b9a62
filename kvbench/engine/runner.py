"""The eviction-aware generation engine: prefill and decode through a budgeted cache.

Regimes:

* ``oneshot``   — prefill the whole prompt, evict every layer to its budget once; decode appends.
* ``chunked``   — prefill in blocks of ``block_size``; evict after each block and every decode step
  (CAOTE's protocol: the live cache never exceeds budget + block).
* ``streaming`` — token by token, evict every step (StreamingLLM's perplexity protocol).

The engine knows nothing about benchmarks: it takes token ids and returns token ids or NLLs.
"""

from __future__ import annotations

import functools
import inspect
import time
from dataclasses import dataclass, field, replace

import torch

from kvbench import kernels
from kvbench.budgets import Budget
from kvbench.engine import attention
from kvbench.engine.batches import RowBatch, SharedPrefill
from kvbench.engine.cache import EvictionCache
from kvbench.engine.calibration import calibrate
from kvbench.engine.kivi import Kivi, quant_model_refusal
from kvbench.engine.reconstruction import RepeatPrompt, reconstruct
from kvbench.engine.refusals import has_learned_sinks, held_windows, model_refusal, settings_refusal
from kvbench.engine.sampling import Sampling
from kvbench.engine.settings import ENGINE_SETTINGS, REGIMES, ROWS_ATTENTION, SUMS_KERNELS, evicts_decoding
from kvbench.engine.sizes import CacheSizes
from kvbench.errors import KVBenchError, choose
from kvbench.policies import channel_pruner
from kvbench.policies.base import Policy
from kvbench.policies.context import LayerWeights
from kvbench.policies.methods.full import Full


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
    context_shared_by: int = 1  # questions or draws answered from one compression (prefill_questions, prefill_draws)
    scoring_seconds: float = 0.0  # of prefill_seconds, the context's reconstruction (KVzip; shared like the prefill)
    #: where the cache evicts while decoding, its bytes after each decode step (R-KV's and the reasoning papers' curve)
    kv_curve: list[int] = field(default_factory=list)


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
    ENGINE_SETTINGS["score_block"].check("engine.score_block", setting)  # however the engine is built
    return int(setting)


def sums_kernel_on(device: torch.device, setting: str = "auto") -> str:
    """The running sums' pass ``setting`` takes on ``device``: ``auto`` is the fused Triton pass on a CUDA device where
    triton is installed (H2O's prefill 1.7× a plain one at 32k on an H200, against 5.2× by blocks:
    docs/benchmarks.md), PyTorch's blocks elsewhere."""
    if setting != "auto":
        return setting
    return "triton" if device.type == "cuda" and kernels.available() else "torch"


def rows_attention_on(device: torch.device, setting: str = "auto") -> str:
    """How a decode step attends its rows on ``device`` under ``setting``: ``auto`` holds them together on a CUDA device
    (``stored``: a step's calls per layer, not per row and layer, where each call is a kernel launch) and attends each
    alone elsewhere (``each``: as fast on a CPU, docs/benchmarks.md, and the reference)."""
    if setting != "auto":
        return setting
    return "stored" if device.type == "cuda" else "each"


def check_sums_kernel(device: torch.device) -> None:
    """``engine.sums_kernel=triton`` needs triton, and a CUDA device or its interpreter (``TRITON_INTERPRET=1``)."""
    if not kernels.available():
        raise KVBenchError(
            "engine.sums_kernel=triton needs triton (pip install triton); valid choices: auto, torch, triton"
        )
    if device.type != "cuda" and not kernels.interpreted():
        raise KVBenchError(
            f"engine.sums_kernel=triton runs on a CUDA device (here {device.type}), or under TRITON_INTERPRET=1; "
            "valid choices: auto, torch, triton"
        )


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
    if shared is None or "layer_type" not in inspect.signature(shared.forward).parameters:
        return [LayerWeights(layer.o_proj.weight, query_heads, shared) for layer in ordered]
    # one embedding of a frequency per layer type (Gemma 3's local and global layers): each layer's own
    return [
        LayerWeights(layer.o_proj.weight, query_heads, functools.partial(shared, layer_type=layer.layer_type))
        for layer in ordered
    ]


def head_dim_of(config) -> int:
    """The channels of one attention head of a model's text ``config``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Runner:
    """Runs a causal LM with ``policy`` keeping ``budget`` tokens per layer under ``regime``: a cache for a prompt,
    its prefill, each step and the measuring; :class:`~kvbench.engine.engine.Engine` adds generation and perplexity
    on it, and the schedulers (:mod:`~kvbench.engine.rows`, :mod:`~kvbench.engine.shared`) run several at once."""

    def __init__(
        self,
        model,
        policy: Policy,
        budget: Budget | str | int,
        regime: str = "oneshot",
        block_size: int = 128,
        decode_evict: bool | None = None,
        decode_interval: int = 1,
        attn_backend: str = "sdpa",
        score_block: int | str | None = "auto",
        record_kept: bool = False,
        tokenizer=None,
        rows_attention: str = "auto",
        sums_kernel: str = "auto",
        sampling: Sampling | None = None,
        quant: Kivi | None = None,
    ):
        choose("engine.regime", regime, REGIMES)
        choose("engine.rows_attention", rows_attention, ROWS_ATTENTION)
        choose("engine.sums_kernel", sums_kernel, SUMS_KERNELS)
        self.model = model
        #: the forward's cache argument: ``cache`` in recent transformers 5 releases, ``past_key_values`` before
        self.cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.policy = policy
        self.budget = budget if isinstance(budget, Budget) else Budget.parse(budget)
        self.regime = regime
        self.block_size = {"oneshot": None, "chunked": block_size, "streaming": 1}[regime]
        self.decode_evict = evicts_decoding(regime, decode_evict)
        #: while decoding, evict after every ``decode_interval``-th token (R-KV's buffer, kvpress's
        #: ``compression_interval``): the cache grows to the budget plus the interval, then back to the budget
        self.decode_interval = decode_interval
        self.attn_backend = attn_backend
        self.score_block = score_block_size(score_block)
        self.record_kept = record_kept
        self.tokenizer = tokenizer
        #: how each row draws its tokens (None: greedily)
        self.sampling = sampling
        #: how the cache holds its entries once the prompt is read (``cache.quant``: KIVI), or None: as the model gives
        self.quant = quant
        self._repeat_prompt: RepeatPrompt | None = None
        config = model.config.get_text_config()
        self.num_layers = config.num_hidden_layers
        self.num_query_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        model.set_attn_implementation(attention.register_attention())
        self.device = next(model.parameters()).device
        self.sums_kernel = sums_kernel_on(self.device, sums_kernel)
        self.rows_attention = rows_attention_on(self.device, rows_attention)
        if self.sums_kernel == "triton":
            check_sums_kernel(self.device)
        if (refusal := quant_model_refusal(quant, head_dim_of(config))) is not None:
            raise KVBenchError(refusal)
        self.layer_weights = layer_weights(model, self.num_query_heads, self.num_layers)
        self.windows = held_windows(config)
        #: the model's softmax adds a learned logit per head (GPT-OSS's ``sinks``, given to attention as ``s_aux``)
        self.learned_sinks = has_learned_sinks(model)
        calibrate(policy, model, tokenizer)  # DuoAttention's head scores, once per model and settings

    def row_bytes(self, prompt_tokens: int, new_tokens: int) -> int:
        """The most memory one row of a ``prompt_tokens`` prompt holds while it decodes ``new_tokens``: the full cache
        of the prompt and its answer in the policy's head layout (no row holds more: CaliDrop's offloaded entries and
        the kept ones together are that), and its float32 logits."""
        held = sum(self.held_tokens(prompt_tokens + new_tokens))
        return held * self.entry_bytes(self.policy) + 4 * self.model.config.get_text_config().vocab_size

    def entry_bytes(self, policy: Policy) -> int:
        """A token's keys and values in one layer of ``policy``'s head layout."""
        config = self.model.config.get_text_config()
        heads = self.num_query_heads if policy.gqa == "repeat" else self.num_kv_heads
        return 2 * heads * head_dim_of(config) * self.element_bytes()

    def budget_tokens(self, policy: Policy, prompt_len: int) -> int:
        """The budget's tokens per layer and cache head for a prompt of ``prompt_len`` tokens; a byte budget's as
        ``policy``'s head layout spends it: a token costs every global layer its entry (quantised, KIVI's levels and
        their share of the groups' steps and minima, beside a residual of full-precision entries; ThinK's keys in their
        channels kept), the sliding layers
        hold their windows whatever the budget (:meth:`Budget.resolve`); a fraction is of the full cache's bytes."""
        if not self.budget.in_bytes:
            return self.budget.resolve(prompt_len)
        entry, globals_ = self.entry_bytes(policy), self.windows.count(None)
        fixed = sum(min(prompt_len, window - 1) for window in self.windows if window is not None) * entry
        full = fixed + entry * globals_ * prompt_len
        if (pruner := channel_pruner(policy)) is not None:  # the prompt's keys in the channels kept (ThinK), and which
            dim = head_dim_of(self.model.config.get_text_config())
            kept = pruner.key_channels(torch.zeros(1, 1, 1, dim), torch.zeros(1, 1, 1, dim)).shape[-1]
            which = globals_ * entry // (2 * dim * self.element_bytes()) * kept * 8  # int64 indices, per cache head
            return self.budget.resolve(prompt_len, entry * (dim + kept) // (2 * dim) * globals_, fixed + which, full)
        if self.quant is None:
            return self.budget.resolve(prompt_len, entry * globals_, fixed, full)
        quantized = entry * self.quant.token_bytes(self.element_bytes()) / self.element_bytes()
        residual = self.quant.residual * (entry - quantized) * globals_  # at most a residual of keys, one of values
        return self.budget.resolve(prompt_len, quantized * globals_, fixed + residual, full)

    def element_bytes(self) -> int:
        """The bytes of one of the model's values (its weights' dtype: its cache's)."""
        return next(self.model.parameters()).element_size()

    def held_tokens(self, tokens: int) -> list[int]:
        """The entries a full cache of ``tokens`` holds per cache head in each layer: a sliding layer its window's last
        ``W - 1`` (:func:`~kvbench.engine.refusals.held_windows`)."""
        return [tokens if window is None else min(tokens, window - 1) for window in self.windows]

    def shares_prefill(self, cache: EvictionCache) -> bool:
        """Whether ``cache`` can take its prefill from one of :func:`generate_shared`'s forwards: oneshot and a prompt
        of more than one token (it shares with the variants of its head layout)."""
        return self.regime == "oneshot" and cache.prompt_len > 1

    def new_cache(self, prompt_len: int, context: bool = False) -> EvictionCache:
        """A cache for a prompt of ``prompt_len`` tokens (``context``: a context, its question read after it is
        compressed); a budget ≥ the prompt means no eviction. Dynamic layer budgets (``cake``, ``vabs``) start
        uniform and are re-allocated by the cache during prefill. A policy not defined here is a one-line error."""
        refusal = settings_refusal(self.policy, self.regime, context, self.decode_evict, self.quant)
        if (refusal := refusal or self.model_refusal(self.policy)) is not None:
            raise KVBenchError(refusal)
        budget = self.budget_tokens(self.policy, prompt_len)
        policy = self.policy if self.policy.compresses(budget, prompt_len) else Full(gqa=self.policy.gqa)
        policy.check_budget(budget, prompt_len)
        budgets = self.layer_budgets(policy, budget, prompt_len)
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
            sums_kernel=self.sums_kernel,
            windows=self.windows,
            learned_sinks=self.learned_sinks,
            quant=self.quant,
        )

    def model_refusal(self, policy: Policy) -> str | None:
        """Why ``policy`` is not defined on this model (:func:`model_refusal`), or None."""
        return model_refusal(policy, self.windows, self.learned_sinks)

    def layer_budgets(self, policy: Policy, budget: int, prompt_len: int) -> list[int]:
        """Each layer's budget: the policy's allocation over the global layers, a sliding layer its window's ``W - 1``
        tokens (:func:`~kvbench.engine.refusals.held_windows`)."""
        reserved = policy.reserved(budget, prompt_len)
        shares = iter(policy.layer_budget.allocate(budget, self.windows.count(None), reserved, prompt_len))
        return [next(shares) if window is None else window - 1 for window in self.windows]

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
        """``after_prefill`` (:meth:`EvictionCache.sizes_now` then) with the peaks and the full cache's bytes (the
        model's own: a sliding layer's window)."""
        full_bytes = sum(
            2 * self.num_kv_heads * layer.keys.shape[-1] * layer.keys.element_size() * held
            for layer, held in zip(cache.eviction_layers, self.held_tokens(total_tokens))
        )
        return replace(
            after_prefill,
            peak_tokens_per_layer=[layer.peak_tokens for layer in cache.eviction_layers],
            peak_bytes=cache.peak_bytes,
            full_bytes=full_bytes,
        )

    def now(self) -> float:
        """The time, once the device has finished what it was given (a timing's end or start)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()
