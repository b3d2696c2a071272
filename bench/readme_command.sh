#!/usr/bin/env bash
# The README's 6.7B command as a user runs it, timed from outside (bench/tools/run_timed.py), then the same command
# with --overlap off (the plain step) on the same machine, in one call:
#   readme_6p7b        python -m train.gpt --preset gpt-6.7b --batch 8 --grad-accum 2 --no-ckpt  (+ --steps, --out)
#   readme_6p7b_plain  the same with --overlap off, stopped at the call's deadline (its metrics.jsonl keeps its steps)
# Each writes OUT/<name>.json (exit status, peak RSS, exit after the last line), .log (time-stamped output) and
# _metrics.jsonl (every step: loss, gradient norm, clip fired, tokens/s). EXTRA is added to both commands; NAME
# (default readme_6p7b) names the files.
# Usage: OUT=/some/dir STEPS=60 DEADLINE_S=585 [PLAIN=0: the first command only] [PLAIN_STEPS=20] bash \
#   bench/readme_command.sh. Both in one 600 s call: STEPS=25 PLAIN_STEPS=15 DEADLINE_S=570 (STEPS=30 PLAIN_STEPS=20
#   took 376 s and more than 215 s at 6.7B: the plain run was cut in its last validation).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/train_gpt} STEPS=${STEPS:-60}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-dos-compile-cache}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-585} - ($(date +%s) - T0) )); }
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | sed -n 2p
 python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__)'
 git rev-parse HEAD 2>/dev/null) > "$OUT/device.txt" 2>&1
run() {  # name, extra flags...
  local name=$1; shift
  python3 bench/tools/run_timed.py --deadline-s "$(left)" --json "$OUT/$name.json" --log "$OUT/$name.log" -- \
    python3 -m train.gpt --preset gpt-6.7b --batch 8 --grad-accum 2 --no-ckpt --steps "$STEPS" --log-every 5 \
    --out "/tmp/$name" --overwrite ${EXTRA:-} "$@" | tail -1  # a later --steps in "$@" wins
  cp "/tmp/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  grep -h "^ *[0-9.]* \(step    \|calibration\|memory  \|host    \|  predicted\|  rematerialisation\|clip \|done\)" "$OUT/$name.log" | head -8
}
name=${NAME:-readme_6p7b}
run "$name"
[[ ${PLAIN:-1} == 1 ]] && run "${name}_plain" --overlap off --steps "${PLAIN_STEPS:-$STEPS}"
