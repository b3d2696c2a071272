#!/usr/bin/env bash
# Issue 49, item 4: the host kernels at the vector width LLVM picks for this CPU (Intel's server cores: 256 bits, the
# prefer-256-bit tuning) and at 512 bits (the host's features with -prefer-256-bit), each in a process of its own
# (numba reads its CPU features once, at import): bench/probes/host_kernel_bound.py at THREADS threads, its kernels,
# variants and traffic twins over ELEMENTS parameters, one core in cache, and the asm's register widths.
# Writes OUT/<width>/host_kernel_bound.{json,log}, width: default, zmm.
# Usage: OUT=/some/dir [THREADS="8 16"] [ELEMENTS=134217728] [BUDGET_S=150] [TIMEOUT_S=600: each process] bash \
#   bench/host_kernel_width.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/host_kernel_width}
cpu_name=$(python3 -c 'import llvmlite.binding as l; print(l.get_host_cpu_name())')
features=$(python3 -c 'import llvmlite.binding as l; print(l.get_host_cpu_features().flatten())')
for width in default zmm; do
  mkdir -p "$OUT/$width"
  env=()
  [[ $width == zmm ]] && env=(NUMBA_CPU_NAME="$cpu_name" NUMBA_CPU_FEATURES="$features,-prefer-256-bit")
  env "${env[@]}" OUT="$OUT/$width" timeout "${TIMEOUT_S:-600}" python3 bench/probes/host_kernel_bound.py \
    --elements "${ELEMENTS:-134217728}" --threads ${THREADS:-8 16} --stream-elements "${ELEMENTS:-134217728}" \
    --budget-s "${BUDGET_S:-150}" \
    > "$OUT/$width/host_kernel_bound.log" 2>&1
  echo "== $width"; grep "^asm\|^kernels\|^stream\|^core\|^same" "$OUT/$width/host_kernel_bound.log" | cut -c1-400
done
