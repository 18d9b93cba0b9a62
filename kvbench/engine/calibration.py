"""A policy calibrated on the model before it runs (:class:`~kvbench.policies.context.Calibrated`: DuoAttention's head
scores), on the offline calibration text."""

from __future__ import annotations

from typing import Any

from kvbench.errors import KVBenchError
from kvbench.policies.base import Policy
from kvbench.policies.context import Calibrated
from kvbench.resources import paul_graham_essays


def calibration_refusal(policy: Policy, model: Any) -> str | None:
    """Why ``policy`` cannot be calibrated on ``model`` (or its skeleton: ``kvbench plan`` and ``kvbench run`` ask
    before the weights load), or None; None for a policy not :class:`Calibrated`."""
    return policy.calibration_refusal(model) if isinstance(policy, Calibrated) else None


def calibrate(policy: Policy, model: Any, tokenizer: Any) -> None:
    """Calibrate ``policy`` on ``model`` where it is :class:`Calibrated` (it keeps each model's scores: once per model
    and settings), from the Paul Graham essays in ``tokenizer``'s tokens; any other policy as it is."""
    if not isinstance(policy, Calibrated):
        return
    if (refusal := policy.calibration_refusal(model)) is not None:
        raise KVBenchError(refusal)
    if tokenizer is None:
        raise KVBenchError(f"policy {policy.spec} is calibrated on texts: the engine needs the tokenizer")
    policy.calibrate(model, tokenizer, paul_graham_essays())
