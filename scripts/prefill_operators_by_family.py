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

and it prints a Markdown table (docs/benchmarks.md quotes it). With ``--by-frame`` it prefills every variant at every
budget together, as one sample of the grid, and charges each operator (and each value read back) to the innermost
kvbench function that dispatched it; with ``--accelerator`` too, SLAKE's VABS takes its window in one block as on an
accelerator (``slake.vabs_block``; 64 query rows a block on a CPU), so the counts are those a GPU would launch but for
H2O's running sums, which ``engine.sums_kernel=triton`` fuses there."""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict

import torch

import kvbench.policies.methods.slake as slake
from kvbench.bench.grid import variant_engine
from kvbench.bench.measure import ByFrame, Operators
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


def by_frame(model_name: str = "smollm2_135m_random", length: int = 1024, accelerator: bool = False) -> None:
    """Every variant at every budget prefilled together (see the module's docstring), by frame."""
    if accelerator:
        slake.VABS_BLOCK = 1 << 30  # every window in one block, whatever the variants asking (slake.vabs_block)
    spec = model_config(model_name)
    loaded = load_model(spec)
    settings = selected_policy_settings((("experiment", "leaderboard"),))
    prompt, layers = random_prompt(loaded, length)
    engines = [
        variant_engine(loaded.model, spec.hf_id, name, budget, settings, tokenizer=loaded.tokenizer)
        for name in registered_policies("variants", regime="oneshot").split(",")
        for budget in BUDGETS
    ]
    prefill_shared(engines, Prompt(prompt, 1), batch_size=len(engines))  # what a process makes once
    with ByFrame() as counted:
        prefill_shared(engines, Prompt(prompt, 1), batch_size=len(engines))
    rows = len(engines)
    blocks = "in one block" if accelerator else "in blocks of 64"
    print(f"{model_name}, {length} tokens, {layers} layers, {rows} rows, VABS's window {blocks}:")
    print(f"{counted.launched:,} operators ({counted.launched / rows / layers:.1f} a row and layer)\n")
    print("| frame | operators | a row and layer |\n|---|---|---|")
    for frame, count in counted.frames.most_common(30):
        print(f"| `{frame}` | {count:,} | {count / rows / layers:.2f} |")
    print(f"\n{counted.host_reads:,} values read back (a CPU's `.tolist()` not seen):\n")
    print("| frame | values read back |\n|---|---|")
    for frame, count in (+counted.reads).most_common(10):
        print(f"| `{frame}` | {count:,} |")


def random_prompt(loaded, length: int) -> tuple[list[int], int]:
    """A prompt of ``length`` random tokens of the loaded model's vocabulary (seed 0), and the model's layers."""
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, loaded.model.config.vocab_size, (length,), generator=generator).tolist()
    return prompt, loaded.model.config.get_text_config().num_hidden_layers


def main(model_name: str = "smollm2_135m_random", length: int = 1024) -> None:
    spec = model_config(model_name)
    loaded = load_model(spec)
    settings = selected_policy_settings((("experiment", "leaderboard"),))
    prompt, layers = random_prompt(loaded, length)

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
    positional = [value for value in sys.argv[1:] if not value.startswith("--")]
    model_name = positional[0] if positional else "smollm2_135m_random"
    length = int(positional[1]) if len(positional) > 1 else 1024
    if "--by-frame" in sys.argv[1:]:
        by_frame(model_name, length, accelerator="--accelerator" in sys.argv[1:])
    else:
        main(model_name, length)
