"""SLAKE (Softmax-Approximated Training-Free Linear Attention with KV-Cache Eviction): evicted tokens live on
as first-order Taylor linear attention (PTAA).

Every evicted key/value of a KV head is folded into a constant-size linear state (SLAKE App. C, Alg. 1)::

    L = Σ_e k_eᵀ v_e  [D,D],   k_sum = Σ_e k_e,   v_sum = Σ_e v_e,   ℓ = #evicted

and a single-query forward over the kept cache (logits ``s_j = q·k_j/√d``, ``m = max_j s_j``) outputs

    (Σ_kept e^{s_j−m} v_j + λ[(q·L)/√d + (1−μ) v_sum]) / (Σ_kept e^{s_j−m} + λℓ),  μ = q·k_sum/(ℓ√d), λ = e^{μ−m}

which is eq. 13 / eq. 21 with ``e^{x_e} ≈ e^{μ}(1 + x_e − μ)`` (eq. 11) expanded around the mean evicted
logit μ; the evicted weights sum to ``λℓ`` because ``Σ_e (x_e − μ) = 0``. The ``1/√d`` is applied as
Alg. 1 writes it, to ``q·L`` and inside μ, i.e. to every logit (eqs. 8–9); ``√d`` is the model's attention
scaling. Eq. 13 as printed divides by an extra ``n`` and eq. 12 drops the ``exp`` of its denominator;
Alg. 1 and App. A (eq. 19) are consistent with the derivation and are what is implemented. GQA: query
heads read their KV head's state (Alg. 1's ``repeat_kv``).

Departures: eviction runs after a forward's attention here (Alg. 1 evicts first), so the token evicted at
decode step t is attended exactly at t and linearly from t+1. PTAA replaces single-query (decode)
attention only; multi-token prefill blocks attend to the kept cache alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from kvbench.budgets import Budget
from kvbench.domains import mapping, number, optional, setting
from kvbench.errors import KVBenchError
from kvbench.papers import exponents
from kvbench.policies.base import AttentionStats, Modifier, Policy
from kvbench.policies.context import Evicted, by_kv_head
from kvbench.policies.layer_budget import DynamicLayerBudget, LayerBudget
from kvbench.policies.registry import register


@dataclass
class LinearState:
    """One layer's folded evicted tokens per cache head: ``linear [B,Hc,D,D]``, ``key_sum``/``value_sum
    [B,Hc,D]``, ``count [B,Hc]`` (float32)."""

    linear: torch.Tensor
    key_sum: torch.Tensor
    value_sum: torch.Tensor
    count: torch.Tensor

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor) -> LinearState:
        """The state of ``keys``/``values [B,Hc,E,D]`` (SLAKE Alg. 1 'update linear cache')."""
        keys, values = keys.float(), values.float()
        count = torch.full(keys.shape[:2], float(keys.shape[2]), device=keys.device)
        return cls(torch.einsum("bhed,bhef->bhdf", keys, values), keys.sum(dim=2), values.sum(dim=2), count)

    def add(self, other: LinearState) -> LinearState:
        return LinearState(
            self.linear + other.linear,
            self.key_sum + other.key_sum,
            self.value_sum + other.value_sum,
            self.count + other.count,
        )


@dataclass
class LinearCache:
    """SLAKE's per-layer state: the folded evicted tokens, once any were evicted."""

    linear: LinearState | None = None


def ptaa_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    state: LinearState,
    scaling: float,
    visible: torch.Tensor | None = None,
):
    """PTAA output (SLAKE Alg. 1, eq. 13) of ``query [B,Hc,G,D]`` (float32) over the kept ``keys``/``values
    [B,Hc,T,D]`` (``visible [B,T]``: those each row holds) and the evicted tokens folded in ``state``:
    ``[B,Hc,G,D]``. With ``ℓ = 0`` it is softmax attention. The reference point of the exponentials is ``max(m,
    μ)`` instead of ``m``: the ratio is the same and nothing overflows when the evicted mean logit exceeds the
    kept maximum."""
    logits = query @ keys.float().transpose(-1, -2) * scaling  # s_j [B,Hc,G,T]
    if visible is not None:
        logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    count = state.count[:, :, None]  # ℓ [B,Hc,1]
    mean = torch.einsum("bhgd,bhd->bhg", query, state.key_sum) * scaling / count.clamp_min(1.0)  # μ
    reference = torch.maximum(logits.amax(dim=-1), mean)  # [B,Hc,G]
    exact = torch.exp(logits - reference[..., None])  # e^{s_j − m}
    scale = torch.exp(mean - reference)  # λ = e^{μ − m}
    linear = query @ state.linear * scaling  # (q·L)/√d [B,Hc,G,D]
    linear = (linear + (1.0 - mean)[..., None] * state.value_sum[:, :, None]) * scale[..., None]
    numerator = exact @ values.float() + linear  # Alg. 1 'combine outputs'
    return numerator / (exact.sum(dim=-1) + scale * count)[..., None]


