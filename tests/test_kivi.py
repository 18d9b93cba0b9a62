"""KIVI's quantiser (kvbench/engine/kivi.py) against the released code's (tests/fixtures/kivi/kivi.pt, made by
scripts/kivi_fixtures.py from jy-yuan/KIVI's quant/new_pack.py): the packed codes, each group's step and minimum
and the dequantised tensors, bit for bit, keys per channel and values per token, 2 and 4 bits, float32 and float16."""

from __future__ import annotations

import pytest
import torch

from kvbench import PROJECT_ROOT
from kvbench.engine.kivi import pack_levels, quantize, unpack_levels
from kvbench.errors import KVBenchError

FIXTURE = torch.load(PROJECT_ROOT / "tests" / "fixtures" / "kivi" / "kivi.pt")
CASES = FIXTURE["cases"]


@pytest.mark.parametrize("case", CASES, ids=lambda case: f"{case['dtype']}-{case['bits']}bit-g{case['group_size']}")
def test_keys_per_channel_and_values_per_token_equal_the_released_quantiser(case):
    bits, group = case["bits"], case["group_size"]
    keys = quantize(case["keys"], bits, group, axis=2)  # groups of tokens in each channel
    assert torch.equal(keys.codes, case["key_codes"])
    assert torch.equal(keys.step, case["key_step"].squeeze(3)) and torch.equal(keys.minimum, case["key_min"].squeeze(3))
    assert torch.equal(keys.dequantized(), case["key_dequantized"])
    values = quantize(case["values"], bits, group, axis=3)  # groups of channels in each token
    assert torch.equal(values.codes, case["value_codes"])
    assert torch.equal(values.step, case["value_step"].squeeze(-1))
    assert torch.equal(values.minimum, case["value_min"].squeeze(-1))
    assert torch.equal(values.dequantized(), case["value_dequantized"])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_is_lossless_and_holds_bits_per_value(bits):
    """Every level survives pack → unpack, the top bits of an int32 included (its sign), along the last axis; a
    tensor's bytes are its codes (``bits / 32`` of an int32 per value) and its groups' steps and minima."""
    levels = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.int32)
    levels[..., 32 // bits - 1] = (1 << bits) - 1  # the last value of a run: the int32's top bits
    codes = pack_levels(levels, bits)
    assert codes.shape == (3, 5, 64 * bits // 32) and codes.dtype == torch.int32 and (codes < 0).any()
    assert torch.equal(unpack_levels(codes, bits), levels)
    held = quantize(torch.randn(1, 2, 64, 32), bits, 32, axis=2)
    assert held.bytes() == 2 * 64 * 32 * bits // 8 + 2 * (2 * 2 * 32) * 4


def test_a_constant_group_dequantises_exactly():
    """A group whose entries are equal has step 0: level 0, its value back exactly (the released code divides by
    zero there)."""
    tensor = torch.randn(1, 1, 32, 32)
    tensor[..., :16] = 0.75  # every token of the first 16 channels: one constant group per channel
    held = quantize(tensor, 2, 32, axis=2)
    assert (held.step[..., :16] == 0).all() and torch.equal(held.dequantized()[..., :16], tensor[..., :16])


@pytest.mark.parametrize(
    ("bits", "group", "message"),
    [(3, 32, "KIVI quantises to 3 bits; valid choices: 2, 4, 8"), (2, 24, "KIVI's groups of 24 need a length")],
)
def test_bad_settings_are_one_line(bits, group, message):
    with pytest.raises(KVBenchError, match=message) as error:
        quantize(torch.randn(1, 1, 64, 32), bits, group, axis=2)
    assert "\n" not in str(error.value)
