"""The kernels compiled for a GPU on a machine without one, as a GPU would compile them at their first launch:
Triton's ahead-of-time path (``triton.compile`` for a ``GPUTarget``) to the binary (cubin) that the driver would
load, and the resources each build takes, read from it by the ``cuobjdump`` Triton ships. The interpreter the tests
run the kernels under runs programs that the compiler refuses (a plain Python function called in a kernel) or builds
but a device cannot launch (a block asking more shared memory than the device has), so these builds are the check
that what the tests ran compiles for the device and fits it.

Each build is compiled from the arguments the engine's own launcher makes (:func:`~kvbench.kernels.sums.
sums_arguments`, :func:`~kvbench.kernels.decode.region_arguments`) for the shapes of a model, at every tile
configuration the sums' autotuning may pick. Unspecialised: a launch's alignment hints may change the registers a
little. Run::

    python -m kvbench.kernels.targets [sm_90|sm_80] [STATISTIC ...] [--json]   # a Markdown table: docs/gpu.md
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench.kernels import interpreted

#: the compute capability of each architecture built for and the most shared memory one block may take there, in
#: bytes (CUDA C Programming Guide, "Technical Specifications per Compute Capability": 227 KB on 9.0, 163 KB on 8.0)
ARCHES = {"sm_90": (90, 227 * 1024), "sm_80": (80, 163 * 1024)}
#: the statistics of the fused sums: H2O's weight sums, OBCache's output errors (``kvbench.policies.scores.
#: OBCACHE_TERMS``, a layer above this one: the tests check they agree)
STATISTICS: dict[str, tuple[float, float, float] | None] = {
    "weights": None,
    "obcache_value": (1.0, 0.0, 0.0),
    "obcache_key": (0.0, 1.0, 1.0),
    "obcache_joint": (1.0, 1.0, 1.0),
}
TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "i1",
}


@dataclass(frozen=True)
class Build:
    """One kernel compiled for ``arch``: what it was built for, and what a block of it takes there: ``registers`` a
    thread, ``spilled`` the bytes a thread keeps on its stack (registers spilled to local memory; 0 with no calls and
    no spills), ``shared`` the bytes of shared memory a block asks at launch."""

    kernel: str
    arch: str
    what: str
    dtype: str
    dim: int
    group: int
    tiles: tuple[int, int]
    warps: int
    stages: int
    registers: int | None
    spilled: int | None
    shared: int

    @property
    def fits(self) -> bool:
        """Whether a block's shared memory fits the architecture's."""
        return self.shared <= ARCHES[self.arch][1]


def signature(kernel, args: tuple, constants: dict) -> dict[str, str]:
    """Triton's signature of ``kernel`` for a launch with ``args`` (positional) and ``constants``:
    each tensor a pointer to its dtype, an int ``i32`` (``i64`` beyond), a float ``fp32``, a constant ``constexpr``."""
    names = kernel.arg_names
    types = {}
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            types[name] = "*" + TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            types[name] = "i1"
        elif isinstance(value, int):
            types[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            types[name] = "fp32"
    for name in names[len(args) :]:
        types[name] = "constexpr"
    return types


def compiled(kernel, args: tuple, constants: dict, arch: str, warps: int, stages: int):
    """``kernel`` (a ``triton.jit`` function) compiled for ``arch`` with ``args`` and ``constants``: Triton's
    compiled kernel (its ``asm["cubin"]``, its ``metadata.shared``). Not under the interpreter (``TRITON_INTERPRET=1``,
    as the tests run): Triton's own functions are then the interpreter's, which the compiler cannot take (the tests
    compile in a process of their own)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if interpreted():
        raise RuntimeError("the kernels compile for a GPU only where Triton was imported without its interpreter")
    source = ASTSource(fn=kernel, signature=signature(kernel, args, constants), constexprs=constants)
    target = GPUTarget("cuda", ARCHES[arch][0], 32)
    return triton.compile(source, target=target, options={"num_warps": warps, "num_stages": stages})


