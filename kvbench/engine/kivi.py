"""KIVI's quantiser (Liu et al., 2024, arXiv 2402.02750, §3): a tensor quantised asymmetrically to ``bits`` bits in
groups of ``group_size`` entries along one axis — keys ``[B,H,T,D]`` per channel (groups of tokens, ``axis=2``),
values per token (groups of channels, ``axis=3``) — each group's minimum and step kept in the tensor's dtype:
``level = round(clamp((x − min) / step, 0, 2^bits − 1))``, ``step = (max − min) / (2^bits − 1)``, dequantised as
``level · step + min``; ``32 / bits`` levels packed into an int32 along the same axis, the ``i``-th of each run in
bits ``i·bits ..``, as the released code packs them (``quant/new_pack.py``; tests/fixtures/kivi, made by
scripts/kivi_fixtures.py from it). A group whose entries are all equal (step 0) has level 0, where the released code
divides by zero. The bytes held are the packed codes and the groups' minima and steps."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvbench.errors import KVBenchError
from kvbench.policies import channel_pruner

if TYPE_CHECKING:
    from kvbench.policies.base import Policy

#: the widths packed into an int32 whole
BITS = (2, 4, 8)


def _shifts(bits: int, device) -> torch.Tensor:
    return torch.arange(32 // bits, dtype=torch.int32, device=device) * bits  # [32/bits]


def pack_levels(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """Levels ``[..., L]`` (integers in ``[0, 2^bits)``) → int32 codes ``[..., L·bits/32]`` along the last axis."""
    runs = levels.to(torch.int32).unflatten(-1, (-1, 32 // bits))  # [..., L/f, f]
    return (runs << _shifts(bits, levels.device)).sum(dim=-1, dtype=torch.int32)  # disjoint bits: the sum is the OR


def unpack_levels(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 ``codes [..., C]`` → levels ``[..., C·32/bits]`` (int32) along the last axis."""
    levels = (codes[..., None] >> _shifts(bits, codes.device)) & ((1 << bits) - 1)  # [..., C, f]
    return levels.flatten(-2)


@dataclass(frozen=True)
class Quantized:
    """A tensor as KIVI holds it: ``codes`` (int32, packed along ``axis``), each group's ``step`` and ``minimum``
    (the tensor's dtype; ``[..., groups, ...]`` along ``axis``)."""

    codes: torch.Tensor
    step: torch.Tensor
    minimum: torch.Tensor
    bits: int
    group_size: int
    axis: int

    def bytes(self) -> int:
        """What it holds: the codes and each group's minimum and step."""
        return self.codes.numel() * 4 + (self.step.numel() + self.minimum.numel()) * self.step.element_size()

    def dequantized(self) -> torch.Tensor:
        """``level · step + min`` in the steps' dtype, the original shape."""
        levels = unpack_levels(self.codes.movedim(self.axis, -1), self.bits)  # [..., L]
        grouped = levels.unflatten(-1, (-1, self.group_size)).to(self.step.dtype)  # [..., G, g]
        step, minimum = (x.movedim(self.axis, -1)[..., None] for x in (self.step, self.minimum))
        return (grouped * step + minimum).flatten(-2).movedim(-1, self.axis)


