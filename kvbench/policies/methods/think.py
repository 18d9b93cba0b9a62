"""ThinK (Xu et al., ICLR 2025, arXiv 2407.21018): the prompt's key channels pruned per head by the query-key
interaction, after any token policy has chosen the tokens."""

from dataclasses import dataclass

import torch

from kvbench.domains import integer, number, setting
from kvbench.policies.base import Modifier, Policy
from kvbench.policies.context import evicting_again
from kvbench.policies.registry import register


@register
@dataclass
class ThinK(Modifier):
    """Once the prompt is read and evicted, each cache head drops the ``pruned`` share of its key channels scoring
    least ``‖Q[:,d]‖² · ‖K[:,d]‖²`` — the mean square of channel ``d`` over the last ``window_size`` queries (after
    RoPE, averaged over the KV group) times its mean square over the kept keys (ThinK eq. 5's magnitude criterion,
    as kvpress's ``ThinKPress`` scores it). The cache then holds the prompt's keys in the channels kept only (and
    which they are); attention reads them with the pruned channels zero, as kvpress zeroes them; keys decoded after
    the prompt keep every channel (as kvpress, which prunes at prefill)."""

    name = "think"
    paper = "ThinK (arXiv 2407.21018)"
    swept = False  # the leaderboard's cells not run yet
    needs_attention = False

    #: the share of each head's key channels pruned (kvpress's ``key_channel_compression_ratio``; ThinK's λ, 0.4–0.5)
    pruned: float = setting(number(0, 1, low_open=True, high_open=True), 0.5)
    #: the recent queries that score the channels (kvpress's ``window_size``)
    window_size: int = setting(integer(1, "a query count"), 32)

    @classmethod
    def inapplicable(cls, base: type[Policy]) -> str | None:
        if not base.evicts:
            return f"{base.name} evicts nothing"
        return None

    def refusal(self, policy: Policy, regime: str, query_agnostic: bool, decode_evict: bool) -> str | None:
        if (how := evicting_again(regime, decode_evict)) is not None:
            return f"policy {policy.spec} prunes the prompt's key channels once, after the prompt: {how} evicts again"
        if policy.statistic == "reconstruction":
            return f"policy {policy.spec}: think scores channels by the prompt's last queries, not a reconstruction's"
        others = [modifier.name for modifier in policy.modifiers if modifier.attends or modifier.shares_heads]
        if others or policy.shares_heads:
            holder = ", ".join(others) or policy.name
            return f"policy {policy.spec}: think prunes equal-length heads of kept keys; {holder} does not keep them"
        return None

    def channel_queries(self) -> int:
        return self.window_size

    def key_channels(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The channels each cache head keeps ``[B,Hc,D']`` (ascending) from the last queries ``[B,Hq,W,D]`` and the
        kept keys ``[B,Hc,T,D]``."""
        batch, heads, _, dim = keys.shape
        query_norms = queries[:, :, -self.window_size :].float().square().mean(dim=2)  # [B,Hq,D]
        query_norms = query_norms.view(batch, heads, -1, dim).mean(dim=2)  # [B,Hc,D]: over the KV group
        key_norms = keys.float().square().mean(dim=2)  # [B,Hc,D]
        pruned = (query_norms * key_norms).topk(int(dim * self.pruned), dim=-1, largest=False).indices
        kept = torch.ones(batch, heads, dim, dtype=torch.bool, device=keys.device).scatter_(-1, pruned, False)
        return kept.nonzero()[:, -1].view(batch, heads, -1)
