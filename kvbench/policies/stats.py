"""Attention statistics a policy scores from: :class:`AttentionStats` (float32 attention of a window of queries
over the cache, built block by block) and the column sums of causal attention from its per-query normaliser
(H2O eq. 2; OBCache eqs. 4–6), below.

Accumulating policies (H2O, and ``h2o+obcache_*`` over every query) add ``Σ_i f(A_ip, Z_ip, o_i)`` over all
queries of every forward. Given the per-query log-sum-exp ``lse_i = log Σ_p exp Z_ip``, the weights are
``A_ip = exp(Z_ip − lse_i)``: no softmax, no second attention output, one pass of ``Q·Kᵀ`` over causal
query blocks (each block reads only the slots its queries see and masks only its diagonal square). The
logits come from the compute dtype with float32 accumulation; sums are float32.

The attention outputs ``o_i`` are the backend's (the pass never attends: every variant of a prompt reads one
forward's attention, whatever it scores). The normaliser has two sources (``NormalisedStats.lse``):

* a fused attention kernel (``kvbench.engine.attention.attention_with_lse``): the pass adds one ``Q·Kᵀ`` and
  one exponential (on an accelerator, where fused kernels are far faster than unfused ops);
* the block itself (``lse=None``): a block's row of logits is complete, so its softmax normalises it (on CPU,
  where a second attention call costs more than the block's own reductions).

The queries are the last ``q`` slots of the cache, bottom-right causal as in ``kvbench.engine.attention``:
query ``i`` of the forward sees slots ``0 .. T−q+i``. Shapes: B batch, Hq query heads, Hc cache heads
(``Hq = Hc·G``), M = G·w rows of a block of w queries (query head-major), T_b the slots the block sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import torch

#: float32 elements of one block of attention statistics on an accelerator (1 GiB)
BLOCK_ELEMENTS = 2**28
#: queries per block on CPU: a block's float32 [M,T] tiles stay near the core's cache
CPU_BLOCK_QUERIES = 32
LOG2E = 1.0 / math.log(2.0)


def float32_logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float, shift: torch.Tensor | None = None):
    """``scaling·q_i·k_p − shift_i`` in float32 from compute-dtype ``queries [B,Hc,M,D]`` and ``keys [B,Hc,T,D]``
    (``shift [B,Hc,M,1]`` or None): ``[B,Hc,M,T]``. CUDA multiplies 16-bit inputs with float32 output;
    elsewhere the inputs are taken to float32 (a no-op for float32 models)."""
    batch, heads, rows, dim = queries.shape
    left = queries.reshape(batch * heads, rows, dim)
    right = keys.reshape(batch * heads, keys.shape[2], dim).transpose(1, 2)
    bias = None if shift is None else shift.reshape(batch * heads, rows, 1)
    if left.dtype != torch.float32 and left.device.type == "cuda":
        logits = torch.bmm(left, right, out_dtype=torch.float32).mul_(scaling)
        logits = logits if bias is None else logits.sub_(bias)
    elif bias is None:
        logits = torch.bmm(left.float() * scaling, right.float())
    else:
        logits = torch.baddbmm(bias.neg(), left.float(), right.float(), alpha=scaling)
    return logits.view(batch, heads, rows, -1)


@dataclass
class NormalisedBlock:
    """``w`` queries of every query head of a forward over the ``T_b`` slots they see (see the module doc).

    ``queries [B,Hc,M,D]``, ``keys``/``values [B,Hc,T_b,D]``, ``lse [B,Hc,M,1]`` float32 or None (then the
    block normalises itself), the attention ``outputs [B,Hc,M,D]``, ``causal [M,w]``:
    True where a row must not see one of the last ``w`` slots (None for a single query); ``stats`` the pass
    it belongs to."""

    stats: NormalisedStats
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float
    lse: torch.Tensor | None
    outputs: torch.Tensor
    causal: torch.Tensor | None

    def _masked(self, tile: torch.Tensor, value: float) -> torch.Tensor:
        """``tile [B,Hc,M,T_b]`` with its causal diagonal square set to ``value``, in place."""
        if self.causal is not None:
            tile[..., -self.causal.shape[1] :].masked_fill_(self.causal, value)
        return tile

    @cached_property
    def _softmax(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Without ``lse``: the block's logits in base 2, ``Z·log2(e)`` (-inf above the diagonal), and their
        softmax ``A`` (``exp2`` is the cheaper exponential on CPU)."""
        logits = self._masked(float32_logits(self.queries, self.keys, self.scaling * LOG2E), float("-inf"))
        weights = torch.sub(logits, logits.amax(dim=-1, keepdim=True)).exp2_()
        return logits, weights.div_(weights.sum(dim=-1, keepdim=True))

    @cached_property
    def logits(self) -> torch.Tensor:
        """``Z_ip = q_i·k_p/√d`` ``[B,Hc,M,T_b]`` float32, 0 where the causal mask hides ``p`` (``A_ip = 0``)."""
        if self.lse is None:
            return self._masked(self._softmax[0].mul_(1.0 / LOG2E), 0.0)
        return float32_logits(self.queries, self.keys, self.scaling)

    @cached_property
    def weights(self) -> torch.Tensor:
        """``A_ip = exp(Z_ip − lse_i)`` ``[B,Hc,M,T_b]`` float32 (in base 2: one fused GEMM, then ``exp2``)."""
        if self.lse is None:
            return self._softmax[1]
        scaled = float32_logits(self.queries, self.keys, self.scaling * LOG2E, self.lse * LOG2E)
        return self._masked(scaled.exp2_(), 0.0)

    def squared_weights(self) -> torch.Tensor:
        """``A_ip²`` ``[B,Hc,M,T_b]`` float32, a new tensor (callers work on it in place): from the logits and
        the normaliser, or from the block's own weights."""
        if self.lse is None:
            return self.weights.square()
        return self._masked(torch.sub(self.logits, self.lse).mul_(2.0 * LOG2E).exp2_(), 0.0)

    @property
    def value_norms(self) -> torch.Tensor:
        """``‖v_p‖²`` ``[B,Hc,T_b]`` float32 (computed once per pass)."""
        return self.stats.value_norms[..., : self.keys.shape[2]]

    def weight_sums(self) -> torch.Tensor:
        """H2O eq. 2 over this block: ``Σ_i A_ip`` summed over each KV group, ``[B,Hc,T_b]``."""
        return self.weights.sum(dim=-2)


