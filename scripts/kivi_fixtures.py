"""KIVI's released quantiser (jy-yuan/KIVI ``quant/new_pack.py``: ``quant_and_pack_kcache``, ``quant_and_pack_vcache``
and their ``unpack_and_dequant_*``) on seeded random keys and values: the reference of tests/test_kivi.py, written to
``tests/fixtures/kivi/kivi.pt``. Run with a checkout of the released code (its ``quant`` folder importable; it imports
triton, as CUDA builds of torch carry it):

    python scripts/kivi_fixtures.py /path/to/KIVI tests/fixtures/kivi/kivi.pt [COMMIT]

(``COMMIT``: the released code's commit, where the checkout is no git work tree.)

Recorded per case (dtype, bits, group size): the inputs ``keys``/``values [1,1,64,32]``, the packed codes, each group's
step and minimum as the released functions return them, and their dequantised tensors."""

from __future__ import annotations

import sys

import torch
from released import save_cases  # scripts/released.py

CASES = [(dtype, bits, group) for dtype in ("float32", "float16") for bits in (2, 4) for group in (32, 16)]


def main(checkout: str, out: str, commit: str = "") -> None:
    sys.path.insert(0, checkout)
    from quant.new_pack import (  # the released code
        quant_and_pack_kcache,
        quant_and_pack_vcache,
        unpack_and_dequant_kcache,
        unpack_and_dequant_vcache,
    )

    generator = torch.Generator().manual_seed(0)
    cases = []
    for dtype, bits, group in CASES:
        keys = (torch.randn(1, 1, 64, 32, generator=generator) * 3).to(getattr(torch, dtype))
        values = torch.randn(1, 1, 64, 32, generator=generator).to(getattr(torch, dtype))
        key_codes, key_step, key_min = quant_and_pack_kcache(keys.clone(), group, bits)
        value_codes, value_step, value_min = quant_and_pack_vcache(values.clone(), group, bits)
        cases.append(
            {
                "dtype": dtype,
                "bits": bits,
                "group_size": group,
                "keys": keys,
                "values": values,
                "key_codes": key_codes,
                "key_step": key_step,
                "key_min": key_min,
                "key_dequantized": unpack_and_dequant_kcache(key_codes, key_step, key_min, group, bits),
                "value_codes": value_codes,
                "value_step": value_step,
                "value_min": value_min,
                "value_dequantized": unpack_and_dequant_vcache(value_codes, value_step, value_min, group, bits),
            }
        )
    save_cases(cases, out, "jy-yuan/KIVI", checkout, commit)


if __name__ == "__main__":
    main(*sys.argv[1:4])
