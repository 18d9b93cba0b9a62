"""What a policy is not defined under, in one line each: the settings (its own refusal, KIVI's), checked once a job is
resolved and again by every new cache; and the model (sliding-window layers, learned attention sinks)."""

from __future__ import annotations

import torch

from kvbench.engine.kivi import Kivi, quant_refusal
from kvbench.policies.base import Policy


def held_windows(config) -> list[int | None]:
    """Each layer's sliding window where the cache holds it as the model does (:meth:`EvictionCache.slide`: the last
    ``W - 1`` tokens, a band mask, never evicted by the policy, whose budgets are the global layers'): the layers
    ``config.layer_types`` names ``sliding_attention`` beside global ones (Gemma 3). None for every other layer, and
    for every layer of a model attending each through one window (Mistral v0.1, Phi-3-mini-4k: no global layer to
    compress; a sequence beyond the window is refused, :func:`~kvbench.engine.attention.within_window`)."""
    types = list(getattr(config, "layer_types", None) or [])
    window = getattr(config, "sliding_window", None)
    if window is None or "sliding_attention" not in types or all(kind == "sliding_attention" for kind in types):
        return [None] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def has_learned_sinks(model) -> bool:
    """Whether the model's softmax adds a learned logit per head (GPT-OSS's ``sinks``, given to attention as
    ``s_aux``)."""
    return any(isinstance(getattr(module, "sinks", None), torch.nn.Parameter) for module in model.modules())


def settings_refusal(
    policy: Policy, regime: str, context: bool, decode_evict: bool, quant: Kivi | None = None
) -> str | None:
    """Why ``policy`` is not defined under these settings, whatever the model (its own refusal, then KIVI's), or
    None: checked once a job is resolved, before anything loads (:func:`kvbench.job.resolve`), and by every new
    cache, with the model's refusal (:func:`model_refusal`), for an engine built without a job."""
    return policy.refusal(regime, context, decode_evict) or quant_refusal(quant, policy, decode_evict)


def model_refusal(policy: Policy, windows: list[int | None], learned_sinks: bool) -> str | None:
    """Why ``policy`` is not defined on a model of sliding ``windows`` (:func:`held_windows`) and ``learned_sinks``,
    or None: beside sliding-window layers (never evicted) a policy that shares the budget across the layers as the
    prefill passes them (a dynamic layer budget, the ``reconstruction`` statistic); with learned attention sinks
    (GPT-OSS) an attending modifier, which merges its own attention of the kept entries (without the sinks)."""
    attending = [modifier.name for modifier in policy.modifiers if modifier.attends]
    if learned_sinks and attending:
        return (
            f"policy {policy.spec}: {', '.join(attending)} replaces decode attention with its own over the kept "
            "entries, which leaves out this model's learned attention sinks (GPT-OSS); valid choices here: a policy "
            "without calidrop or slake"
        )
    across = f"policy.layer_budget={policy.layer_budget.name}" if policy.layer_budget.dynamic else None
    if policy.statistic == "reconstruction":
        across = "its context's reconstruction"
    if across is None or not any(windows):
        return None
    sliding = sum(window is not None for window in windows)
    return (
        f"policy {policy.spec}: {across} shares the budget across every layer, and {sliding} of this model's "
        f"{len(windows)} layers attend a sliding window, held as the model holds it; valid choices here: a static "
        "policy.layer_budget (uniform, pyramidkv) and a policy scoring from attention"
    )