@dataclass
class NormalisedStats:
    """One forward's ``queries [B,Hq,q,D]`` over the cache ``keys``/``values [B,Hc,T,D]`` (queries = its last
    ``q`` slots), its attention ``outputs [B,Hq,q,D]``, and a kernel's ``lse [B,Hq,q]`` (float32) or None (each
    block normalises itself)."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float
    outputs: torch.Tensor
    lse: torch.Tensor | None = None
    #: the sums from one fused pass (:mod:`kvbench.kernels.sums`) where the policy has such a form (``lse`` given)
    fused: bool = False

    @cached_property
    def value_norms(self) -> torch.Tensor:
        """``‖v_p‖²`` over the cache ``[B,Hc,T]`` float32."""
        return self.values.float().square().sum(dim=-1)

    def block_queries(self) -> int:
        """Queries per block when none is configured: ``CPU_BLOCK_QUERIES`` on CPU; on an accelerator as
        many as keep one float32 ``[B,Hq,block,T]`` tile within ``BLOCK_ELEMENTS``."""
        if self.queries.device.type == "cpu":
            return CPU_BLOCK_QUERIES
        batch, q_heads, _, _ = self.queries.shape
        return max(128, BLOCK_ELEMENTS // (batch * q_heads * self.keys.shape[2]))

    def blocks(self, size: int | None = None) -> Iterator[NormalisedBlock]:
        """Blocks of at most ``size`` queries (None: :meth:`block_queries`), each over the slots its queries
        see."""
        batch, q_heads, q_len, dim = self.queries.shape
        heads, tokens = self.keys.shape[1], self.keys.shape[2]
        group, past, size = q_heads // heads, tokens - q_len, size or self.block_queries()
        queries = self.queries.view(batch, heads, group, q_len, dim)
        outputs = self.outputs.view(batch, heads, group, q_len, -1)
        lse = None if self.lse is None else self.lse.view(batch, heads, group, q_len)
        masks: dict[int, torch.Tensor] = {}  # [G·w,w] by block width: True above each query's own slot
        for start in range(0, q_len, size):
            end = min(start + size, q_len)
            width, visible = end - start, past + end
            rows = (batch, heads, group * width)
            if width > 1 and width not in masks:
                square = torch.ones(width, width, dtype=torch.bool, device=self.keys.device)
                masks[width] = square.triu_(1).repeat(group, 1)
            yield NormalisedBlock(
                self,
                queries[:, :, :, start:end].reshape(*rows, dim),
                self.keys[:, :, :visible],
                self.values[:, :, :visible],
                self.scaling,
                None if lse is None else lse[..., start:end].reshape(*rows, 1),
                outputs[:, :, :, start:end].reshape(*rows, -1),
                masks.get(width),
            )


@dataclass
class QueryTerms:
    """Rows of queries ``i`` over cached tokens ``p`` as a re-weighting score reads them, in explicit tensors (a
    :class:`NormalisedBlock` offers the same names): ``weights`` ``A_ip [..., M, T]``, ``logits`` ``Z_ip [..., M, T]``
    (0 where ``A_ip = 0``), ``outputs`` ``o_i [..., M, D]`` and ``values`` ``v_p [..., T, D]`` (leading dims broadcast
    against the rows')."""

    weights: torch.Tensor
    logits: torch.Tensor
    outputs: torch.Tensor
    values: torch.Tensor

    def squared_weights(self) -> torch.Tensor:
        """``A_ip²`` (a new tensor)."""
        return self.weights.square()

    @cached_property
    def value_norms(self) -> torch.Tensor:
        """``‖v_p‖² [..., T]``."""
        return self.values.square().sum(dim=-1)


#: a block of queries as a re-weighting modifier reads it (:meth:`~kvbench.policies.base.Modifier.contribution_sums`)
QueryBlock = NormalisedBlock | QueryTerms


T = TypeVar("T")


def memoised(store: dict[Hashable, Any], name: Hashable, compute: Callable[[], T]) -> T:
    """``store[name]``, computed by ``compute()`` the first time it is asked for."""
    if name not in store:
        store[name] = compute()
    return store[name]


#: a computation of window statistics for several askers' items at once: ``compute(stats, items)``, a 0-d tensor each
Together = Callable[["AttentionStats", list[Any]], list[torch.Tensor]]


@dataclass
class AttentionStats:
    """Float32 attention of a window of queries over the cached tokens of one layer.

    ``queries [B,Hq,W,D]`` (post-RoPE), ``keys``/``values [B,Hkv,T,D]`` (the cache), ``query_positions [W]``
    and ``key_positions [B,Hkv,T]`` (absolute token positions: a query sees keys at positions <= its own).
    Nothing of size T×T is built: W is the scoring window (or one block of it).
    """

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    query_positions: torch.Tensor
    key_positions: torch.Tensor
    scaling: float
    #: leading cache slots every query sees (known from ``blocks``): their logits skip the causal mask check
    seen_by_all: int = 0
    #: a shared prefill's window: what its variants ask :meth:`together` is computed for all of them when the layer
    #: ends (:meth:`settle`)
    batched: bool = False

    @property
    def group_size(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    @cached_property
    def memo(self) -> dict[Hashable, Any]:
        """What was computed from these statistics alone, by name (:meth:`once`)."""
        return {}

    def once(self, name: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, a function of these statistics alone: computed by the first that asks for ``name`` (a shared
        prefill's variants share one window's statistics), then read."""
        return memoised(self.memo, name, compute)

    @cached_property
    def waiting(self) -> dict[Hashable, tuple[Together, list[tuple[Any, torch.Tensor]]]]:
        """What :meth:`together` was asked and :meth:`settle` has not yet computed: by name, its computation and each
        asker's item and result (0-d, to be filled)."""
        return {}

    def together(self, name: Hashable, item: Any, compute: Together) -> torch.Tensor:
        """``compute(self, [item])[0]``, a 0-d tensor of these statistics and ``item``; where they are a shared
        prefill's (:attr:`batched`), a 0-d tensor that :meth:`settle` fills when the layer ends, with one ``compute`` of
        the items every variant asked by ``name`` (one pass for all of them instead of one each). Read it no
        earlier."""
        if not self.batched:
            return compute(self, [item])[0]
        result = torch.empty((), dtype=torch.float32, device=self.queries.device)
        self.waiting.setdefault(name, (compute, []))[1].append((item, result))
        return result

    def settle(self) -> None:
        """Compute what :meth:`together` was asked so far, each name's items at once."""
        waiting = list(self.waiting.values())
        self.waiting.clear()
        for compute, asked in waiting:
            for (_, result), value in zip(asked, compute(self, [item for item, _ in asked]), strict=True):
                result.copy_(value)

    def per_query_head(self, tensor: torch.Tensor) -> torch.Tensor:
        """Repeat a per-KV-head tensor ``[B,Hkv,...]`` to query heads ``[B,Hq,...]`` (repeat_kv layout)."""
        return tensor.repeat_interleave(self.group_size, dim=1)

    @cached_property
    def logits(self) -> torch.Tensor:
        """``Z_ip = q_i·k_p/√d`` with the causal mask as -inf: ``[B,Hq,W,T]``."""
        batch, q_heads, window, dim = self.queries.shape
        kv_heads = self.keys.shape[1]
        grouped = self.queries.float().reshape(batch, kv_heads, self.group_size * window, dim)
        logits = torch.matmul(grouped, self.keys.float().transpose(-1, -2)).mul_(self.scaling)  # [B,Hkv,G·W,T]
        logits = logits.view(batch, kv_heads, self.group_size, window, -1)
        seen = self.seen_by_all  # only the slots after these can hold a query's future
        future = self.key_positions[:, :, None, None, seen:] > self.query_positions[None, None, None, :, None]
        logits[..., seen:].masked_fill_(future, float("-inf"))
        return logits.view(batch, q_heads, window, -1)

    @cached_property
    def weights(self) -> torch.Tensor:
        """``A_ip = softmax_p(Z_i)``: ``[B,Hq,W,T]``."""
        return torch.softmax(self.logits, dim=-1)

    @cached_property
    def outputs(self) -> torch.Tensor:
        """``o_i = Σ_p A_ip v_p``: ``[B,Hq,W,D]``."""
        batch, q_heads, window, tokens = self.weights.shape
        grouped = self.weights.view(batch, -1, self.group_size * window, tokens)  # [B,Hkv,G·W,T]
        return torch.matmul(grouped, self.values.float()).view(batch, q_heads, window, -1)

    def grouped(self) -> QueryTerms:
        """These queries' float32 terms with each KV group on its own axis: weights, logits (0 where masked) and
        outputs ``[B,Hkv,G,W,...]``, the values ``[B,Hkv,1,T,D]`` (per query head, without copying)."""
        groups = (self.keys.shape[1], self.group_size)
        weights = self.weights.unflatten(1, groups)
        logits = self.logits.unflatten(1, groups).where(weights != 0, 0.0)  # masked (-inf): no weight
        return QueryTerms(weights, logits, self.outputs.unflatten(1, groups), self.values.float()[:, :, None])

    def blocks(self, size: int | None):
        """Split the query window into blocks of at most ``size`` queries (bounds the [W,T] working set);
        ``None`` sizes them by memory (``block_queries``).

        Each block keeps only the cache slots its queries can see and knows which ones all of them see:
        the cache is position-ordered per head and queries come in position order, so both are prefixes,
        found for every block with one host synchronisation. Causal prefill blocks so skip the masked
        upper triangle. On an accelerator a window that fits in one block is yielded unchanged: skipping
        the synchronisation there is worth more than the skipped mask. A block's tensors are
        ``[..., T_b]`` with ``T_b <= T``; callers add them into ``[..., :T_b]``."""
        size = size or self.block_queries()
        window = self.queries.shape[2]
        if window <= size and self.queries.device.type != "cpu":
            yield self
            return
        starts = range(0, window, size)
        firsts_and_lasts = [*starts, *(min(start + size, window) - 1 for start in starts)]
        sorted_keys = self.key_positions.flatten(0, 1).contiguous()  # [B·Hkv,T]
        bounds = self.query_positions[torch.tensor(firsts_and_lasts, device=sorted_keys.device)]  # [2·blocks]
        bounds = bounds.to(sorted_keys.dtype).expand(sorted_keys.shape[0], -1).contiguous()
        counts = torch.searchsorted(sorted_keys, bounds, right=True).view(-1, 2, len(starts))  # [B·Hkv,2,blocks]
        seen_by_all, visible = torch.stack([counts[:, 0].amin(dim=0), counts[:, 1].amax(dim=0)]).tolist()
        for index, start in enumerate(starts):
            yield AttentionStats(
                self.queries[:, :, start : start + size],
                self.keys[:, :, : visible[index]],
                self.values[:, :, : visible[index]],
                self.query_positions[start : start + size],
                self.key_positions[..., : visible[index]],
                self.scaling,
                seen_by_all[index],
            )

    def block_queries(self) -> int:
        """Queries per block when none is configured: 128 on CPU (the [128,T] block stays in cache); on an
        accelerator as many as keep one float32 ``[B,Hq,block,T]`` tensor within ``BLOCK_ELEMENTS``."""
        if self.queries.device.type == "cpu":
            return 128
        batch, q_heads, _, _ = self.queries.shape
        return max(128, BLOCK_ELEMENTS // (batch * q_heads * self.keys.shape[2]))


def reconstruction_attention(
    queries: torch.Tensor, keys: torch.Tensor, sinks: int, chunk: slice, scaling: float
) -> torch.Tensor:
    """The most attention each slot of a context ``chunk`` receives from the ``q`` queries ``[B,Hq,q,D]`` of the
    forward that repeats it, over the cache's ``keys [B,Hc,T,D]`` whose last ``q`` are the forward's own: each query
    attends (causally among its own) to the first ``sinks`` slots, the chunk and the forward's own slots only, and
    the maximum is over the queries and each KV group (KVzip §3.2; kvpress ``KVzipPress.score_kvzip``):
    ``[B,Hc,|chunk|]``."""
    batch, q_heads, q_len, dim = queries.shape
    heads, sinks = keys.shape[1], min(sinks, chunk.start)
    seen = torch.cat([keys[:, :, :sinks], keys[:, :, chunk], keys[:, :, -q_len:]], dim=2)  # [B,Hc,S,D]
    rows = queries.reshape(batch, heads, q_heads // heads * q_len, dim)  # [B,Hc,G·q,D]
    logits = float32_logits(rows, seen, scaling).view(batch, heads, -1, q_len, seen.shape[2])  # [B,Hc,G,q,S]
    future = torch.ones(q_len, q_len, dtype=torch.bool, device=keys.device).triu(1)  # [q,q]
    logits[..., -q_len:].masked_fill_(future, float("-inf"))
    weights = torch.softmax(logits, dim=-1)[..., sinks : sinks + chunk.stop - chunk.start]  # [B,Hc,G,q,|chunk|]
    return weights.amax(dim=(2, 3))