def resources(cubin: bytes) -> tuple[int, int] | None:
    """The registers and stack bytes a thread of the kernel in ``cubin`` takes (``cuobjdump
    --dump-resource-usage``), or None where Triton ships no ``cuobjdump``."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    return None if found is None else (int(found[1]), int(found[2]))


def build(kernel, name: str, arch: str, what: str, args: tuple, constants: dict, config: tuple) -> Build:
    """:func:`compiled`, described: ``config`` the tiles, warps and stages."""
    tiles, warps, stages = config
    made = compiled(kernel, args, constants, arch, warps, stages)
    registers, spilled = resources(made.asm["cubin"]) or (None, None)
    dtype, dim, group = TRITON_TYPES[args[0].dtype], args[0].shape[-1], constants["GROUP"]
    return Build(name, arch, what, dtype, dim, group, tiles, warps, stages, registers, spilled, made.metadata.shared)


def sums_builds(
    arch: str = "sm_90",
    statistics: tuple[str, ...] = tuple(STATISTICS),
    dtype: torch.dtype = torch.bfloat16,
    dim: int = 128,
    group: int = 4,
) -> list[Build]:
    """The fused sums (:mod:`kvbench.kernels.sums`) for each of ``statistics`` at every tile configuration its
    autotuning tries for it (:func:`~kvbench.kernels.sums.tuned_configs`), for heads of ``dim`` channels and
    ``group`` query heads a KV head (Llama 3.1 8B's: 128, 4)."""
    from kvbench.kernels import sums

    queries, outputs = torch.zeros(1, group, 32, dim, dtype=dtype), torch.zeros(1, group, 32, dim, dtype=dtype)
    keys, values, lse = (
        torch.zeros(1, 1, 32, dim, dtype=dtype),
        torch.zeros(1, 1, 32, dim, dtype=dtype),
        torch.zeros(1, group, 32),
    )
    builds = []
    for what in statistics:
        args, constants = sums.sums_arguments(queries, keys, values, outputs, lse, dim**-0.5, STATISTICS[what])
        for config in sums.tuned_configs(STATISTICS[what]):
            tiles = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"])
            described = (tiles, config.num_warps, config.num_stages)
            tiled = {**constants, "BLOCK_M": tiles[0], "BLOCK_N": tiles[1]}
            builds.append(build(sums._sums_kernel, "sums", arch, what, args, tiled, described))
    return builds


def decode_builds(
    arch: str = "sm_90", dtype: torch.dtype = torch.bfloat16, dim: int = 128, group: int = 4, block_n: int = 64
) -> list[Build]:
    """The region attention of stored rows' decode steps (:mod:`kvbench.kernels.decode`), as it launches: one tile
    of ``block_n`` entries, Triton's default warps and stages."""
    from kvbench.kernels import decode

    queries, entries = torch.zeros(2, group, dim, dtype=dtype), torch.zeros(8, dim, dtype=dtype)
    starts, lengths = torch.zeros(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64)
    args, constants = decode.region_arguments(queries, entries, entries, starts, lengths, dim**-0.5, block_n)
    return [build(decode._decode_kernel, "decode", arch, "region attention", args, constants, ((1, block_n), 4, 3))]


def table(builds: list[Build]) -> str:
    """The builds as a Markdown table."""
    lines = [
        "| kernel | statistic | dtype, dim, group | tiles | warps, stages | registers | spilled (bytes) "
        "| shared (KiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for each in builds:
        fits = "" if each.fits else f" (over {ARCHES[each.arch][1] // 1024})"
        lines.append(
            f"| {each.kernel} | {each.what} | {each.dtype}, {each.dim}, {each.group} | {each.tiles[0]}×{each.tiles[1]} "
            f"| {each.warps}, {each.stages} | {each.registers} | {each.spilled} | {each.shared / 1024:.0f}{fits} |"
        )
    return "\n".join(lines)


def print_builds(argv: list[str]) -> int:
    """``python -m kvbench.kernels.targets [ARCH] [STATISTIC ...] [--json]``: the builds of every statistic (or those
    named) and of the region attention for ``ARCH`` (sm_90), as a Markdown table or a JSON object a line."""
    flags = [value for value in argv if value.startswith("--") and value != "--json"]
    if flags:
        print(f"kvbench: error: option {flags[0]!r} is not one of --json", file=sys.stderr)
        return 2
    named = [value for value in argv if not value.startswith("--")]
    arch, statistics = (named[0] if named else "sm_90"), tuple(named[1:]) or tuple(STATISTICS)
    if arch not in ARCHES:
        print(f"kvbench: error: architecture {arch!r} is not one of {', '.join(ARCHES)}", file=sys.stderr)
        return 2
    unknown = [each for each in statistics if each not in STATISTICS]
    if unknown:
        print(f"kvbench: error: statistic {unknown[0]!r} is not one of {', '.join(STATISTICS)}", file=sys.stderr)
        return 2
    import triton

    builds = sums_builds(arch, statistics) + decode_builds(arch) + decode_builds(arch, dim=64, group=3)
    if "--json" in argv:
        print("\n".join(json.dumps(vars(each)) for each in builds))
    else:
        print(f"Triton {triton.__version__}, {arch}, Llama 3.1 8B's heads (SmolLM2's for the second decode row):\n")
        print(table(builds))
    return 0


if __name__ == "__main__":
    raise SystemExit(print_builds(sys.argv[1:]))
