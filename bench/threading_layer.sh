#!/usr/bin/env bash
# numba's threading layer and subnormal flushing on a GPU machine's host, in one call:
#   1. bench/probes/host_kernel_subnormal.py on the workqueue and OpenMP layers, flushing subnormals and keeping them
#      (the host kernels alone, gradients normal / 1.5 % tiny / all tiny);
#   2. the README's 6.7B command (bench/readme_command.sh, the overlapped step only) on the workqueue layer (the
#      default) and on OpenMP (NUMBA_THREADING_LAYER=omp, as every GPU run between 79653c4 and the layer's return),
#      STEPS steps each, with the clip as the README's command has it (EXTRA adds flags: "--clip 1e6" for a silent one).
# Writes OUT/probe_<layer>_<flush|keep>/host_kernel_subnormal.json and OUT/readme_<layer>.{json,log,_metrics.jsonl}.
# Usage: OUT=/some/dir [STEPS=25] [EXTRA=...] [DEADLINE_S=570] [PROBES=1] bash bench/threading_layer.sh
#   The four probes took 300 s of a call on an H100 machine (bench/results/threading_layer-h100/), which left the two
#   runs 124 s each, too little for the first on a fresh machine (its calibration, 56-72 s, then 100-130 s of setup):
#   PROBES=0 STEPS=12 runs only the README's command on both layers (about 230 + 160 s).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/threading_layer}
mkdir -p "$OUT"
T0=$(date +%s)
for layer in $( [[ ${PROBES:-1} == 1 ]] && echo workqueue omp ); do
  for mode in flush keep; do
    flag=""; [[ $mode == keep ]] && flag="--keep-subnormals"
    NUMBA_THREADING_LAYER=$layer OUT="$OUT/probe_${layer}_$mode" python3 bench/probes/host_kernel_subnormal.py \
      --elements 268435456 --repeats 3 $flag | tail -3
  done
done
left=$(( ${DEADLINE_S:-570} - ($(date +%s) - T0) ))
# the two runs share what is left, the first one half of it
OUT=$OUT PLAIN=0 STEPS=${STEPS:-25} NAME=readme_workqueue DEADLINE_S=$(( left / 2 )) bash bench/readme_command.sh
left=$(( ${DEADLINE_S:-570} - ($(date +%s) - T0) ))
NUMBA_THREADING_LAYER=omp OUT=$OUT PLAIN=0 STEPS=${STEPS:-25} NAME=readme_omp DEADLINE_S=$left bash bench/readme_command.sh