def ptaa_weights(logits: torch.Tensor, evicted: torch.Tensor) -> torch.Tensor:
    """The attention map PTAA implies (SLAKE eq. 11 per token): ``logits [...,W,T]`` (-inf where a query
    cannot see a key), ``evicted [...,1|W,T]`` marks the linearly attended keys (with leading axes of its own: a map
    for each). Kept key ``j`` weighs ``e^{x_j−m}``, evicted ``e^{μ−m}(1 + x_j − μ)``, normalised; ``m`` is the kept
    maximum, ``μ`` the mean evicted logit of the query. Returns ``[...,W,T]`` (evicted weights may be negative)."""
    gone = evicted & (logits > float("-inf"))  # the evicted keys each query sees
    count = gone.sum(dim=-1, keepdim=True, dtype=torch.int32).clamp_min(1)
    mean = torch.where(gone, logits, 0.0).sum(dim=-1, keepdim=True) / count  # μ
    kept_logits = logits.masked_fill(gone, float("-inf"))
    reference = torch.maximum(kept_logits.amax(dim=-1, keepdim=True), mean)
    # in place where a buffer is free: a window of the whole prompt makes each [...,W,T] tensor tens of MB
    shifted = torch.add(logits, 1.0)  # where ``evicted`` has leading axes of its own, a new buffer of its shape:
    linear = shifted.sub_(mean) if shifted.shape == gone.shape else shifted.sub(mean)
    linear.mul_(torch.exp(mean - reference))  # SLAKE eq. (11)
    unnormalised = torch.where(gone, linear, kept_logits.sub_(reference).exp_(), out=linear)
    return unnormalised.div_(unnormalised.sum(dim=-1, keepdim=True))


@register
@dataclass
class Slake(Modifier):
    """PTAA over any base: evicted tokens folded into a linear state, decode attention by eq. 13.

    Over the ``cake`` base SLAKE replaces CAKE's layer preference by VABS (§3.4; Table 2's last row is
    eviction + PTAA + VABS), so ``cake+slake`` allocates with :class:`Vabs` unless ``policy.layer_budget``
    says otherwise (``policy.layer_budget=cake``: Table 2's middle row). Other bases keep their own.
    """

    name = "slake"
    paper = "SLAKE: Softmax-Approximated Training-Free Linear Attention with KV-Cache Eviction"
    attends = True
    merges_evicted = True  # L, k_sum, v_sum, ℓ are sums; PTAA reads them only while decoding

    def default_layer_budget(self, base: Policy) -> LayerBudget | None:
        return Vabs() if base.layer_budget.name == "cake" else None

    def new_state(self) -> LinearCache:
        return LinearCache()

    def on_evict(self, state: LinearCache, evicted: Evicted, last_query: torch.Tensor, scaling: float) -> None:
        folded = LinearState.of(evicted.keys, evicted.values)  # SLAKE Alg. 1 'update linear cache'
        state.linear = folded if state.linear is None else state.linear.add(folded)

    def attend(self, state: LinearCache, query, keys, values, output, scaling, visible=None):
        if state.linear is None:
            return None
        batch, q_heads, _, dim = query.shape
        grouped = by_kv_head(query[:, :, 0].float(), keys.shape[1])  # [B,Hc,G,D]
        result = ptaa_attention(grouped, keys, values, state.linear, scaling, visible)  # SLAKE eq. (13)
        return result.reshape(batch, 1, q_heads, dim).to(output.dtype)

    def stores(self) -> bool:
        return True

    def units(self, state: LinearCache) -> dict[str, torch.Tensor] | None:
        return None if state.linear is None else vars(state.linear)

    def of_units(self, tensors: dict[str, torch.Tensor]) -> LinearCache:
        return LinearCache(LinearState(**tensors))


#: SLAKE Table 3: VABS exponents per model and average per-layer budget: (alpha, beta)
#: (transcribed in kvbench/papers/settings/exponents.csv)
VABS_EXPONENTS = exponents("slake_table3")


