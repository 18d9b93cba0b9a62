"""Region attention (kvbench/kernels/decode.py): each unit's query heads over its own region of one flat buffer,
against a brute-force softmax per unit, by the Triton kernel (under Triton's interpreter on CPU, compiled on a GPU)
and by the padded PyTorch path."""

from __future__ import annotations

import pytest
import torch

from kvbench import kernels
from kvbench.kernels import decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def regions(lengths: list[int], spare: int, dim: int, generator: torch.Generator):
    """A flat buffer ``[P,D]`` holding regions of ``lengths`` entries, each followed by ``spare`` slots of noise (what a
    region's slots to come hold), in shuffled order: ``(keys, values, starts)``."""
    order = torch.randperm(len(lengths), generator=generator).tolist()
    starts = [0] * len(lengths)
    offset = 3  # a region not at the buffer's start
    for unit in order:
        starts[unit] = offset
        offset += lengths[unit] + spare
    keys, values = (torch.randn(offset + 2, dim, generator=generator) * 2 for _ in range(2))
    return keys, values, torch.tensor(starts)


def brute_force(queries, keys, values, starts, lengths, scaling):
    outputs = []
    for query, start, length in zip(queries, starts.tolist(), lengths.tolist()):
        held_keys, held_values = keys[start : start + length].float(), values[start : start + length].float()
        weights = torch.softmax(query.float() @ held_keys.T * scaling, dim=-1)  # [G,T]
        outputs.append(weights @ held_values)
    return torch.stack(outputs)


CASES = [  # query heads per unit, head dim, each unit's length, spare slots after each region
    (1, 16, [1, 5, 64], 0),
    (3, 24, [63, 64, 65, 1, 130], 4),
    (4, 64, [17, 200], 7),
    (9, 32, [2, 3], 1),
]


@pytest.mark.kernel
@pytest.mark.skipif(not kernels.available(), reason="triton is not installed")
@pytest.mark.parametrize("case", CASES, ids=lambda case: f"G{case[0]}-D{case[1]}-n{len(case[2])}")
@pytest.mark.parametrize("block_n", [16, 64])
def test_each_unit_attends_its_own_region(case, block_n):
    group, dim, lengths, spare = case
    generator = torch.Generator().manual_seed(group * 100 + dim)
    keys, values, starts = regions(lengths, spare, dim, generator)
    queries = torch.randn(len(lengths), group, dim, generator=generator)
    length_tensor = torch.tensor(lengths)
    expected = brute_force(queries, keys, values, starts, length_tensor, dim**-0.5)
    moved = [x.to(DEVICE) for x in (queries, keys, values, starts, length_tensor)]
    got = decode.region_attention(*moved, dim**-0.5, block_n=block_n)
    assert got.shape == (len(lengths), group, dim) and got.dtype == queries.dtype
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-5, atol=2e-5)
    padded = decode.padded_region_attention(*moved, dim**-0.5, longest=max(lengths) + 3)
    torch.testing.assert_close(padded.cpu(), expected, rtol=2e-5, atol=2e-5)


@pytest.mark.kernel
@pytest.mark.skipif(not kernels.available(), reason="triton is not installed")
def test_16_bit_entries_match_sdpa_within_its_rounding():
    """bfloat16 queries and entries, as a GPU's cache holds them: the kernel's outputs against the padded SDPA path in
    bfloat16 and against float32, within bfloat16's rounding."""
    generator = torch.Generator().manual_seed(5)
    lengths = [40, 7, 129]
    keys, values, starts = regions(lengths, 3, 32, generator)
    queries = torch.randn(3, 3, 32, generator=generator)
    length_tensor = torch.tensor(lengths)
    expected = brute_force(queries, keys, values, starts, length_tensor, 32**-0.5)
    half = [x.to(DEVICE, torch.bfloat16) for x in (queries, keys, values)]
    places = [x.to(DEVICE) for x in (starts, length_tensor)]
    got = decode.region_attention(half[0], half[1], half[2], *places, 32**-0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().cpu(), expected, rtol=2e-2, atol=2e-2)
    padded = decode.padded_region_attention(half[0], half[1], half[2], *places, 32**-0.5, longest=129)
    torch.testing.assert_close(got.float(), padded.float(), rtol=2e-2, atol=2e-2)


def test_counting_views_one_buffer_grown_as_needed(monkeypatch):
    """``counting(n)`` is ``arange(n)`` for any ``n`` (past the first buffer's 1,024 too), each a view of the device's
    one buffer: a step's masks make none of their own."""
    monkeypatch.setattr(decode, "COUNTS", {})
    device = torch.device("cpu")
    first = decode.counting(5, device)
    assert torch.equal(first, torch.arange(5)) and first.dtype == torch.long
    again = decode.counting(700, device)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, torch.arange(700))
    grown = decode.counting(3000, device)
    assert torch.equal(grown, torch.arange(3000)) and decode.counting(17, device).data_ptr() == grown.data_ptr()
