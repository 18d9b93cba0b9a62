#!/usr/bin/env bash
# CPU threading A/B (docs/benchmarks.md, "Threads"): the same kvbench run (SnapKV@128, RULER niah_single_1 at 1k,
# 3 samples, SmolLM2) beside a one-core busy loop and alone, each configuration in turn, twice. A configuration is
# LABEL:SOURCE:ENV — SOURCE a kvbench checkout put first on PYTHONPATH (e.g. one made by `git archive` of an older
# commit), ENV one VAR=VALUE. Prints "label load seconds" per run (seconds of the whole command, model load included).
#   scripts/threads_ab.sh before:/tmp/old:X=1 before-omp1:/tmp/old:OMP_NUM_THREADS=1 after:$PWD:X=1
set -euo pipefail
KVBENCH=${KVBENCH:-$(dirname "$0")/../.venv/bin/kvbench}
KVBENCH=$(realpath "$KVBENCH")
work=$(mktemp -d)
trap 'rm -rf "$work"; [ -n "${load_pid:-}" ] && kill "$load_pid" 2>/dev/null || true' EXIT
one_run() {  # label source env load
  local out="$work/run-$RANDOM$RANDOM" started finished
  started=$(date +%s.%N)
  (cd "$work" && env PYTHONPATH="$2" "$3" "$KVBENCH" run model=smollm2_135m policy=snapkv budget=128 task=ruler \
    'task.subtasks=[niah_single_1]' task.context_length=1024 task.num_samples=3 output_dir="$out" >/dev/null 2>&1)
  finished=$(date +%s.%N)
  printf '%s %s %.1f\n' "$1" "$4" "$(echo "$finished - $started" | bc)"
}
for load in busy none; do
  for repetition in 1 2; do
    load_pid=
    if [ "$load" = busy ]; then python3 -c 'while True: pass' & load_pid=$!; fi
    for configuration in "$@"; do
      IFS=: read -r label source environment <<<"$configuration"
      one_run "$label" "$source" "$environment" "$load"
    done
    if [ -n "$load_pid" ]; then kill "$load_pid"; load_pid=; fi
  done
done
