"""CaliDrop (KV Cache Compression with Query-Based Calibration): calibrate decode attention with the evicted
KV and a historical query.

Evicted entries are kept (on the model's device, or on CPU with ``offload``), optionally only the
``calib_size`` best by the base's score (§5.3). Per query head the layer caches a calibration query
``C_q``, ``C_lse = log Σ_e exp(C_q·k_e/√d)`` and ``C_out = Att(C_q, K_e, V_e)``, initialised with the
prompt's last query (Alg. 1 lines 3–6). Each single-query forward (decode) computes
``ρ = cos(q_t, C_q)`` per query head (the paper's query similarity is per head, §3.1.1):

* ``ρ < θ1``: recompute ``C_lse, C_out`` with ``q_t`` over the evicted set, set ``C_q = q_t``, calibrate;
* ``ρ > θ2``: calibrate with the cached state;
* otherwise the output of the kept cache stands (Alg. 1 lines 8–18).

Calibration merges the kept and evicted parts by the attention decomposition theorem (eqs. 1–2), in log
space: ``out = (e^{lse_kept} out_kept + e^{C_lse} C_out) / (e^{lse_kept} + e^{C_lse})``. GQA: the query heads
of a KV head share its evicted set, each with its own ``C_q``. Tokens evicted later (chunked / streaming
decode eviction, CAKE's cascading) join the evicted set, and their contribution under the cached ``C_q``
is merged into ``C_lse, C_out`` by the same theorem, so the state stays exactly ``Att(C_q, evicted set)``;
when ``calib_size`` drops entries the state is recomputed with ``C_q`` instead.

Recomputation rate (Fig. 3b): recomputations / single-query forwards with a non-empty evicted set, per
layer, counting a head-step as one (the rate is the mean over the layer's query heads).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.domains import FLAG, Domain, integer, is_number, optional, setting
from kvbench.kernels.decode import counting
from kvbench.policies.base import Modifier
from kvbench.policies.context import Evicted, by_kv_head
from kvbench.policies.registry import register


def attention_lse(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, visible: torch.Tensor | None = None
):
    """Float32 ``(lse [B,Hc,G], out [B,Hc,G,D])`` of ``query [B,Hc,G,D]`` over ``keys``/``values [B,Hc,E,D]``
    (``visible``: those each head holds, ``[B,Hc|1,E]``; None: all): ``lse = log Σ_e exp(q·k_e·scaling)`` and ``out
    = Att(q, K, V)``."""
    logits = query @ keys.float().transpose(-1, -2) * scaling  # [B,Hc,G,E]
    if visible is not None:
        logits = logits.masked_fill(~visible[..., None, :], float("-inf"))
    lse = logits.logsumexp(dim=-1)
    return lse, torch.exp(logits - lse[..., None]) @ values.float()


def merge_attention(lse_a: torch.Tensor, out_a: torch.Tensor, lse_b: torch.Tensor, out_b: torch.Tensor):
    """Attention over the union of two disjoint key sets from each part's ``(lse, out)`` (CaliDrop eqs. 1–2):
    ``α_b = e^{lse_b} / (e^{lse_a} + e^{lse_b}) = sigmoid(lse_b − lse_a)``, ``out = (1 − α_b) out_a + α_b out_b``."""
    return torch.logaddexp(lse_a, lse_b), merged_output(lse_a, out_a, lse_b, out_b)


def merged_output(lse_a: torch.Tensor, out_a: torch.Tensor, lse_b: torch.Tensor, out_b: torch.Tensor) -> torch.Tensor:
    """The ``out`` of :func:`merge_attention` alone (a decode step's calibrated output needs no ``lse``)."""
    weight = torch.sigmoid(lse_b - lse_a)[..., None]
    return out_a + weight * (out_b - out_a)


@dataclass
class Calibration:
    """One layer's CaliDrop state: the calibration query ``C_q [B,Hc,G,D]``, ``C_lse [B,Hc,G]`` and ``C_out
    [B,Hc,G,D]`` over the ``store`` of evicted entries (``length [B,Hc]``: those each head holds, where the store is
    padded on a shelf of stored rows; None: all), and per head the decode steps and recomputations counted ``[B,Hc]``
    (a recomputation of one head-step: the share of its query heads recomputing)."""

    query: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    out: torch.Tensor | None = None
    store: Evicted | None = None
    steps: torch.Tensor | None = None
    recomputed: torch.Tensor | None = None
    length: torch.Tensor | None = None


@register
@dataclass
class CaliDrop(Modifier):
    """Query-based calibration of decode attention (CaliDrop Alg. 1); θ1 = 0.7, θ2 = 0.85 (§4.1.3)."""

    name = "calidrop"
    paper = "CaliDrop: KV Cache Compression with Query-Based Calibration"
    attends = True
    merges_evicted = True  # the store joins, C_lse/C_out merge (eq. 1); C_q is the forward's last query at once
    reports_state = True  # its recomputation rate (policy_stats)

    #: the cosine similarity of the current query to the calibration query below which the evicted entries'
    #: attention is recomputed (above 1: at every step; below -1: never)
    theta1: float = setting(Domain("a number (a cosine similarity threshold)", is_number), 0.7)
    #: ... above which the stored state calibrates the output without recomputing (above 1: never)
    theta2: float = setting(Domain("a number (a cosine similarity threshold)", is_number), 0.85)
    calib_size: int | None = setting(optional(integer(1, "a token count"), "every evicted entry"), None)
    offload: bool = setting(FLAG, False)

    def new_state(self) -> Calibration:
        return Calibration()

    def stores(self) -> bool:
        return not self.offload

    def on_evict(self, state: Calibration, evicted: Evicted, last_query: torch.Tensor, scaling: float) -> None:
        if state.query is None or state.store is None:  # CaliDrop Alg. 1 line 6: C_q ← Q_{-1}
            state.query = by_kv_head(last_query.float(), evicted.keys.shape[1])
            state.steps = state.query.new_zeros(state.query.shape[:2])
            state.recomputed = state.query.new_zeros(state.query.shape[:2])
            joined = evicted
        else:
            joined = state.store.join(evicted)
        if self.calib_size is not None and len(joined) > self.calib_size:
            joined = joined.top(self.calib_size)
            on_device = joined.to(evicted.keys.device)
            state.lse, state.out = attention_lse(state.query, on_device.keys, on_device.values, scaling)
        elif state.lse is not None and state.out is not None:  # newcomers only: merge their part (eq. 1)
            part = attention_lse(state.query, evicted.keys, evicted.values, scaling)
            state.lse, state.out = merge_attention(state.lse, state.out, *part)
        else:  # CaliDrop Alg. 1 lines 4–5
            state.lse, state.out = attention_lse(state.query, evicted.keys, evicted.values, scaling)
        state.store = joined.to("cpu") if self.offload else joined

    def attend(self, state: Calibration, query, keys, values, output, scaling, visible=None):
        if state.query is None or state.store is None or state.lse is None or state.out is None:
            return None
        assert state.steps is not None and state.recomputed is not None  # set with the query
        batch, q_heads, _, dim = query.shape
        grouped = by_kv_head(query[:, :, 0].float(), keys.shape[1])  # q_t [B,Hc,G,D]
        held = None if visible is None else visible[:, None]  # [B,1,T]
        lse, out = attention_lse(grouped, keys, values, scaling, held)  # CaliDrop Alg. 1 line 9
        similarity = F.cosine_similarity(grouped, state.query, dim=-1)  # Alg. 1 line 10: ρ [B,Hc,G]
        recompute = similarity < self.theta1  # Alg. 1 line 11
        stored = None
        if state.length is not None:  # on a shelf: a slot without evicted entries is not a unit of CaliDrop's
            recompute &= state.length[..., None] > 0
            stored = counting(len(state.store), grouped.device) < state.length[..., None]  # [B,Hc,E]
        if grouped.device.type != "cpu" or recompute.any():  # on a GPU for every head: no wait to read it back
            store = state.store.to(grouped.device)  # reload the offloaded entries
            fresh = attention_lse(grouped, store.keys, store.values, scaling, stored)  # Alg. 1 lines 12–13
            state.query = torch.where(recompute[..., None], grouped, state.query)  # Alg. 1 line 14
            state.lse = torch.where(recompute, fresh[0], state.lse)
            state.out = torch.where(recompute[..., None], fresh[1], state.out)
        calibrate = recompute | (similarity > self.theta2)  # Alg. 1 lines 15–17
        merged = merged_output(lse, out, state.lse, state.out)
        state.steps = state.steps + 1
        state.recomputed = state.recomputed + recompute.float().mean(dim=-1)
        merged = merged.reshape(batch, 1, q_heads, dim).to(output.dtype)
        return torch.where(calibrate.reshape(batch, 1, q_heads, 1), merged, output)

    def units(self, state: Calibration) -> dict[str, torch.Tensor] | None:
        if state.query is None or state.store is None or state.lse is None or state.out is None:
            return None
        assert state.steps is not None and state.recomputed is not None  # set with the query
        store = state.store
        length = state.length
        if length is None:  # every entry of the store
            length = torch.full(store.keys.shape[:2], len(store), device=store.keys.device)
        parts = dict(zip(("keys", "values", "positions", "scores"), store.parts))
        counts = {"steps": state.steps, "recomputed": state.recomputed, "length": length}
        return {"query": state.query, "lse": state.lse, "out": state.out, **parts, **counts}

    def of_units(self, tensors: dict[str, torch.Tensor]) -> Calibration:
        store = Evicted(tensors["keys"], tensors["values"], tensors["positions"], tensors["scores"])
        counts = tensors["steps"], tensors["recomputed"], tensors["length"]
        return Calibration(tensors["query"], tensors["lse"], tensors["out"], store, *counts)

    def policy_stats(self, states: list[Calibration]) -> dict:
        """``recompute_rate_per_layer`` (recomputations / calibration steps), the overall ``recompute_rate``,
        ``calibration_steps`` (summed over layers) and ``evicted_bytes`` (the kept evicted KV, all layers)."""
        counted = [(state.steps, state.recomputed) for state in states if state.steps is not None]
        read: Iterator[list[float]] = iter([])
        if counted:  # each layer's steps and mean recomputations, read back at once (on a GPU a synchronisation)
            held, done = (torch.stack(part).flatten(1) for part in zip(*counted))  # [L,B·Hc]
            read = iter(torch.stack([held.amax(dim=1), done.mean(dim=1)], dim=1).tolist())
        pairs = [(0, 0.0) if state.steps is None else next(read) for state in states]
        steps, recomputed = [int(step) for step, _ in pairs], [float(mean) for _, mean in pairs]
        stores = [state.store for state in states if state.store is not None]
        return {
            "recompute_rate_per_layer": [done / count if count else 0.0 for done, count in zip(recomputed, steps)],
            "recompute_rate": sum(recomputed) / sum(steps) if sum(steps) else 0.0,
            "calibration_steps": sum(steps),
            "evicted_bytes": sum(2 * store.keys.numel() * store.keys.element_size() for store in stores),
        }
