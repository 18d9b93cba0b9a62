"""Decode attention over variable-length regions of one flat buffer: unit ``u``'s ``G`` query heads (one new token
each) attend the ``length[u]`` entries at ``keys[start[u] : start[u] + length[u]]`` — every stored row's cache heads
of a layer in one call, each at its own length, none padded (:mod:`kvbench.engine.store`).

One program per unit walks its region in tiles with the running max and sum of flash attention (probabilities in
the values' dtype for the ``p·v`` product, as SDPA's flash kernels take them). Why a kernel of kvbench's own:
flash-attn is not in the GPU image; PyTorch's ``varlen_attn`` packs sequences back to back (``cu_seqlens``), where a
region keeps spare slots for the tokens to come, and the per-sequence used length (``seqused_k``) is not in every
torch it supports; FlexAttention would build a block mask for every step's lengths."""

from __future__ import annotations

import torch

from kvbench.kernels import interpreted
from kvbench.kernels.sums import LOG2E

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch: the kernel is unavailable, its callers say so
    triton = None


if triton is not None:

    @triton.jit
    def _decode_kernel(
        q_ptr, k_ptr, v_ptr, start_ptr, length_ptr, out_ptr,
        stride_qn, stride_qg, stride_kt, stride_vt, stride_on, stride_og,
        dim, scale_log2,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        UPCAST: tl.constexpr,
    ):  # fmt: skip
        unit = tl.program_id(0)
        start = tl.load(start_ptr + unit).to(tl.int64)
        length = tl.load(length_ptr + unit)
        heads, dims = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)  # [G], [D]
        head_ok, dim_ok = heads < GROUP, dims < dim
        q = tl.load(
            q_ptr + unit * stride_qn + heads[:, None] * stride_qg + dims[None, :],
            mask=head_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [G,D]
        if UPCAST:  # the interpreter multiplies 16-bit tiles wrongly; their float32 products are exact
            q = q.to(tl.float32)
        best = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)  # each head's running max (base 2)
        total = tl.zeros([BLOCK_G], dtype=tl.float32)  # Σ exp2(s - best)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)  # Σ exp2(s - best) v
        for offset in range(0, length, BLOCK_N):
            entries = offset + tl.arange(0, BLOCK_N)  # [N]
            entry_ok = entries < length
            rows = start + entries
            k = tl.load(
                k_ptr + rows[:, None] * stride_kt + dims[None, :], mask=entry_ok[:, None] & dim_ok[None, :], other=0.0
            )  # [N,D]
            v = tl.load(
                v_ptr + rows[:, None] * stride_vt + dims[None, :], mask=entry_ok[:, None] & dim_ok[None, :], other=0.0
            )  # [N,D]
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            logits = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [G,N]
            logits = tl.where(entry_ok[None, :], logits, float("-inf"))
            new_best = tl.maximum(best, tl.max(logits, axis=1))
            weights = tl.exp2(logits - new_best[:, None])  # [G,N]
            rescale = tl.exp2(best - new_best)
            total = total * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            best = new_best
        out = acc / total[:, None]
        tl.store(
            out_ptr + unit * stride_on + heads[:, None] * stride_og + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_ok[:, None] & dim_ok[None, :],
        )


def region_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    block_n: int = 64,
) -> torch.Tensor:
    """``queries [n,G,D]``, each unit's heads over its region of ``keys``/``values [P,D]`` (``starts``, ``lengths
    [n]``, each length ≥ 1) → ``[n,G,D]`` in the queries' dtype."""
    if triton is None:
        raise RuntimeError("the region attention kernel needs triton")
    args, constants = region_arguments(queries, keys, values, starts, lengths, scaling, block_n)
    _decode_kernel[(queries.shape[0],)](*args, **constants)
    return args[5]


def region_arguments(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    block_n: int = 64,
) -> tuple[tuple, dict]:
    """What :func:`region_attention` launches the kernel with (the output ``[n,G,D]`` sixth) and the constants it
    is compiled for (:mod:`kvbench.kernels.targets` compiles it from these)."""
    _, group, dim = queries.shape
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    out = torch.empty_like(queries)
    args = (
        queries, keys, values, starts, lengths, out,
        queries.stride(0), queries.stride(1), keys.stride(0), values.stride(0), out.stride(0), out.stride(1),
        dim, scaling * LOG2E,
    )  # fmt: skip
    constants = dict(
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(dim)), UPCAST=interpreted(),
    )  # fmt: skip
    return args, constants


#: by device, ``0, 1, 2, …`` as one buffer that :func:`counting` views (grown by doubling)
COUNTS: dict[torch.device, torch.Tensor] = {}


def counting(length: int, device: torch.device) -> torch.Tensor:
    """``torch.arange(length)`` on ``device`` (int64), a view of one buffer made once a device and grown by doubling:
    the masks and region indices a decode step makes at every layer launch nothing for it. Read only."""
    buffer = COUNTS.get(device)
    if buffer is None or buffer.numel() < length:
        buffer = COUNTS[device] = torch.arange(max(1024, 2 * length), device=device)
    return buffer[:length]


def padded_regions(
    keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor, longest: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The regions at ``starts [n]`` of ``keys``/``values [P,D]``, each gathered to ``longest`` entries (past the
    buffer's end its last entry: masked by the caller) → ``[n,T,D]`` each, by one ``index_select`` (on a CPU far
    quicker than indexing)."""
    index = (starts[:, None] + counting(longest, keys.device)).clamp(max=keys.shape[0] - 1).flatten()
    shape = (len(starts), longest, keys.shape[-1])
    return keys.index_select(0, index).view(shape), values.index_select(0, index).view(shape)


def padded_region_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    longest: int,
) -> torch.Tensor:
    """:func:`region_attention` by PyTorch: each region gathered to ``longest`` entries (``≥`` every length) and one
    masked SDPA call → ``[n,G,D]``."""
    visible = counting(longest, keys.device) < lengths[:, None]  # [n,T]
    keys, values = padded_regions(keys, values, starts, longest)  # [n,T,D]
    output = torch.nn.functional.scaled_dot_product_attention(
        queries[:, :, None],  # [n,G,1,D]
        keys[:, None],  # [n,1,T,D]
        values[:, None],
        attn_mask=visible[:, None, None],
        scale=scaling,
        enable_gqa=queries.shape[1] > 1,
    )
    return output[:, :, 0]
