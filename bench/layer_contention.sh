#!/usr/bin/env bash
# Issue 49: does numba's threading layer change the host kernel's rate beside the stream path? bench/contention.py
# (the eager engine: every subgroup on the host, every one streamed, and a half/half mix that runs both paths for the
# whole step, each with jax_dos.trace's spans: host.kernel's seconds are the kernel's own) on the workqueue layer (the
# default) and on OpenMP (NUMBA_THREADING_LAYER=omp), each in a process of its own, one call of a few minutes on one
# GPU. The fired step's trace (bench/results/fired_profile-h100/) had the kernel at 0.42x its rate alone beside the
# stream path on the workqueue layer, where an earlier trace on OpenMP kept its rate (docs/overlap.md).
# Writes OUT/<layer>/contention.{json,log}.
# Usage: OUT=/some/dir [CONFIGS=8x134217728,32x33554432] [REPS=3] bash bench/layer_contention.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/layer_contention}
for layer in workqueue omp; do
  mkdir -p "$OUT/$layer"
  NUMBA_THREADING_LAYER=$layer OUT="$OUT/$layer" python3 bench/contention.py --configs "${CONFIGS:-8x134217728,32x33554432}" \
    --reps "${REPS:-3}" > "$OUT/$layer/contention.log" 2>&1
  echo "== $layer"; tail -8 "$OUT/$layer/contention.log"
done
