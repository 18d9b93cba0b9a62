"""Where a grouped sample's shared prefill dispatches its operators (on a GPU, its kernel launches), by the kvbench
function that dispatched them: every variant of ``${policies:variants}`` with the leaderboard's settings at 10/20/40 %,
prefilled together as one shared forward of a random prompt (``kvbench.bench.grid``'s grid), each operator
(``kvbench.bench.measure.Operators``) charged to the innermost kvbench frame on the stack. With ``--accelerator``
SLAKE's VABS takes its window in one block as on an accelerator (``slake.vabs_block``; 64 queries a block on a CPU),
so the counts are those a GPU would launch but for H2O's running sums, which ``engine.sums_kernel=triton`` fuses
there. Run::

    python scripts/prefill_operators_by_frame.py [MODEL] [PROMPT_LENGTH] [--accelerator]   # smollm2_135m_random, 1024

and it prints the total, per row and layer, and a Markdown table of the frames dispatching the most."""

from __future__ import annotations

import sys
import traceback
from collections import Counter

import torch

import kvbench.policies.methods.slake as slake
from kvbench.bench.grid import variant_engine
from kvbench.bench.measure import Operators
from kvbench.config import registered_policies, selected_policy_settings
from kvbench.engine.shared import Prompt, prefill_shared
from kvbench.models import load_model, model_config

BUDGETS = ("10pct", "20pct", "40pct")


class ByFrame(Operators):
    """:class:`Operators`, each operator launched also counted by the innermost kvbench frame that dispatched it."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.launched
        output = super().__torch_dispatch__(func, types, args, kwargs)
        if self.launched > before:
            ours = [frame for frame in traceback.extract_stack() if "/kvbench/" in frame.filename]
            ours = [frame for frame in ours if not frame.filename.endswith("bench/measure.py")]
            self.frames[f"{ours[-1].filename.split('/kvbench/')[-1]}:{ours[-1].name}" if ours else "(model)"] += 1
        return output


def main(model_name: str = "smollm2_135m_random", length: int = 1024, accelerator: bool = False) -> None:
    if accelerator:
        slake.vabs_block = lambda logits, variants=1: logits.shape[2]  # a window in one block
    spec = model_config(model_name)
    loaded = load_model(spec)
    settings = selected_policy_settings((("experiment", "leaderboard"),))
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, loaded.model.config.vocab_size, (length,), generator=generator).tolist()
    layers = loaded.model.config.get_text_config().num_hidden_layers
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


if __name__ == "__main__":
    positional = [value for value in sys.argv[1:] if not value.startswith("--")]
    model_name = positional[0] if positional else "smollm2_135m_random"
    length = int(positional[1]) if len(positional) > 1 else 1024
    main(model_name, length, accelerator="--accelerator" in sys.argv[1:])
