#!/usr/bin/env bash
# Issue 68 on one GPU: the 2.7B GPT (PRESET) stopped by SIGTERM in the middle of a run, its step saved, resumed with
# the losses of an uninterrupted run; and what a periodic save costs the steps, waited for and written beside them
# (bench/stop_resume.py says how each is measured).
# Usage: OUT=/some/dir [PART=stop|cost] [PRESET=gpt-2.7b] [RUN_DIR=/tmp/stop_resume] [DEADLINE_S=470]
#        [FLAGS="--batch 8 --grad-accum 2 --clip 1e6"] bash bench/stop_resume.sh
# Each PART fits one call of 8 minutes on an H100 (the first run of a machine also measures its calibration); run
# PART=stop, then PART=cost (and PART=cost PRESET=gpt-1.3b for a save beside the steps where the 2.7B's copies do not
# fit the host's memory). Writes OUT/device.txt, OUT/<PART>.json and each run's OUT/<name>.log. The 2.7B checkpoint
# takes 35 GB of disk under RUN_DIR (removed at the end).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/stop_resume}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-dos-compile-cache}
mkdir -p "$OUT"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | sed -n 2p
 df -h /tmp | tail -n +2
 python3 -c 'import jax, orbax.checkpoint as o; print("jax", jax.__version__, "orbax", o.__version__)'
 git rev-parse HEAD 2>/dev/null) > "$OUT/device.txt" 2>&1
python3 bench/stop_resume.py "${PART:-stop}" --out "$OUT" --preset "${PRESET:-gpt-2.7b}" \
  --run-dir "${RUN_DIR:-/tmp/stop_resume}" --deadline-s "${DEADLINE_S:-470}" ${FLAGS:---batch 8 --grad-accum 2 --clip 1e6}
