"""Running attention sums in one fused pass: for each cached key ``p``, a sum over every query ``i`` of the forward
(every query head of its KV group, bottom-right causal) of a function of ``A_ip = exp(Z_ip − lse_i)``, ``Z_ip =
q_i·k_p·scaling``, without materialising ``[q, T]``:

* ``weights``: ``Σ_i A_ip`` (H2O eq. 2);
* an output error ``(a0, a1, b1)``: ``Σ_i A_ip² ‖α_ip v_p − β_ip o_i‖²`` with ``α = a0 + a1·Z``, ``β = b1·Z``
  (OBCache eqs. 4–6: value ``(1, 0, 0)``, key ``(0, 1, 1)``, joint ``(1, 1, 1)``;
  :func:`kvbench.policies.scores.output_error_sums`), expanded as ``‖v_p‖² Σ_i A²α² − 2 Σ_i A²αβ (v_p·o_i) +
  Σ_i A²β² ‖o_i‖²``.

One program per (tile of keys, batch × KV head) loops over the query tiles that see its keys; ``lse`` comes from the
attention pass (each query's log-sum-exp of its logits). Both products of a tile (``k·q`` and ``v·o``) take the
16-bit inputs as they are (tensor cores on a GPU) with float32 accumulation; keys lie on a tile's rows, so each
key's sum is a row reduction, as flash attention's softmax sums are."""

from __future__ import annotations

import math

import torch

from kvbench.kernels import interpreted

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch: the kernel is unavailable, its callers say so
    triton = None

#: (a0, a1, b1) of an output error's α = a0 + a1·Z and β = b1·Z, or this: the plain weight sums
WEIGHTS = None
#: the tuning's length classes: one per power of two of keys below 2**(LONG - 1) (8,192), one from there
LONG = 14
LOG2E = 1.0 / math.log(2.0)


