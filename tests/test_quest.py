"""Quest (kvbench/policies/methods/quest.py): each decode step's query heads read the pages their bound ranks first,
equal to the released decode attention's selection on random tensors (tests/fixtures/quest/quest.pt, made by
scripts/quest_fixtures.py from mit-han-lab/Quest's evaluation/quest_attention.py); the cache kept whole, the share
read recorded."""

from __future__ import annotations

import pytest
import torch

from kvbench import PROJECT_ROOT
from kvbench.engine import Engine
from kvbench.engine.attention import read_attention
from kvbench.policies import build_policy
from kvbench.policies.methods.quest import Quest, page_bounds
from tests.helpers import TOKENIZER, assert_shared_gives_each_alone, random_prompt, tiny_model

FIXTURE = torch.load(PROJECT_ROOT / "tests" / "fixtures" / "quest" / "quest.pt")


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"T{c['tokens']}-b{c['budget']}-p{c['page_size']}")
def test_each_query_head_reads_the_released_codes_pages_and_attends_as_it(case):
    quest = Quest(page_size=case["page_size"])
    read = quest.read(case["query"], case["keys"], case["budget"], layer_idx=2)
    assert read is not None and torch.equal(read, case["read"])
    output = read_attention(case["query"], case["keys"], case["values"], case["query"].shape[-1] ** -0.5, read)
    torch.testing.assert_close(output, case["output"], rtol=1e-5, atol=1e-6)


def test_a_pages_bound_is_above_every_logit_in_it_and_met_by_its_extreme_keys():
    """``Σ_d max(q_d·max k_d, q_d·min k_d)`` over a page, brute force: at least each key's ``q·k`` in the page."""
    generator = torch.Generator().manual_seed(3)
    query, keys = torch.randn(1, 4, 1, 8, generator=generator), torch.randn(1, 2, 45, 8, generator=generator)
    bounds = page_bounds(query, keys, 16)  # [1,4,3]
    for head in range(4):
        for page in range(3):
            block = keys[0, head // 2, 16 * page : 16 * page + 16]  # [≤16,8]
            q = query[0, head, 0]
            expected = torch.maximum(q * block.amax(0), q * block.amin(0)).sum()
            assert torch.isclose(bounds[0, head, page], expected, atol=1e-5)
            assert (block @ q <= bounds[0, head, page] + 1e-5).all()


def test_the_first_layers_read_every_slot_and_a_budget_of_whole_pages_reads_them_all():
    """At a budget of every slot the released count is ``budget // page_size`` pages: every page where the slots
    fill whole pages; one page fewer where the last is short (the page whose bound is lowest is not read)."""
    query, keys = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 64, 8)
    assert Quest().read(query, keys, 16, layer_idx=1) is None
    read = Quest().read(query, keys, 64, layer_idx=2)
    assert read is not None and read.all()
    short = Quest().read(query, keys[:, :, :60], 64, layer_idx=2)
    assert short is not None and (short.sum(dim=-1) < 60).all() and (short.sum(dim=-1) >= 44).all()


def test_quest_keeps_the_cache_whole_and_records_the_share_it_reads():
    """A 300-token prompt at a budget of 64: no eviction (the full cache's bytes), each later layer's query heads read
    4 of 19 pages (and their share of the page of the new tokens), the first two layers all."""
    model, prompt = tiny_model(layers=4), random_prompt(300)
    quest = Engine(model, build_policy("quest", {}), 64, tokenizer=TOKENIZER)
    full = Engine(model, build_policy("full", {}), 64, tokenizer=TOKENIZER)
    ours, theirs = quest.generate(prompt, 8), full.generate(prompt, 8)
    assert ours.kv == theirs.kv and ours.token_ids[0] == theirs.token_ids[0]
    share = ours.policy_stats["read_share"]
    assert 64 / 308 <= share <= 80 / 300
    just_short = Engine(model, build_policy("quest", {}), 299, tokenizer=TOKENIZER).generate(prompt, 8)
    assert 0.9 < just_short.policy_stats["read_share"] < 1  # all but a page (18 of the 19–20 pages)


def test_rows_decoded_together_give_each_reading_row_alone():
    model, prompt = tiny_model(), random_prompt(200)
    runners = [Engine(model, build_policy(spec, {}), 64, tokenizer=TOKENIZER) for spec in ("quest", "snapkv", "full")]
    assert_shared_gives_each_alone(runners, prompt, 6, batch_size=3)


def test_quest_at_two_budgets_is_two_computations_in_a_group():
    """A group computes once the runs that compute the same thing (``computation_key``): the full cache at any budget,
    not Quest, which reads a budget's pages."""
    from kvbench.identity import computation_key

    model = tiny_model()
    engines = {(spec, budget): Engine(model, build_policy(spec, {}), budget) for spec in ("full", "quest")
               for budget in (64, 128)}  # fmt: skip
    keys = {case: computation_key(engine.policy, engine.budget.spec) for case, engine in engines.items()}
    assert keys["full", 64] == keys["full", 128] and keys["quest", 64] != keys["quest", 128]
