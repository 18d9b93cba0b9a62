"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks plus the most recent tokens."""

from dataclasses import dataclass

from kvbench.domains import integer, setting
from kvbench.policies.base import Policy
from kvbench.policies.context import Statistic
from kvbench.policies.registry import register


@register
@dataclass
class Sink(Policy):
    """Keep the first ``n_sink`` tokens and the most recent ``budget - n_sink`` (StreamingLLM §3.2)."""

    name = "sink"
    paper = "StreamingLLM (arXiv 2309.17453)"

    n_sink: int = setting(integer(0, "a token count"), 4)

    @property
    def statistic(self) -> Statistic:
        return "positions"

    def reserved_sinks(self) -> int:
        return self.n_sink
