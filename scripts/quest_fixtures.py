"""Quest's released decode attention (mit-han-lab/Quest ``evaluation/quest_attention.py``: ``forward`` with its
``local_heavy_hitter_mask``) on seeded random queries, keys and values: the reference of tests/test_quest.py, written
to ``tests/fixtures/quest/quest.pt``. Run with a checkout of the released code (its ``evaluation`` folder importable;
it imports transformers' Llama attention):

    python scripts/quest_fixtures.py /path/to/Quest tests/fixtures/quest/quest.pt [COMMIT]

(``COMMIT``: the released code's commit, where the checkout is no git work tree.)

The released ``forward`` runs on a stand-in attention module: identity projections (the hidden states are the
queries, keys and values, so the case's tensors are what it selects from and attends), identity RoPE (the case's
tensors are post-rotation; transformers 5's ``apply_rotary_pos_emb`` takes no ``position_ids``, so the script
replaces it in the released module by the identity), the legacy tuple cache. Recorded per case: the single query
``[1,4,1,D]``, the keys/values ``[1,2,T,D]`` (the last slot the query's own token), the budget and page size, each
query head's slots read (the released attention weights that are not zero) and its output ``[1,1,4,D]``."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch
from released import save_cases  # scripts/released.py

#: (slots held after the new token, token budget, page size): pages that do not divide the slots, a budget above
#: them, a one-token cache, the three-page floor, and a budget of many pages
CASES = [(100, 64, 16), (37, 64, 16), (1, 64, 16), (64, 16, 16), (200, 32, 8), (300, 96, 16), (129, 128, 16)]
HEADS, KV_HEADS, DIM = 4, 2, 32


def identity(features: int) -> torch.nn.Linear:
    layer = torch.nn.Linear(features, features, bias=False)
    torch.nn.init.eye_(layer.weight)
    return layer


def module(budget: int, page: int) -> SimpleNamespace:
    """The attributes the released ``forward`` reads of a patched ``LlamaAttention`` (``enable_quest_attention_eval``
    sets ``layer_id``, ``token_budget`` and ``chunk_size``): layer 2, the first that Quest selects in."""
    return SimpleNamespace(
        q_proj=identity(HEADS * DIM),
        k_proj=None,  # per case: the new token's key and value (main)
        v_proj=None,
        o_proj=identity(HEADS * DIM),
        num_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        num_key_value_groups=HEADS // KV_HEADS,
        head_dim=DIM,
        hidden_size=HEADS * DIM,
        layer_id=2,
        layer_idx=0,
        token_budget=budget,
        chunk_size=page,
        rotary_emb=lambda value, position_ids: (None, None),
    )


def main(checkout: str, out: str, commit: str = "") -> None:
    sys.path.insert(0, checkout)
    import evaluation.quest_attention as released  # the released code

    released.apply_rotary_pos_emb = lambda query, key, cos, sin, position_ids: (query, key)  # identity RoPE
    generator = torch.Generator().manual_seed(0)
    cases = []
    for tokens, budget, page in CASES:
        query = torch.randn(1, HEADS, 1, DIM, generator=generator)
        keys = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        values = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        attention = module(budget, page)
        # the new token's key and value come from its hidden state: projections that give exactly them
        hidden = query.transpose(1, 2).reshape(1, 1, HEADS * DIM)
        new_key, new_value = keys[:, :, -1:], values[:, :, -1:]
        attention.k_proj = lambda states, key=new_key: key.transpose(1, 2).reshape(1, 1, KV_HEADS * DIM)
        attention.v_proj = lambda states, value=new_value: value.transpose(1, 2).reshape(1, 1, KV_HEADS * DIM)
        past = (keys[:, :, :-1], values[:, :, :-1])
        with torch.no_grad():
            output, weights, _ = released.forward(
                attention,
                hidden,
                attention_mask=None,
                position_ids=torch.tensor([[tokens - 1]]),
                past_key_value=past,
                output_attentions=True,
                use_cache=True,
            )
        cases.append(
            {
                "tokens": tokens,
                "budget": budget,
                "page_size": page,
                "query": query,
                "keys": keys,
                "values": values,
                "read": weights[:, :, 0] > 0,  # [1,Hq,T]
                "output": output.view(1, 1, HEADS, DIM),
            }
        )
    save_cases(cases, out, "mit-han-lab/Quest", checkout, commit)


if __name__ == "__main__":
    main(*sys.argv[1:])