@register
@dataclass
class Vabs(DynamicLayerBudget):
    """SLAKE's value-aware budget scores (eqs. 15–18) with PTAA standing in for the tokens the average
    budget would evict; ``gamma`` = 0.1 (§4.1). ``alpha``/``beta`` ``None``: SLAKE Table 3's values for the
    model and budget (:data:`VABS_EXPONENTS`); a model or budget the table lacks needs them explicitly."""

    name = "vabs"
    paper = "SLAKE (Softmax-Approximated Training-Free Linear Attention with KV-Cache Eviction)"

    alpha: float | None = setting(optional(number(0), "SLAKE Table 3's value for the model"), None)
    beta: float | None = setting(optional(number(0), "SLAKE Table 3's value for the model"), None)
    gamma: float = setting(number(0), 0.1)
    #: model id → the model whose Table 3 row it borrows (an experiment's documented stand-in, e.g. Table 4's
    #: Llama-3-8B, which Table 3 lacks)
    stand_in: dict[str, str] = setting(
        mapping("a mapping of model ids to model ids", lambda key, value: isinstance(value, str)), default_factory=dict
    )

    def for_model(self, model_id: str | None, budget: Budget) -> Vabs:
        if self.alpha is not None and self.beta is not None:
            return self
        table = VABS_EXPONENTS.get(self.stand_in.get(model_id or "", model_id or ""), {})
        if budget.tokens not in table:
            listed = ", ".join(f"{model} @ {'/'.join(map(str, rows))}" for model, rows in VABS_EXPONENTS.items())
            raise KVBenchError(
                f"SLAKE Table 3 has no VABS alpha/beta for model {model_id} at budget {budget.spec} (it covers "
                f"{listed}); set policy.layer_budget.alpha=A policy.layer_budget.beta=B"
            )
        alpha, beta = table[budget.tokens]
        return replace(
            self, alpha=alpha if self.alpha is None else self.alpha, beta=beta if self.beta is None else self.beta
        )

    def preference(self, stats: AttentionStats, evicted: torch.Tensor | None) -> torch.Tensor:
        assert evicted is not None  # VABS reads them (reads_evicted)
        if self.alpha is None or self.beta is None:
            raise KVBenchError("VABS needs policy.layer_budget.alpha and .beta (SLAKE Table 3 gives them per model)")
        asked = (evicted, self.alpha, self.beta)  # [B,Hc,T]
        return stats.together(("vabs", self.gamma), asked, partial(vabs_preferences, gamma=self.gamma))


def vabs_preferences(
    stats: AttentionStats, asked: list[tuple[torch.Tensor, float, float]], gamma: float
) -> list[torch.Tensor]:
    """VABS's preference (eq. 18, 0-d) for each ``(evicted [B,Hc,T], alpha, beta)`` asked of one window's ``stats``
    (:meth:`Vabs.preference`), their PTAA maps made in one pass: a shared prefill's variants together."""
    evicted = torch.stack([each for each, _, _ in asked]).repeat_interleave(stats.group_size, dim=2)  # [V,B,Hq,T]
    share, entropy = stats.once("vabs_terms", lambda: vabs_terms(stats.weights, stats.per_query_head(stats.values)))
    products = vabs_products(stats.weights, stats.logits, evicted[..., None, :], share, gamma)  # [V,B,Hq,W]
    return [each.mean() ** alpha * entropy**beta for each, (_, alpha, beta) in zip(products, asked, strict=True)]


def vabs_preference(
    logits: torch.Tensor, evicted: torch.Tensor, values: torch.Tensor, alpha: float, beta: float, gamma: float
) -> torch.Tensor:
    """SLAKE's VABS preference (eqs. 15–18) of a window of queries from their ``logits [B,Hq,W,T]`` (-inf where a
    query cannot see a key), the keys PTAA stands in for (``evicted [B,Hq,1|W,T]``) and the cached ``values
    [B,Hq,T,D]`` (per query head), with ``A`` the true attention and ``Ã`` PTAA's (:func:`ptaa_weights`)::

        TV_hi = ½ Σ_j |Ã_ij − A_ij|                                       (eq. 15)
        VA_hi = (Σ_j ‖v_j‖ / Σ_j' ‖v_j'‖ · |Ã_ij − A_ij|)^γ                (eq. 16)
        H_hi  = −Σ_j A_ij log A_ij                                         (eq. 17, the true attention)
        P     = (E_hi[TV_hi · VA_hi])^α · (E_hi[H_hi])^β                   (eq. 18)
    """
    weights = logits.softmax(dim=-1)
    return vabs_score(weights, logits, evicted, *vabs_terms(weights, values), alpha, beta, gamma)


