"""The Triton kernels compiled for a GPU without one (``kvbench.kernels.targets``): what the interpreter runs in the
other kernel tests is what a GPU's compiler builds, within the device's shared memory. The builds run in a process
of their own, without the interpreter these tests import Triton under (``tests/conftest.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvbench.kernels import sums, targets

#: on a GPU the other kernel tests compile and run the kernels themselves
pytestmark = [pytest.mark.kernel, pytest.mark.skipif(torch.cuda.is_available(), reason="compiled by the GPU's tests")]
triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")
tl = triton.language


def compiling(*args: str, **run) -> subprocess.CompletedProcess:
    """``python ARGS`` without Triton's interpreter."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environment, timeout=600, **run)


def builds(*args: str) -> list[targets.Build]:
    done = compiling("-m", "kvbench.kernels.targets", *args, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    return [targets.Build(**{**row, "tiles": tuple(row["tiles"])}) for row in map(json.loads, done.stdout.splitlines())]


def test_every_kernel_the_engine_launches_compiles_for_an_h100_within_its_shared_memory():
    """The fused sums at every tile its autotuning tries, H2O's weight sums and OBCache's joint error (the most
    registers and shared memory), and the stored rows' region attention on Llama 3.1 8B's and SmolLM2's heads."""
    built = builds("sm_90", "weights", "obcache_joint")
    tiles = [
        (what, ((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]), c.num_warps, c.num_stages))
        for what in ("weights", "obcache_joint")
        for c in sums.tuned_configs(targets.STATISTICS[what])
    ]
    assert [(b.what, (b.tiles, b.warps, b.stages)) for b in built[: len(tiles)]] == tiles
    assert [(b.kernel, b.dtype, b.dim, b.group) for b in built[len(tiles) :]] == [
        ("decode", "bf16", 128, 4),
        ("decode", "bf16", 64, 3),
    ]
    if built[0].spilled is not None:  # the autotuning has a tile that spills no register for each statistic
        assert all(min(b.spilled for b in built if b.what == what) == 0 for what in ("weights", "obcache_joint"))
    for each in built:
        assert each.arch == "sm_90" and 0 < each.shared and each.fits, each
        assert each.registers is None or 0 < each.registers <= 255, each
    assert "| sums | obcache_joint | bf16, 128, 4 |" in targets.table(built)


@pytest.mark.slow
def test_every_statistic_compiles_for_an_a100_within_its_shared_memory():
    built = builds("sm_80")
    assert all(each.fits for each in built), targets.table(built)


def twice(x):  # a plain Python function: the interpreter calls it, the compiler refuses it
    return x * 2


@triton.jit
def doubled(in_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, twice(tl.load(in_ptr + offsets)))


def test_the_compiler_refuses_a_kernel_the_interpreter_runs(tmp_path):
    values, out = torch.arange(16.0), torch.empty(16)
    doubled[(1,)](values, out, N=16)  # under the interpreter, as the kernel tests run
    assert torch.equal(out, 2 * values)
    script = "; ".join(
        [
            "import torch",
            "from tests.test_kernel_targets import doubled",
            "from kvbench.kernels.targets import compiled",
            "compiled(doubled, (torch.arange(16.0), torch.empty(16)), {'N': 16}, 'sm_90', 4, 3)",
        ]
    )
    done = compiling("-c", script, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode != 0 and "Unsupported function referenced" in done.stderr and "twice" in done.stderr


def test_the_builds_refuse_the_interpreter():
    with pytest.raises(RuntimeError, match="without its interpreter"):
        targets.decode_builds("sm_90")


def test_a_block_over_an_architectures_shared_memory_does_not_fit():
    made = targets.Build("decode", "sm_90", "region attention", "bf16", 128, 4, (1, 64), 4, 3, 180, 0, 22528)
    assert made.fits and not targets.Build(**{**vars(made), "shared": 227 * 1024 + 1}).fits
    assert not targets.Build(**{**vars(made), "arch": "sm_80", "shared": 164 * 1024}).fits


@pytest.mark.parametrize(
    "args, line",
    [
        (["sm_70"], "architecture 'sm_70' is not one of sm_90, sm_80"),
        (["sm_90", "snapkv"], "statistic 'snapkv' is not one of weights, obcache_value, obcache_key, obcache_joint"),
        (["sm_90", "--jsn"], "option '--jsn' is not one of --json"),
    ],
)
def test_a_bad_value_is_one_line(capsys, args, line):
    assert targets.print_builds(args) == 2
    assert capsys.readouterr().err.splitlines() == [f"kvbench: error: {line}"]


def test_the_statistics_are_the_policies_terms():
    from kvbench.policies.scores import OBCACHE_TERMS

    assert targets.STATISTICS == {
        "weights": None,
        **{f"obcache_{kind}": terms for kind, terms in OBCACHE_TERMS.items()},
    }
