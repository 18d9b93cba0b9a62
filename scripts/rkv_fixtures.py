"""R-KV's released compression (Zefan-Cai/R-KV ``rkv/compression/r1_kv.py``: ``R1KV.update_kv`` with ``rkv/utils.py``'s
``compute_attention_scores`` and ``cal_similarity``) on seeded random queries and keys: the reference of
tests/test_rkv.py, written to ``tests/fixtures/rkv/rkv.pt``. Run with a checkout of the released code:

    python scripts/rkv_fixtures.py /path/to/R-KV tests/fixtures/rkv/rkv.pt [COMMIT]

(``COMMIT``: the released code's commit, where the checkout is no git work tree.)

The two files are loaded on their own (the package's ``__init__`` files import modules the release does not ship and
a model monkeypatch): ``utils.py`` as the package ``rkv_compression`` that ``r1_kv.py``'s relative import reads.
Recorded per case (query heads per KV head, cache length, budget, window, pooling kernel): the last ``window``
queries ``[1,Hq,W,D]``, the keys ``[1,2,T,D]`` (a few planted near-repeats, so that the redundancy term bites),
and the slots each KV head keeps, as the release records them (``record_kept_token_indices``: the top
``budget − window`` of its final score, then the window), float32."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from released import save_cases  # scripts/released.py

#: (query heads per KV head, cache length, budget, window, kernel)
CASES = [(1, 64, 24, 8, 7), (4, 100, 40, 8, 7), (2, 33, 16, 8, 3), (3, 257, 64, 16, 7), (1, 9, 9, 8, 7)]
KV_HEADS, DIM = 2, 16


def released(checkout: str):
    """``R1KV`` from the checkout, its package stood in for."""
    root = Path(checkout) / "rkv"
    spec = importlib.util.spec_from_file_location("rkv_compression", root / "utils.py")
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    package.__path__ = [str(root / "compression")]  # a package: r1_kv.py's ``from . import ...`` reads it
    sys.modules["rkv_compression"] = package
    spec.loader.exec_module(package)
    spec = importlib.util.spec_from_file_location("rkv_compression.r1_kv", root / "compression" / "r1_kv.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.R1KV


def main(checkout: str, out: str, commit: str = "") -> None:
    r1kv = released(checkout)
    generator = torch.Generator().manual_seed(0)
    cases = []
    for group, tokens, budget, window, kernel in CASES:
        keys = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        for source, repeat in ((1, 4), (tokens // 3, tokens // 2), (2, tokens - window - 1)):
            if repeat < tokens:
                keys[:, :, repeat] = keys[:, :, source] * 1.5 + 0.05  # a near-repeat of an earlier key
        values = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        queries = torch.randn(1, KV_HEADS * group, window, DIM, generator=generator)
        press = r1kv(budget=budget, window_size=window, kernel_size=kernel, record_kept_token_indices=True)
        kept_keys, _ = press.update_kv(keys, queries, values)
        if press.kept_token_indices:
            kept = press.kept_token_indices[-1].sort(dim=-1).values  # [Hkv, budget]
        else:  # a cache below the budget is kept whole
            kept = torch.arange(tokens).expand(KV_HEADS, -1)
        assert kept_keys.shape[2] == kept.shape[-1]
        cases.append(
            {
                "group": group,
                "tokens": tokens,
                "budget": budget,
                "window": window,
                "kernel": kernel,
                "queries": queries,
                "keys": keys,
                "kept": kept,
            }
        )
    save_cases(cases, out, "Zefan-Cai/R-KV", checkout, commit)


if __name__ == "__main__":
    main(*sys.argv[1:])