def vabs_terms(weights: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What VABS reads of the window alone, whatever the budget evicts: each value's share of the norms
    ``‖v_j‖ / Σ_j' ‖v_j'‖ [B,Hq,1,T]`` (eq. 16) and the mean entropy of the true attention ``E_hi[H_hi]`` (eq. 17)."""
    norms = torch.linalg.vector_norm(values.float(), dim=-1)  # [B,Hq,T]
    share = (norms / norms.sum(dim=-1, keepdim=True))[:, :, None]
    entropy = -torch.special.xlogy(weights, weights).sum(dim=-1)  # SLAKE eq. (17)
    return share, entropy.mean()


#: queries of a window whose PTAA map VABS holds at once on a CPU (:func:`vabs_block`): its working copies are
#: ``[B,Hq,VABS_BLOCK,T]``, not the whole window's (Expected Attention's window is the whole prompt)
VABS_BLOCK = 64
#: elsewhere, the bytes of one working copy (float32) of a block, at least ``VABS_BLOCK`` queries
VABS_BYTES = 1 << 28


def vabs_block(logits: torch.Tensor, variants: int = 1) -> int:
    """Queries a block of :func:`vabs_products` holds, for ``logits [B,Hq,W,T]`` and ``variants`` evicted sets: on a
    CPU ``VABS_BLOCK`` rows of ``T`` in all, where a small block's working copies stay in its caches (885 queries over
    885 keys: 51 ms a layer in blocks of 64, 79 ms at once on 2 cores); on an accelerator as many as keep a working
    copy within ``VABS_BYTES``, each block being ~30 kernel launches (one variant's 1k-token window at once;
    Llama-3.1-8B's 32 heads at 32k: 64)."""
    least = max(1, VABS_BLOCK // variants)
    if logits.device.type == "cpu":
        return least
    batch, heads, _, tokens = logits.shape
    return max(least, VABS_BYTES // (4 * variants * batch * heads * tokens))


def vabs_products(
    weights: torch.Tensor,
    logits: torch.Tensor,
    evicted: torch.Tensor,
    share: torch.Tensor,
    gamma: float,
    block: int | None = None,
) -> torch.Tensor:
    """``TV_hi · VA_hi`` (eqs. 15–16) ``[V,B,Hq,W]`` of each query of the window's true ``weights`` and ``logits
    [B,Hq,W,T]`` for each of ``V`` sets of keys PTAA stands in for (``evicted [V,B,Hq,1|W,T]``), ``share`` as
    :func:`vabs_terms`'s; ``block`` queries at a time (None: :func:`vabs_block`). Each query's terms are its own row's,
    whatever the block and the sets beside it, to the bit: eq. (16)'s power is taken in float64 and rounded back, since
    a CPU's float32 power rounds one unit in the last place apart by its vector path (most values) and its scalar path
    (a tensor's last few), which would make a value depend on how many were stacked beside it."""
    block = block or vabs_block(logits, evicted.shape[0])
    per_query = evicted.shape[-2] != 1
    products = []
    for start in range(0, logits.shape[2], block):
        rows = slice(start, start + block)
        approximate = ptaa_weights(logits[:, :, rows], evicted[..., rows, :] if per_query else evicted)
        error = approximate.sub_(weights[:, :, rows]).abs_()  # |Ã − A| [V,B,Hq,w,T]
        total_variation = 0.5 * error.sum(dim=-1)  # SLAKE eq. (15)
        spread = error.mul_(share).sum(dim=-1)  # [V,B,Hq,w]
        value_aware = (spread.double() ** gamma).to(spread.dtype)  # SLAKE eq. (16), in float64: see above
        products.append(total_variation * value_aware)
    return torch.cat(products, dim=-1)


def vabs_score(
    weights: torch.Tensor,
    logits: torch.Tensor,
    evicted: torch.Tensor,
    share: torch.Tensor,
    entropy: torch.Tensor,
    alpha: float,
    beta: float,
    gamma: float,
    block: int | None = None,
) -> torch.Tensor:
    """:func:`vabs_preference` (0-d, left on the device) from the window's true ``weights`` and ``logits [B,Hq,W,T]``,
    ``evicted [B,Hq,1|W,T]`` and the terms of :func:`vabs_terms`, ``block`` queries at a time
    (:func:`vabs_products`)."""
    products = vabs_products(weights, logits, evicted[None], share, gamma, block)[0]  # [B,Hq,W]
    return products.mean() ** alpha * entropy**beta  # SLAKE eq. (18)
