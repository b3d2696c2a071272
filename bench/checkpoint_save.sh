#!/usr/bin/env bash
# A training run's checkpoint save on one GPU (or GPUS), phase by phase: python -m train.gpt --preset PRESET (gpt-2.7b)
# with its whole state on the host path (--offload host --overlap on: the state in pinned host memory, as most of a
# large model's is), STEPS (3) steps and the save at the end, timed from outside (bench/tools/run_timed.py: the resident
# set's course) with the main thread's stacks and Orbax's sampled every 2 s (bench/tools/stack_sampler.py) and the
# checkpoint's bytes on disk every 2 s, so that the time before the first byte is written, the writing and the manifest
# each show.
# Usage: OUT=/some/dir [PRESET=gpt-2.7b] [STEPS=3] [DEADLINE_S=300] [GPUS=0] [RUN_DIR=/tmp/checkpoint_save]
#        [FLAGS="--offload host --overlap on"] bash bench/checkpoint_save.sh
# (the 13B README command's save on two GPUs of a larger machine: PRESET=gpt-13b GPUS=0,1 FLAGS= RUN_DIR=runs/save13b,
# on a disk that holds its 180 GB)
# Writes OUT/save.json (run_timed's), OUT/save.log (the run's lines and the stacks, on one clock), OUT/disk.txt
# (seconds, bytes under the run's folder), OUT/ckpt.txt (the checkpoint's size), OUT/device.txt.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/checkpoint_save}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-dos-compile-cache}
run_dir=${RUN_DIR:-/tmp/checkpoint_save}
mkdir -p "$OUT"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | sed -n 2p
 df -h /tmp | tail -n +2
 python3 -c 'import jax, orbax.checkpoint as o; print("jax", jax.__version__, "orbax", o.__version__)'
 git rev-parse HEAD 2>/dev/null) > "$OUT/device.txt" 2>&1
rm -rf "$run_dir"
T0=$(date +%s)
(while sleep 2; do echo "$(( $(date +%s) - T0 )) $(du -sb "$run_dir" 2>/dev/null | cut -f1)"; done) > "$OUT/disk.txt" &
sampler=$!
CUDA_VISIBLE_DEVICES=${GPUS:-0} python3 bench/tools/run_timed.py --deadline-s "${DEADLINE_S:-300}" \
  --json "$OUT/save.json" --log "$OUT/save.log" -- \
  python3 bench/tools/stack_sampler.py --every 2 --match 'orbax|tensorstore|checkpoint' -- -m train.gpt \
  --preset "${PRESET:-gpt-2.7b}" --batch 8 --grad-accum 2 --steps "${STEPS:-3}" --clip 1e6 \
  ${FLAGS---offload host --overlap on} --log-every 1 --out "$run_dir" --overwrite > /dev/null
kill "$sampler" 2>/dev/null
grep -v "^ *[0-9.]* stack" "$OUT/save.log" | grep "step \|checkpoint\|host  \|done\|rror" | tail -6
du -sh "$run_dir"/ckpt/* > "$OUT/ckpt.txt" 2>&1
rm -rf "$run_dir"
