#!/usr/bin/env bash
# Issue 49, item 3: the README's 6.7B command with its clip firing (the default clip, 1.0, fires in every step of a
# fresh run), overlapped (--overlap auto, which plans for the share of steps the first batch's gradient norm says will
# fire) beside the plain step (--overlap off), with float32 then bfloat16 moments, in one call of 10 minutes on one
# H100; then each pair's measured step beside the model's predictions and the fired step's bound
# (bench/analysis/fired_summary.py, also written to OUT/summary.txt). Each run's files are bench/readme_command.sh's:
# OUT/fired_<moments>{,_plain}.{json,log} and _metrics.jsonl.
# Usage: OUT=/some/dir bash bench/fired_bound.sh [MOMENTS="float32 bfloat16" STEPS=10 PLAIN_STEPS=10 DEADLINE_S=560
#   RESERVE_S=230]. On a fresh machine the first run also measures the calibration and compiles with a cold cache
#   (the float32 overlapped run took 200 s there, and its plain run, left 84 s, was stopped while it set up:
#   bench/results/fired_bound-h100/): MOMENTS=float32 gives one pair the whole call.
#   10 steps a run: the window of steps 6-10 is measured (the first holds the compilation). DEADLINE_S: 560, so
#   that a run stopped there (SIGINT, SIGKILL 30 s later: bench/tools/run_timed.py) still ends within a call of
#   600 s. RESERVE_S: the seconds the float32 pair leaves to the bfloat16 pair (from the committed logs: about 135 s
#   overlapped and 75 s plain once the first pair has measured the calibration, about 60 s, and filled the compile
#   cache).
set -uo pipefail
export OUT=${OUT:-bench/results/fired_bound}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-560} - ($(date +%s) - T0) )); }
pair() {  # moments, deadline in seconds from now
  OUT=$OUT STEPS=${STEPS:-10} PLAIN_STEPS=${PLAIN_STEPS:-10} NAME=fired_$1 EXTRA="--moments $1" DEADLINE_S=$2 \
    bash bench/readme_command.sh
}
moments=(${MOMENTS:-float32 bfloat16})
for i in "${!moments[@]}"; do  # each pair but the last leaves RESERVE_S to the pairs after it
  after=$(( ${#moments[@]} - i - 1 ))
  pair "${moments[$i]}" $(( $(left) - (after > 0 ? ${RESERVE_S:-230} * after : 10) ))
done
PYTHONPATH=$PWD python3 bench/analysis/fired_summary.py "$OUT" | tee "$OUT/summary.txt"
