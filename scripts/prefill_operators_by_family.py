"""Where a grouped sample's shared prefill dispatches its operators (on a GPU, its kernel launches), by the kind of
row: every variant of ``${policies:variants}`` with the leaderboard's settings, its budgets (10/20/40 %) prefilled as
one shared forward of their own, its operators less the full-cache prefill's (``kvbench.bench.measure.Operators``)
per row and layer, and the mean of each family:

* ``plain``: a ranking, selected with the layer's other variants (``SharedForward.select``);
* ``running sums``: H2O's causal sums, with its OBCache or CAOTE terms (the eager blocked pass; on a GPU
  ``engine.sums_kernel=triton`` fuses it into one pass of no ATen operator);
* ``attending``: SLAKE's or CaliDrop's modifier, handed the entries each eviction drops;
* ``cascade``: a cascading layer budget (CAKE, SLAKE's VABS), a preference a layer and its evictions made at the end;
* ``head-wise``: a share of the budget per cache head (AdaKV, CriticalKV's over it), its entries packed.

A family is the first of these that a variant has, in the order ``cascade``, ``head-wise``, ``attending``,
``running sums``, ``plain``. Each variant is prefilled apart from the others, so what the variants of a full grid
share (window statistics, rankings, sums) is counted in each: an upper bound of its share. Run::

    python scripts/prefill_operators_by_family.py [MODEL] [PROMPT_LENGTH]   # smollm2_135m_random, 1024

and it prints a Markdown table (docs/benchmarks.md quotes it)."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict

import torch

from kvbench.bench.grid import variant_engine
from kvbench.bench.measure import Operators
from kvbench.config import registered_policies, selected_policy_settings
from kvbench.engine import Engine
from kvbench.engine.shared import Prompt, prefill_shared
from kvbench.models import load_model, model_config

BUDGETS = ("10pct", "20pct", "40pct")
FAMILIES = ("plain", "running sums", "attending", "cascade", "head-wise")


def family(engine: Engine) -> str:
    policy = engine.policy
    if policy.layer_budget.dynamic:
        return "cascade"
    if policy.shares_heads:
        return "head-wise"
    if any(modifier.attends for modifier in policy.modifiers):
        return "attending"
    return "running sums" if policy.running else "plain"


def main(model_name: str = "smollm2_135m_random", length: int = 1024) -> None:
    spec = model_config(model_name)
    loaded = load_model(spec)
    settings = selected_policy_settings((("experiment", "leaderboard"),))
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, loaded.model.config.vocab_size, (length,), generator=generator).tolist()
    layers = loaded.model.config.get_text_config().num_hidden_layers

    def counted(name: str) -> tuple[float, list[Engine]]:
        engines = [
            variant_engine(loaded.model, spec.hf_id, name, budget, settings, tokenizer=loaded.tokenizer)
            for budget in BUDGETS
        ]
        prefill_shared(engines, Prompt(prompt, 1), batch_size=len(engines))  # what a process makes once
        with Operators() as operators:
            prefill_shared(engines, Prompt(prompt, 1), batch_size=len(engines))
        return operators.launched / len(engines), engines

    full, _ = counted("full")
    by_family: dict[str, list[float]] = defaultdict(list)
    rows = []
    for name in registered_policies("variants", regime="oneshot").split(","):
        if name == "full":
            continue
        per_row, engines = counted(name)
        extra = (per_row - full) / layers
        by_family[family(engines[0])].append(extra)
        rows.append((extra, name, family(engines[0])))
    print(f"{model_name}, {length} tokens, {layers} layers; full's prefill: {full:,.0f} operators\n")
    print("| family | variants | operators a row and layer over full's (mean, range) |")
    print("|---|---|---|")
    for name in FAMILIES:
        extras = by_family.get(name, [])
        if extras:
            mean, low, high = statistics.mean(extras), min(extras), max(extras)
            print(f"| {name} | {len(extras)} | {mean:.1f} ({low:.1f}–{high:.1f}) |")
    print("\n| variant | family | operators a row and layer over full's |\n|---|---|---|")
    for extra, name, kind in sorted(rows, reverse=True):
        print(f"| `{name}` | {kind} | {extra:.1f} |")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or []), *(int(value) for value in sys.argv[2:3]))