if triton is not None:

    @triton.jit
    def _sums_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, out_ptr,
        stride_qb, stride_qh, stride_qt,
        stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt,
        stride_ob, stride_oh, stride_ot,
        stride_lb, stride_lh,
        heads, q_len, kv_len, dim, scaling, scale_log2, length_class,
        GROUP: tl.constexpr, WEIGHT_SUMS: tl.constexpr, A0: tl.constexpr, A1: tl.constexpr, B1: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        # keys on the tile's rows, queries on its columns: a key's sum is a row reduction, as flash attention's
        tile, bh = tl.program_id(0), tl.program_id(1)
        batch, head = bh // heads, bh % heads
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
        dims = tl.arange(0, BLOCK_D)  # [D]
        key_ok, dim_ok = keys < kv_len, dims < dim
        tile_ok = key_ok[:, None] & dim_ok[None, :]
        k_tile = tl.load(
            k_ptr + batch * stride_kb + head * stride_kh + keys[:, None] * stride_kt + dims[None, :],
            mask=tile_ok,
            other=0.0,
        )  # [N,D]
        v_tile = k_tile
        if not WEIGHT_SUMS:
            v_tile = tl.load(
                v_ptr + batch * stride_vb + head * stride_vh + keys[:, None] * stride_vt + dims[None, :],
                mask=tile_ok,
                other=0.0,
            )  # [N,D]
        if UPCAST:  # the interpreter multiplies 16-bit tiles wrongly; their float32 products are exact
            k_tile, v_tile = k_tile.to(tl.float32), v_tile.to(tl.float32)
        past = kv_len - q_len  # query i sees slots 0 .. past + i
        first = tl.maximum(tile * BLOCK_N - past, 0) // BLOCK_M * BLOCK_M  # the first query tile seeing a key here
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        squares = tl.zeros([BLOCK_N], dtype=tl.float32)  # Σ A²α²
        crossed = tl.zeros([BLOCK_N], dtype=tl.float32)  # Σ A²αβ o_i·v_p
        outer = tl.zeros([BLOCK_N], dtype=tl.float32)  # Σ A²β² ‖o_i‖²
        for member in range(GROUP):
            q_head = head * GROUP + member
            for start in range(first, q_len, BLOCK_M):
                rows = start + tl.arange(0, BLOCK_M)  # [M]
                row_ok = rows < q_len
                q_tile = tl.load(
                    q_ptr + batch * stride_qb + q_head * stride_qh + rows[:, None] * stride_qt + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :],
                    other=0.0,
                )  # [M,D]
                if UPCAST:
                    q_tile = q_tile.to(tl.float32)
                lse = tl.load(lse_ptr + batch * stride_lb + q_head * stride_lh + rows, mask=row_ok, other=0.0)
                logits = tl.dot(k_tile, tl.trans(q_tile), input_precision="ieee")  # [N,M] float32
                seen = key_ok[:, None] & row_ok[None, :] & (keys[:, None] <= past + rows[None, :])
                weights = tl.where(seen, tl.exp2(logits * scale_log2 - lse[None, :]), 0.0)  # lse in base 2
                if WEIGHT_SUMS:
                    total += tl.sum(weights, axis=1)
                else:
                    z = tl.where(seen, logits * scaling, 0.0)  # Z_ip
                    squared = weights * weights
                    alpha = A0 + A1 * z
                    squares += tl.sum(squared * alpha * alpha, axis=1)
                    if B1 != 0:
                        beta = B1 * z
                        o_tile = tl.load(
                            o_ptr + batch * stride_ob + q_head * stride_oh + rows[:, None] * stride_ot + dims[None, :],
                            mask=row_ok[:, None] & dim_ok[None, :],
                            other=0.0,
                        )  # [M,D]
                        if UPCAST:
                            o_tile = o_tile.to(tl.float32)
                        products = tl.dot(v_tile, tl.trans(o_tile), input_precision="ieee")  # [N,M] v_p·o_i
                        crossed += tl.sum(squared * alpha * beta * products, axis=1)
                        o_wide = o_tile.to(tl.float32)
                        norms = tl.sum(o_wide * o_wide, axis=1)  # [M]
                        outer += tl.sum(squared * beta * beta * norms[None, :], axis=1)
        if not WEIGHT_SUMS:
            v_wide = v_tile.to(tl.float32)
            total = tl.sum(v_wide * v_wide, axis=1) * squares
            if B1 != 0:
                total += outer - 2.0 * crossed
        tl.store(out_ptr + bh * kv_len + keys, total, mask=key_ok)

    def configs(tiles: list[tuple[int, int, int, int]]) -> list:
        return [
            triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
            for m, n, warps, stages in tiles
        ]

    #: tiles (queries, keys), warps and pipeline stages measured on the device at a kernel's first call per head
    #: size, group, statistic and length class; every tile shape exact (the tests run each). H2O's weight sums:
    CONFIGS = configs(
        [(64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (32, 128, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2)]
    )
    #: an output error's (OBCache), whose three more sums a key and the ``v·o`` tile fill a thread's 255 registers:
    #: compiled for sm_90, its key and joint errors spill at every tile of ``CONFIGS`` (8–736 bytes a thread) and
    #: at none of the first two here (``python -m kvbench.kernels.targets``)
    ERROR_CONFIGS = configs([(64, 64, 8, 3), (32, 64, 8, 3), (64, 128, 8, 3), (64, 64, 4, 3)])
    _tuned = {
        weights: triton.autotune(tiles, key=["dim", "length_class", "GROUP", "WEIGHT_SUMS", "B1"])(_sums_kernel)
        for weights, tiles in ((True, CONFIGS), (False, ERROR_CONFIGS))
    }


def tuned_configs(terms: tuple[float, float, float] | None = WEIGHTS) -> list:
    """The tile configurations the autotuning tries for the sums of ``terms`` (:func:`attention_sums`)."""
    return CONFIGS if terms is WEIGHTS else ERROR_CONFIGS


def attention_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    outputs: torch.Tensor,
    lse: torch.Tensor,
    scaling: float,
    terms: tuple[float, float, float] | None = WEIGHTS,
    tiles: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The sums ``[B,Hc,T]`` float32 of ``queries [B,Hq,q,D]`` (the last ``q`` slots, bottom-right causal) over
    ``keys``/``values [B,Hc,T,D]``, with their attention ``outputs [B,Hq,q,D]`` and log-sum-exps ``lse [B,Hq,q]``
    (natural log): ``terms`` ``None`` for ``Σ_i A_ip``, else ``(a0, a1, b1)`` of an output error (module doc); each
    KV head's sums over its group of query heads. ``tiles``: (queries, keys) per tile; by default measured on a GPU
    at the first call (``triton.autotune``), (64, 64) under the interpreter."""
    if triton is None:
        raise RuntimeError("the fused attention sums need triton")
    args, constants = sums_arguments(queries, keys, values, outputs, lse, scaling, terms)
    if tiles is None and interpreted():
        tiles = (64, 64)
    kernel, fixed = (
        (_tuned[terms is WEIGHTS], {}) if tiles is None else (_sums_kernel, dict(zip(("BLOCK_M", "BLOCK_N"), tiles)))
    )
    kv_len, batch_heads = keys.shape[2], keys.shape[0] * keys.shape[1]

    def grid(meta):
        return (triton.cdiv(kv_len, meta["BLOCK_N"]), batch_heads)

    kernel[grid](*args, **constants, **fixed)
    return args[5]


def sums_arguments(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    outputs: torch.Tensor,
    lse: torch.Tensor,
    scaling: float,
    terms: tuple[float, float, float] | None = WEIGHTS,
) -> tuple[tuple, dict]:
    """What :func:`attention_sums` launches the kernel with (its inputs as the kernel reads them, the sums' empty
    output ``[B,Hc,T]`` sixth), and the constants it is compiled for but the tiles (:mod:`kvbench.kernels.targets`
    compiles it from these)."""
    batch, q_heads, q_len, dim = queries.shape
    heads, kv_len = keys.shape[1], keys.shape[2]
    if outputs.dtype != values.dtype:  # one dtype for the v·o products
        outputs, values = outputs.float(), values.float()
    queries, keys, values, outputs = (
        x if x.stride(-1) == 1 else x.contiguous() for x in (queries, keys, values, outputs)
    )
    lse = (lse.float() * LOG2E).contiguous()  # base 2, as the kernel exponentiates
    out = torch.empty(batch, heads, kv_len, dtype=torch.float32, device=keys.device)
    a0, a1, b1 = (0.0, 0.0, 0.0) if terms is None else terms
    args = (
        queries, keys, values, outputs, lse, out,
        queries.stride(0), queries.stride(1), queries.stride(2),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        outputs.stride(0), outputs.stride(1), outputs.stride(2),
        lse.stride(0), lse.stride(1),
        heads, q_len, kv_len, dim, scaling, scaling * LOG2E, min(kv_len.bit_length(), LONG),
    )  # fmt: skip
    constants = dict(
        GROUP=q_heads // heads, WEIGHT_SUMS=terms is None, A0=a0, A1=a1, B1=b1,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), UPCAST=interpreted(),
    )  # fmt: skip
    return args, constants
