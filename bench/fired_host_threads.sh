#!/usr/bin/env bash
# Issue 49's fired step: what slows the host kernel beside the stream path after a decision (0.42x its rate alone in
# bench/results/fired_profile-h100/). The README's 6.7B command (its clip fires in every one of its first steps),
# overlapped, STEPS steps, once per entry of RUNS, in one call of 10 minutes on one H100:
#   default        as a user runs it (numba's workqueue layer; CUDA's context scheduling as XLA leaves it: AUTO, which
#                  spins a thread that waits for the GPU while the process has fewer contexts than cores);
#   blocking_sync  TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE=blocking_sync (XLA's switch of the context's flags): a thread
#                  waiting for the GPU (XLA's own, and jax_dos.memory.copy_out's cuStreamSynchronize) sleeps instead of
#                  spinning on a core the host kernel's threads share;
#   omp            NUMBA_THREADING_LAYER=omp (OpenMP's threads spin between launches and keep their cores).
# The first run also measures the calibration (about 60-70 s on a fresh machine). Steps 6-10 are the steady window.
# Writes OUT/fired_<run>.{json,log} and _metrics.jsonl (bench/readme_command.sh's files).
# Usage: OUT=/some/dir [RUNS="default blocking_sync omp"] [STEPS=10] [DEADLINE_S=560] bash bench/fired_host_threads.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/fired_host_threads}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-560} - ($(date +%s) - T0) )); }
runs=(${RUNS:-default blocking_sync omp})
for i in "${!runs[@]}"; do
  run=${runs[$i]}
  after=$(( ${#runs[@]} - i - 1 ))  # runs to come: about 130 s each, the calibration cached
  env=()
  [[ $run == blocking_sync ]] && env=(TF_CUDA_PLATFORM_GPU_DEVICE_SCHEDULE=blocking_sync)
  [[ $run == omp ]] && env=(NUMBA_THREADING_LAYER=omp)
  env "${env[@]}" OUT="$OUT" PLAIN=0 STEPS="${STEPS:-10}" NAME="fired_$run" DEADLINE_S=$(( $(left) - 130 * after )) \
    bash bench/readme_command.sh
done
for run in "${runs[@]}"; do
  python3 - "$OUT/fired_${run}_metrics.jsonl" "$run" <<'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    rows = []
windows = [(r["step"], 32768 / r["tokens_per_s"]) for r in rows if r.get("tokens_per_s")]
print(f"{sys.argv[2]:14s} seconds a step by window end: {[(s, round(t, 3)) for s, t in windows]}")
PY
done
