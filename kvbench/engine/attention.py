"""The ``kvbench`` attention function, registered in transformers' attention-function registry.

Models loaded by kvbench run with ``attn_implementation="kvbench"``: this function computes attention with
the model's backend (SDPA, eager or FlashAttention-2) over the budgeted cache, lets the cache's attending
modifiers (CaliDrop, SLAKE) replace the output of single-query forwards, then hands the queries and the
backend's output to the cache, which scores and evicts. A policy reads attention and never computes it, so
every variant of a prompt can share one forward. No model class is patched.

The new queries are always the last ``q`` tokens of the cache, so causality is "bottom-right aligned":
query ``i`` sees cache slots ``0 .. T-q+i``. Positions of evicted caches no longer equal slot indices,
which is why transformers' own mask (built from positions) is replaced by this one.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvbench.errors import KVBenchError
from kvbench.kernels.decode import counting

ATTENTION_NAME = "kvbench"
#: devices where H2O-style sums take each query's normaliser from a fused kernel (``attention_with_lse``) and
#: add one Q·Kᵀ pass; elsewhere (CPU) each block of queries normalises its own logits, cheaper there than a
#: second attention call
NORMALISER_KERNEL_DEVICES = {"cuda"}


def bottom_right_causal_mask(q_len: int, kv_len: int, device, window: int | None = None) -> torch.Tensor:
    """Boolean ``[q,T]`` mask, True where query ``i`` may attend slot ``j`` (``j <= T - q + i``; through a sliding
    ``window`` of slots holding consecutive tokens also ``j > T - q + i - window``, transformers' band)."""
    slots = torch.arange(kv_len, device=device)
    last_visible = torch.arange(kv_len - q_len, kv_len, device=device)
    mask = slots[None, :] <= last_visible[:, None]
    return mask if window is None else mask & (slots[None, :] > last_visible[:, None] - window)


def attention_mask(query, key, key_mask, window: int | None = None) -> torch.Tensor | None:
    """The boolean mask ``[q,T]`` or ``[Hq,q,T]`` (True = attended) of ``query [B,Hq,q,D]`` over ``key [B,Hc,T,D]``:
    bottom-right causal (in a sliding ``window``: a band), and with ``key_mask [Hc,T]`` only the slots each cache head
    holds; None where one query sees every slot (a sliding layer's single query: its layer holds the window)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = bottom_right_causal_mask(q_len, kv_len, query.device, window) if q_len > 1 else None
    if key_mask is None:
        return mask
    held = key_mask.repeat_interleave(query.shape[1] // key.shape[1], dim=0)[:, None]  # [Hq,1,T]
    return held if mask is None else held & mask


def sdpa_attention(query, key, value, scaling, key_mask=None, window=None):
    """``query [B,Hq,q,D]``, ``key/value [B,Hc,T,D]`` (``key_mask [Hc,T]``: the slots each head holds, or None;
    ``window``: a sliding window's band) → ``[B,q,Hq,D]`` with PyTorch SDPA."""
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = key_mask is None and window is None and 1 < q_len == kv_len  # SDPA's own causal mask, no mask tensor
    output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=None if causal else attention_mask(query, key, key_mask, window),
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return output.transpose(1, 2).contiguous()


def read_attention(query, key, value, scaling, read):
    """``query [B,Hq,1,D]`` over the slots of ``key/value [B,Hc,T,D]`` each query head reads (``read [B,Hq,T]``,
    True = read) → ``[B,1,Hq,D]`` with PyTorch SDPA."""
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=read[:, :, None], scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return output.transpose(1, 2).contiguous()


def eager_attention(query, key, value, scaling, key_mask=None, window=None, sinks=None):
    """Reference attention with an explicit float32 softmax (``key_mask``, ``window`` as :func:`sdpa_attention`'s;
    ``sinks [Hq]``: a learned logit per head in each softmax's denominator, GPT-OSS's): ``[B,q,Hq,D]``."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    grouped = query.view(batch, kv_heads, q_heads // kv_heads, q_len, dim)
    logits = torch.einsum("bhgqd,bhtd->bhgqt", grouped, key).float() * scaling
    mask = attention_mask(query, key, key_mask, window)
    if mask is not None:
        mask = mask.view(kv_heads, -1, q_len, kv_len) if mask.dim() == 3 else mask  # [Hc,G,q,T] or [q,T]
        logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # a column of each head's sink logit, dropped after the softmax
        column = sinks.float().view(1, kv_heads, -1, 1, 1).expand(batch, -1, -1, q_len, 1)
        weights = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1].to(value.dtype)
    else:
        weights = torch.softmax(logits, dim=-1).to(value.dtype)
    output = torch.einsum("bhgqt,bhtd->bhgqd", weights, value).reshape(batch, q_heads, q_len, dim)
    return output.transpose(1, 2).contiguous()


def fused_attention_with_lse(query, key, value, scaling, causal: bool):
    """One fused kernel call: ``query [B,Hq,q,D]`` over ``key/value [B,Hc,T,D]``, unmasked or top-left causal
    (``q == T``) → ``(output [B,Hq,q,D], lse [B,Hq,q] float32)``. CPU's flash kernel groups query heads
    itself; on CUDA the KV heads are repeated for the flash (16-bit) or memory-efficient kernel."""
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, causal, scale=scaling)
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    if query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256:
        flash = torch.ops.aten._scaled_dot_product_flash_attention
        output, lse, *_ = flash(query, key, value, 0.0, causal, scale=scaling)
        return output, lse
    output, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scaling
    )
    return output, lse[..., : query.shape[2]]  # the efficient kernel pads lse's query axis


def attention_with_lse(query, key, value, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [B,Hq,q,D]`` over ``key/value [B,Hc,T,D]`` (bottom-right causal) with each query's
    log-sum-exp of its logits: ``(output [B,Hq,q,D], lse [B,Hq,q] float32)``, from fused kernels.

    With earlier slots (chunked prefill: ``1 < q < T``) the queries attend to them unmasked and to their own
    block causally; the two parts merge by their log-sum-exps (no mask tensor, no bottom-right kernel)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or q_len == kv_len:
        return fused_attention_with_lse(query, key, value, scaling, causal=q_len > 1)
    past = kv_len - q_len
    old, old_lse = fused_attention_with_lse(query, key[:, :, :past], value[:, :, :past], scaling, causal=False)
    new, new_lse = fused_attention_with_lse(query, key[:, :, past:], value[:, :, past:], scaling, causal=True)
    lse = torch.logaddexp(old_lse, new_lse)  # [B,Hq,q]
    output = old.float() * (old_lse - lse).exp()[..., None] + new.float() * (new_lse - lse).exp()[..., None]
    return output.to(query.dtype), lse


def masked_lse(query, key, scaling, mask, block: int = 1024) -> torch.Tensor:
    """Each query's float32 log-sum-exp ``[B,Hq,q]`` of its logits over the slots ``mask`` (``[q,T]`` or ``[Hq,q,T]``,
    True = attended) lets it see, ``block`` queries at a time."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    parts = []
    for begin in range(0, q_len, block):
        grouped = query[:, :, begin : begin + block].reshape(batch, kv_heads, q_heads // kv_heads, -1, dim)
        logits = torch.einsum("bhgqd,bhtd->bhgqt", grouped.float(), key.float()) * scaling
        visible = mask[..., begin : begin + block, :]
        visible = visible.view(kv_heads, -1, visible.shape[-2], kv_len) if visible.dim() == 3 else visible
        parts.append(logits.masked_fill(~visible, float("-inf")).logsumexp(dim=-1).reshape(batch, q_heads, -1))
    return torch.cat(parts, dim=-1)


def sink_attention(query, key, value, scaling, sinks, key_mask=None, window=None):
    """Attention whose softmax adds a learned sink logit per head to its denominator (GPT-OSS's ``s_aux``, ``sinks
    [Hq]``): the attention over the keys scaled by ``Z / (Z + e^s) = sigmoid(lse - s)`` — ``(output [B,q,Hq,D], lse
    [B,Hq,q])``, ``lse`` over the keys alone. The output and its log-sum-exp come from one fused call where no mask is
    needed beyond causality, else SDPA's masked output and one float32 Q·Kᵀ pass (:func:`masked_lse`)."""
    if key_mask is None and (window is None or query.shape[2] == 1):
        output, lse = attention_with_lse(query, key, value, scaling)  # [B,Hq,q,D]
    else:
        output = sdpa_attention(query, key, value, scaling, key_mask, window).transpose(1, 2)
        lse = masked_lse(query, key, scaling, attention_mask(query, key, key_mask, window))
    kept = torch.sigmoid(lse - sinks.float()[None, :, None])  # the keys' share beside the sink
    output = (output.float() * kept[..., None]).to(query.dtype)
    return output.transpose(1, 2).contiguous(), lse


def flash_attention(module, query, key, value, scaling):
    """FlashAttention-2 through transformers' integration (causal is bottom-right aligned there)."""
    from transformers.integrations.flash_attention import flash_attention_forward

    output, _ = flash_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=query.shape[2] > 1)
    return output


def kvbench_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    kvbench_cache=None,
    sliding_window=None,
    s_aux=None,
    **_,
):
    """Attention over the (budgeted) cache, decode modifiers and scoring/eviction by ``kvbench_cache`` if given;
    over a :class:`~kvbench.engine.batches.RowBatch`, each row ``query[r:r+1]`` over its own cache, at its own length
    (no row padded: each gives what it gives alone), or a stored row with the others of its shelf. The leading
    parameters are in transformers' order, for wrappers that pass them positionally (kvpress). A layer the model
    attends through a ``sliding_window`` is held and attended as the model does where the cache holds that window
    (Gemma 3's local layers), else only while the sequence fits it (:func:`within_window`); learned sinks in the
    softmax (``s_aux``: GPT-OSS) are added to each query's denominator (:func:`sink_attention`)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if kvbench_cache is None:
        if s_aux is not None:
            return sink_attention(query, key, value, scaling, s_aux, window=sliding_window)[0], None
        return sdpa_attention(query, key, value, scaling, window=sliding_window), None
    if sliding_window is not None and kvbench_cache.window(module.layer_idx) != sliding_window:
        within_window(module.layer_idx, sliding_window, kvbench_cache.span())
    rows = getattr(kvbench_cache, "rows", None)
    if rows is not None:
        attended, queries = rows(module.layer_idx), kvbench_cache.alone_queries(query)
        padded = kvbench_cache.padded and s_aux is None
        together = padded_outputs(module.layer_idx, queries, attended, scaling) if padded else {}
        outputs = [
            cache_attention(cache, module, queries[row : row + 1], keys, values, scaling, together.get(row), s_aux)
            for row, (cache, keys, values) in enumerate(attended)
        ]
        return kvbench_cache.joined(module.layer_idx, query, outputs, scaling), None
    return cache_attention(kvbench_cache, module, query, key, value, scaling, sinks=s_aux), None


def within_window(layer_idx: int, window: int, span: int) -> None:
    """Refuse a sequence of ``span`` tokens through a layer the model attends through a sliding ``window`` longer than
    it: the layer's queries would read keys the model's own do not (Gemma 3's, Mistral v0.1's)."""
    if span > window:
        raise KVBenchError(
            f"the model's layer {layer_idx} attends a sliding window of {window} tokens and this sequence reaches "
            f"{span}: kvbench attends a sliding-window layer as the model does only within its window; keep the "
            f"prompt and the tokens generated within {window}"
        )


def padded_outputs(layer_idx: int, query, rows, scaling) -> dict[int, torch.Tensor]:
    """``engine.rows_attention=padded``: the backend's output ``[1,1,Hq,D]`` of each row of a decode step whose
    backend is SDPA and whose heads hold every key, by row, from one SDPA call per cache-head count over the rows'
    keys/values padded to the longest row, each row's own slots unmasked (``query [N,Hq,1,D]``, ``rows`` as
    :meth:`RowBatch.rows`); none for a forward of several tokens."""
    if query.shape[2] != 1:
        return {}
    groups: dict[int, list[int]] = {}
    for row, (cache, keys, _) in enumerate(rows):
        if cache.attn_backend == "sdpa" and cache.key_mask(layer_idx) is None:
            groups.setdefault(keys.shape[1], []).append(row)
    outputs: dict[int, torch.Tensor] = {}
    for members in groups.values():
        keys = pad_sequence([rows[row][1][0].transpose(0, 1) for row in members], batch_first=True)  # [n,T,Hc,D]
        values = pad_sequence([rows[row][2][0].transpose(0, 1) for row in members], batch_first=True)
        lengths = torch.tensor([rows[row][1].shape[2] for row in members], device=query.device)
        held = counting(keys.shape[1], query.device) < lengths[:, None]  # [n,T]
        together = F.scaled_dot_product_attention(
            query[members],
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=held[:, None, None],
            scale=scaling,
            enable_gqa=query.shape[1] != keys.shape[2],
        ).transpose(1, 2)  # [n,1,Hq,D]
        outputs.update({row: together[place : place + 1] for place, row in enumerate(members)})
    return outputs


class AttendedCache(Protocol):
    """What :func:`cache_attention` asks of a cache (``EvictionCache``, ``SharedPrefill``): the backend, which keys
    each head holds, the attending modifiers' say over a single query, and the scoring and eviction after it."""

    attn_backend: str

    def span(self) -> int:
        """The tokens of the longest sequence through this forward, its own included."""
        ...

    def key_mask(self, layer_idx: int) -> torch.Tensor | None:
        """Which keys of the last update each cache head holds ``[Hc,T]``, or None: all."""
        ...

    def window(self, layer_idx: int) -> int | None:
        """The sliding window the layer holds and attends through, or None: a global layer."""
        ...

    def attend(
        self,
        layer_idx: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        output: torch.Tensor,
        scaling: float,
    ) -> torch.Tensor:
        """A single query's ``output [B,1,Hq,D]``, replaced by the attending modifiers or not."""
        ...

    def read(self, layer_idx: int, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """The slots ``[B,Hq,T]`` each query head of a single query reads where the policy reads part of the cache,
        or None: every slot."""
        ...

    def wants_normaliser(self, layer_idx: int) -> bool:
        """Whether this forward's scoring reads each query's log-sum-exp (a fused pass of running sums), which the
        backend's attention may then give with its output."""
        ...

    def after_attention(
        self, layer_idx: int, queries: torch.Tensor, outputs: torch.Tensor, scaling: float, lse: torch.Tensor | None
    ) -> None:
        """Gather the forward's scoring statistics from ``queries``, their ``outputs`` (and their log-sum-exps ``lse
        [B,Hq,q]`` where the attention gave them), and evict if due."""
        ...


def backend_attention(cache: AttendedCache, module, query, key, value, scaling, sinks=None) -> torch.Tensor:
    """``query [B,Hq,q,D]`` over ``key/value [B,Hc,T,D]`` of ``cache`` by its backend (``sinks [Hq]``: learned sink
    logits, :func:`sink_attention`) → ``[B,q,Hq,D]``."""
    key_mask, window = cache.key_mask(module.layer_idx), cache.window(module.layer_idx)
    if cache.attn_backend == "eager":
        return eager_attention(query, key, value, scaling, key_mask, window, sinks)
    if sinks is not None:  # SDPA and FlashAttention-2 take no sink: their output rescaled by each query's lse
        return sink_attention(query, key, value, scaling, sinks, key_mask, window)[0]
    if key_mask is not None:  # a length per head: FlashAttention-2's varlen kernel takes no per-head lengths
        return sdpa_attention(query, key, value, scaling, key_mask)
    if window is not None and query.shape[2] > 1:  # a band by slots (the layer's, not the model's positions)
        return sdpa_attention(query, key, value, scaling, window=window)
    if cache.attn_backend == "flash_attention_2":
        return flash_attention(module, query, key, value, scaling)
    return sdpa_attention(query, key, value, scaling)


def cache_attention(cache: AttendedCache, module, query, key, value, scaling, output=None, sinks=None):
    """``query [B,Hq,q,D]`` over ``key/value [B,Hc,T,D]`` of ``cache`` (an ``EvictionCache`` or ``SharedPrefill``):
    by the backend (unless its ``output [B,q,Hq,D]`` is given; a single query of a policy that reads part of the
    cache over the slots it reads), then the cache's attending modifiers for a single query, its scoring (from the
    backend's output) and eviction → ``[B,q,Hq,D]``. Where the scoring reads each query's log-sum-exp and one fused
    kernel call gives it with the output (SDPA, every key held, one query or the whole causal square:
    :func:`attention_with_lse`), that call is the attention. ``sinks [Hq]``: the model's learned sink logits
    (GPT-OSS), in the attention and not in the scoring's statistics."""
    lse = None
    read = cache.read(module.layer_idx, query, key) if query.shape[2] == 1 else None
    if read is not None:  # a policy reads part of the cache: its slots alone are attended
        output = read_attention(query, key, value, scaling, read)
    elif output is None:
        q_len, kv_len = query.shape[2], key.shape[2]
        if (
            cache.attn_backend == "sdpa"
            and (q_len == 1 or q_len == kv_len)
            and cache.key_mask(module.layer_idx) is None
            and cache.wants_normaliser(module.layer_idx)
        ):
            if sinks is not None:  # the keys' log-sum-exp, the sink left out
                output, lse = sink_attention(query, key, value, scaling, sinks)
            else:
                output, lse = attention_with_lse(query, key, value, scaling)
                output = output.transpose(1, 2).contiguous()
        else:
            output = backend_attention(cache, module, query, key, value, scaling, sinks)
    attended = output
    if query.shape[2] == 1:
        output = cache.attend(module.layer_idx, query, key, value, output, scaling)
    cache.after_attention(module.layer_idx, query, attended, scaling, lse)
    return output


def no_mask(*args, **kwargs):
    """kvbench builds its own causal mask inside the attention function."""
    return None


def register_attention() -> str:
    """Register the kvbench attention and mask functions; returns the implementation name."""
    AttentionInterface.register(ATTENTION_NAME, kvbench_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, no_mask)
    return ATTENTION_NAME
