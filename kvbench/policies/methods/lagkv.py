"""LagKV (Liang et al., 2025, arXiv 2504.04704): score each partition of the cache by the lag-relative statistics
of the next one, no attention read."""

from dataclasses import dataclass

import torch

from kvbench.domains import integer, setting
from kvbench.policies.base import Policy
from kvbench.policies.context import ScoreContext, Statistic
from kvbench.policies.registry import register


def lag_relative(states: torch.Tensor, lag: int) -> torch.Tensor:
    """LagKV eq. 3-4 over partitions of ``lag`` slots ``states [B,Hc,P·L,D]``: each entry min-max normalised per
    channel by the next partition (its lag reference), the channels' standard deviation, softmax within the
    partition: ``[B,Hc,P−1,L]``."""
    parts = states.unflatten(2, (-1, lag))  # [B,Hc,P,L,D]
    reference = parts[:, :, 1:]
    low, high = reference.amin(dim=-2, keepdim=True), reference.amax(dim=-2, keepdim=True)  # [B,Hc,P-1,1,D]
    return ((parts[:, :, :-1] - low) / (high - low)).std(dim=-1).softmax(dim=-1)


@register
@dataclass
class LagKV(Policy):
    """After ``n_sink`` sinks the cache is cut into partitions of ``lag_size`` slots; every partition but the last
    (with the remainder) is scored by :func:`lag_relative` of its keys and values averaged, ranked within the
    partition (rank / L, so each partition keeps its best alike), and the sinks and the last partition score 1
    (always kept first), as kvpress's ``LagKVPress`` (``cross_scoring=False``). A cache shorter than
    ``n_sink + 2·lag_size`` has no reference: the sinks, then the newest slots. In the chunked and streaming regimes
    the partitions are cut over the cache evicted from (kvpress's ``BlockPress``)."""

    name = "lagkv"
    paper = "LagKV (arXiv 2504.04704)"
    ranks_with_ties = True  # every partition ranks 0, 1/L, …; the sinks and the last partition all score 1

    #: slots a partition holds (kvpress's default)
    lag_size: int = setting(integer(1, "a token count"), 128)
    #: first slots always kept (kvpress's default)
    n_sink: int = setting(integer(0, "a token count"), 4)

    @property
    def statistic(self) -> Statistic:
        return "entries"

    def score(self, context: ScoreContext) -> torch.Tensor:
        keys, values = context.keys.float(), context.values.float()  # [B,Hc,T,D]
        batch, heads, tokens, _ = keys.shape
        sink, lag = min(self.n_sink, tokens), self.lag_size
        if tokens < sink + 2 * lag:  # no reference partition: a ramp keeps the newest after the sinks
            ramp = torch.arange(tokens - sink, device=keys.device) / (tokens - sink)
            scores = torch.cat([ramp.new_ones(sink), ramp])  # [T]
            return scores.expand(batch, heads, tokens)
        end = sink + (tokens - sink) // lag * lag
        relative = (lag_relative(keys[:, :, sink:end], lag) + lag_relative(values[:, :, sink:end], lag)) / 2
        ranks = relative.argsort(dim=-1).argsort(dim=-1).flatten(2) / lag  # [B,Hc,end-sink-L]
        return torch.cat([keys.new_ones(batch, heads, sink), ranks, keys.new_ones(batch, heads, tokens - end + lag)], 2)