def quantize(tensor: torch.Tensor, bits: int, group_size: int, axis: int) -> Quantized:
    """``tensor`` quantised in groups of ``group_size`` along ``axis`` (module doc); the axis's length a multiple of
    ``group_size``, and ``group_size`` of ``32 / bits``."""
    if bits not in BITS:
        raise KVBenchError(f"KIVI quantises to {bits} bits; valid choices: {', '.join(map(str, BITS))}")
    length = tensor.shape[axis]
    if length % group_size or group_size % (32 // bits):
        raise KVBenchError(
            f"KIVI's groups of {group_size} need a length that is a multiple of them ({length}) and a multiple of "
            f"{32 // bits} values per int32"
        )
    top = (1 << bits) - 1
    grouped = tensor.movedim(axis, -1).unflatten(-1, (-1, group_size))  # [..., G, g]
    minimum = grouped.amin(dim=-1, keepdim=True)
    step = (grouped.amax(dim=-1, keepdim=True) - minimum) / top
    levels = ((grouped - minimum) / torch.where(step == 0, 1, step)).clamp(0, top).round()  # [..., G, g]
    codes = pack_levels(levels.flatten(-2), bits)
    return Quantized(
        codes.movedim(-1, axis),
        step[..., 0].movedim(-1, axis),
        minimum[..., 0].movedim(-1, axis),
        bits,
        group_size,
        axis,
    )


def joined(held: Quantized | None, new: Quantized) -> Quantized:
    """``held`` followed by ``new`` along the tokens (axis 2 of ``[B,H,T,D]``; KIVI's ``torch.cat`` of codes, steps
    and minima), or ``new`` where nothing is held."""
    if held is None:
        return new
    parts = zip((held.codes, held.step, held.minimum), (new.codes, new.step, new.minimum))
    codes, step, minimum = (torch.cat(pair, dim=2) for pair in parts)
    return Quantized(codes, step, minimum, held.bits, held.group_size, held.axis)


#: ``cache.quant``: how a cache holds its entries once the prompt is read; ``kivi2``/``kivi4``: KIVI at 2 / 4 bits
QUANT = ("none", "kivi2", "kivi4")


@dataclass(frozen=True)
class Kivi:
    """KIVI's cache (``cache.quant=kivi<bits>``; its released ``LlamaAttention_KIVI``): keys quantised per channel in
    groups of ``group_size`` tokens, ``residual`` tokens at a time — the keys not yet a whole ``residual`` stay in full
    precision —, values per token in groups of ``group_size`` channels, the latest ``residual`` in full precision.
    The prompt is read in full precision, then split so (:meth:`roll`); each decoded token attends with itself in full
    precision, and the next step quantises what passed the residual (the released code quantises after the step's
    attention: the same entries are attended)."""

    bits: int
    group_size: int = 32
    residual: int = 128

    @staticmethod
    def of(quant: str, group_size: int, residual: int) -> Kivi | None:
        """The ``cache.quant`` setting's representation (None: ``none``), or a one-line error."""
        if quant not in QUANT:
            raise KVBenchError(f"cache.quant={quant}: valid choices: {', '.join(QUANT)}")
        if quant == "none":
            return None
        bits = int(quant.removeprefix("kivi"))
        if group_size % (32 // bits) or residual % group_size:
            raise KVBenchError(
                f"cache.group_size={group_size} and cache.residual={residual}: KIVI needs a group of a multiple of "
                f"{32 // bits} values (an int32 of {bits}-bit levels) and a residual of whole groups"
            )
        return Kivi(bits, group_size, residual)

    def roll(self, entries: KiviEntries, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantise into ``entries`` the full-precision ``keys``/``values [B,H,·,D]`` past the residual: every whole
        ``residual`` of keys, the values before the latest ``residual``; returns what stays in full precision (copies,
        so that the longer tensors are freed)."""
        whole = keys.shape[2] // self.residual * self.residual
        if whole:
            entries.keys = joined(entries.keys, quantize(keys[:, :, :whole], self.bits, self.group_size, axis=2))
            keys = keys[:, :, whole:].clone()
        past = values.shape[2] - self.residual
        if past > 0:
            entries.values = joined(entries.values, quantize(values[:, :, :past], self.bits, self.group_size, axis=3))
            values = values[:, :, past:].clone()
        return keys, values

    def token_bytes(self, element_bytes: int) -> float:
        """A quantised entry's bytes per channel: its level and its share of a group's step and minimum (in the
        cache's dtype of ``element_bytes``), the same for keys (groups of tokens) and values (groups of channels)."""
        return self.bits / 8 + 2 * element_bytes / self.group_size


@dataclass
class KiviEntries:
    """A layer's quantised entries (:class:`Kivi`): the first keys and the first values (not as many), each
    :class:`Quantized` along the tokens, or None while none are; the rest are the layer's full-precision tensors."""

    keys: Quantized | None = None
    values: Quantized | None = None

    def tokens(self) -> tuple[int, int]:
        """The keys and the values quantised."""
        keys = 0 if self.keys is None else self.keys.step.shape[2] * self.keys.group_size
        values = 0 if self.values is None else self.values.step.shape[2]
        return keys, values

    def bytes(self) -> int:
        return sum(part.bytes() for part in (self.keys, self.values) if part is not None)

    def attended(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key and value ``[B,H,T,D]``: the quantised ones dequantised, then the full-precision ``keys`` /
        ``values`` (in their dtype)."""
        parts = []
        for held, full in ((self.keys, keys), (self.values, values)):
            parts.append(full if held is None else torch.cat([held.dequantized().to(full.dtype), full], dim=2))
        return parts[0], parts[1]


def kivi_of(cache: Mapping[str, Any]) -> Kivi | None:
    """The ``cache`` settings' representation (:meth:`Kivi.of`)."""
    return Kivi.of(str(cache["quant"]), int(cache["group_size"]), int(cache["residual"]))


def quant_model_refusal(quant: Kivi | None, head_dim: int) -> str | None:
    """Why a quantised cache is not defined on a model of heads of ``head_dim`` channels (KIVI's value groups are
    channels of one head), or None."""
    if quant is None or head_dim % quant.group_size == 0:
        return None
    return (
        f"cache.group_size={quant.group_size}: KIVI quantises each value in groups of channels, and this model's heads "
        f"have {head_dim}; valid choices: a divisor of {head_dim} that is a multiple of {32 // quant.bits}"
    )


def quant_refusal(quant: Kivi | None, policy: Policy, decode_evict: bool) -> str | None:
    """Why a quantised cache (``cache.quant``) is not defined with ``policy`` and the regime, or None: its layers
    are evicted before they are quantised, so not while decoding, and hold one length for every head."""
    if quant is None:
        return None
    if decode_evict:
        return (
            f"cache.quant=kivi{quant.bits} quantises the entries once the prompt is read and no eviction may follow; "
            "set engine.regime=oneshot (or engine.decode_evict=false)"
        )
    if policy.shares_heads:
        return f"cache.quant=kivi{quant.bits} holds one length for every head; policy {policy.spec} keeps one per head"
    if channel_pruner(policy) is not None:
        return f"cache.quant=kivi{quant.bits} quantises every channel of the keys; policy {policy.spec} prunes some"
    return None
