#!/usr/bin/env bash
# Models whose state no GPU holds, on a machine of several GPUs, each a user's command timed from outside
# (bench/tools/run_timed.py: exit status, peak RSS, exit after the last line):
#   30b     python -m train.gpt --preset gpt-30b --mesh fsdp=4 --moments bfloat16 --batch 4 --grad-accum 2 --no-ckpt
#           --clip 1e6 --steps 20: the parameters sharded over the 4 GPUs, the state over them and their host
#   save    the README's command with --preset $SAVE_PRESET (gpt-13b) and --clip $SAVE_CLIP (1e6: silent) on GPUs
#           $SAVE_GPUS (0,1: --mesh data=2), saving its checkpoint at the end to runs/<preset>_saved (kept on the
#           machine while it stays warm)
#   resume  that checkpoint resumed on GPU 0 with --moments int8 (the format converted as it is read) and
#           --grad-accum $RESUME_ACCUM (4: the same 32 rows a step as two GPUs saving), RESUME_STEPS more steps
# The runs of STAGES go in turn while DEADLINE_S allows; a stage that needs more than is left is skipped. On H200s
# each GPU is held to an H100's memory (XLA_PYTHON_CLIENT_MEM_FRACTION=0.533: the 76.6 GiB train.gpt takes of 80 GB).
# Usage: OUT=/some/dir STAGES="30b save" DEADLINE_S=540 bash bench/large_models.sh
# Each run writes OUT/<stage>.json, .log and _metrics.jsonl; OUT/device.txt the machine, OUT/<stage>_ckpt.txt the
# checkpoint's size, OUT/<stage>.log the main thread's stacks and Orbax's every 5 s (bench/tools/stack_sampler.py) among
# the run's lines, OUT/<stage>_disk.txt the bytes under runs/ every 5 s (seconds since the script's start: a save's
# and a restore's pace, T0 of the log's clock less the stage's start).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/large_models}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-dos-compile-cache}
mkdir -p "$OUT" runs
T0=$(date +%s)
# 540: a run stopped at the deadline has 30 s to end (then SIGKILL) inside a 600 s call
left() { echo $(( ${DEADLINE_S:-540} - ($(date +%s) - T0) )); }
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | sed -n 2p
 df -h "$PWD" /tmp | tail -n +2
 python3 -c 'import jax, flax, optax, orbax.checkpoint as o; print("jax", jax.__version__, "flax", flax.__version__,
 "optax", optax.__version__, "orbax", o.__version__)'
 git rev-parse HEAD 2>/dev/null) > "$OUT/device.txt" 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && export XLA_PYTHON_CLIENT_MEM_FRACTION=0.533
SAVE_PRESET=${SAVE_PRESET:-gpt-13b}; CKPT=runs/${SAVE_PRESET}_saved
README=(--preset "$SAVE_PRESET" --batch 8 --grad-accum 2)  # the README's command with --preset X, but --no-ckpt
run() {  # stage, seconds it needs at least, CUDA_VISIBLE_DEVICES, flags...
  local stage=$1 need=$2 gpus=$3; shift 3
  if (( $(left) < need )); then echo "=== $stage skipped: $(left) s left, it needs $need"; return; fi
  echo "=== $stage ($(left) s left)"
  (while sleep 5; do echo "$(( $(date +%s) - T0 )) $(du -sb runs 2>/dev/null | cut -f1)"; done) > "$OUT/${stage}_disk.txt" &
  local sampler=$!
  CUDA_VISIBLE_DEVICES=$gpus python3 bench/tools/run_timed.py --deadline-s "$(left)" --json "$OUT/$stage.json" \
    --log "$OUT/$stage.log" -- python3 bench/tools/stack_sampler.py --every 5 --match 'orbax|tensorstore|checkpoint' \
    -- -m train.gpt --log-every 5 "$@" | tail -c 400
  grep -h "^ *[0-9.]* \(devices\|step    \|memory  \|host    \|  predicted\|clip \|done\|checkpoint\|ckpt    \|resum\|warning\)" \
    "$OUT/$stage.log" | head -12
  kill "$sampler" 2>/dev/null
}
for stage in ${STAGES:-30b save resume}; do
  case $stage in
    30b) run 30b 400 0,1,2,3 --preset gpt-30b --mesh fsdp=4 --moments bfloat16 --batch 4 --grad-accum 2 --no-ckpt \
           --clip 1e6 --steps "${STEPS_30B:-20}" --out /tmp/gpt30b --overwrite
         cp /tmp/gpt30b/metrics.jsonl "$OUT/30b_metrics.jsonl" 2>/dev/null ;;
    save) run save 400 "${SAVE_GPUS:-0,1}" "${README[@]}" --clip "${SAVE_CLIP:-1e6}" --steps "${SAVE_STEPS:-12}" \
            --out "$CKPT" --overwrite
          cp "$CKPT/metrics.jsonl" "$OUT/save_metrics.jsonl" 2>/dev/null
          du -sh "$CKPT"/ckpt/* > "$OUT/save_ckpt.txt" 2>&1 ;;
    resume) steps=$(( ${SAVE_STEPS:-12} + ${RESUME_STEPS:-4} ))
            run resume 200 0 "${README[@]}" --grad-accum "${RESUME_ACCUM:-4}" --moments int8 --clip "${SAVE_CLIP:-1e6}" --steps "$steps" \
              --resume \
              --no-ckpt --out "$CKPT"
            cp "$CKPT/metrics.jsonl" "$OUT/resume_metrics.jsonl" 2>/dev/null ;;
    *) echo "unknown stage $stage (30b, save, resume)"; exit 2 ;;
  esac
done
