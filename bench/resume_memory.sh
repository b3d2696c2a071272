#!/usr/bin/env bash
# A run, its checkpoint and its resume, each timed from outside (bench/tools/run_timed.py: the resident set's course
# and peak, the seconds the process takes to end after its last line), to hold a resumed process's host memory
# against a fresh one's and against the need it prints. The run: python -m train.gpt --preset PRESET (gpt-2.7b) with
# FLAGS (its whole state on the host path: --offload host --overlap on), STEPS (3) steps, saved at the end; the resume:
# --resume for 2 steps more, writing nothing (--no-ckpt). With BASELINE (a folder holding another commit's jax_dos,
# train and models: git archive COMMIT jax_dos train models | tar -x -C build/baseline), the same resume again from that
# folder's code, beside it.
# Writes OUT/{run,resume,resume_baseline}.{json,log} and OUT/device.txt. A checkpoint of the 2.7B GPT takes 35 GB of
# disk under RUN_DIR.
# Usage: OUT=/some/dir [PRESET=gpt-2.7b] [STEPS=3] [FLAGS="--offload host --overlap on"] [DEADLINE_S=540]
#        [RUN_DIR=/tmp/resume_memory] [BASELINE=build/baseline] bash bench/resume_memory.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/resume_memory}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-dos-compile-cache}
run_dir=${RUN_DIR:-/tmp/resume_memory}
here=$PWD
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the baseline runs from its own folder
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-540} - ($(date +%s) - T0) )); }
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | sed -n 2p
 df -h /tmp | tail -n +2
 python3 -c 'import jax, orbax.checkpoint as o; print("jax", jax.__version__, "orbax", o.__version__)'
 git rev-parse HEAD 2>/dev/null) > "$OUT/device.txt" 2>&1
rm -rf "$run_dir"
run() {  # name, source folder, flags...
  local name=$1 src=$2; shift 2
  (cd "$src" && PYTHONPATH=$PWD python3 "$here/bench/tools/run_timed.py" --deadline-s "$(left)" \
    --json "$OUT/$name.json" --log "$OUT/$name.log" -- \
    python3 -m train.gpt --preset "${PRESET:-gpt-2.7b}" --batch 8 --grad-accum 2 --clip 1e6 \
    ${FLAGS---offload host --overlap on} --log-every 1 --out "$run_dir" "$@" > /dev/null)
  echo "== $name"
  grep -h "host    \|step    \|checkpoint\|rror\|done" "$OUT/$name.log" | cut -c1-250 | tail -6
  python3 -c "import json; d = json.load(open('$OUT/$name.json')); print({k: d.get(k) for k in
    ('returncode', 'wall_s', 'exit_after_mark_s', 'peak_rss_gib', 'peak_machine_used_gib')},
    'rss at the end', d.get('rss_series', [])[-3:])"
}
run run "$here" --steps "${STEPS:-3}" --overwrite
run resume "$here" --steps $(( ${STEPS:-3} + 2 )) --resume --no-ckpt
[[ -n ${BASELINE:-} ]] && run resume_baseline "$BASELINE" --steps $(( ${STEPS:-3} + 2 )) --resume --no-ckpt
du -sh "$run_dir"/ckpt/* 2>/dev/null | tail -2
rm -rf "$run_dir"
