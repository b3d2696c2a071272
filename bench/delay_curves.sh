#!/usr/bin/env bash
# Convergence of the one-step delayed update: GPT-2 124M on the built-in corpus, every subgroup on the host kernel
# (so that the delay applies to all of the state): --delay 0, --delay 1, --delay 1 --delay-predict moments and
# --delay 1 --delay-predict gradient (after $WARMUP normal steps), same seed, data and schedule. Writes metrics_<run>.jsonl, delay_curves.log and (bench/analysis/compare_curves.py)
# curves under $OUT. RUNS picks the runs (default: "delay0 delay1 predict"); PRESET, BATCH, SEQ, LR, STEPS set the run.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
STEPS=${STEPS:-300} WARMUP=${WARMUP:-10} LR=${LR:-6e-4} RUNS=${RUNS:-"delay0 delay1 predict gradient"}
PRESET=${PRESET:-gpt2-124m} BATCH=${BATCH:-16} SEQ=${SEQ:-1024}
mkdir -p "$OUT"
declare -A FLAGS=([delay0]="--delay 0" [delay1]="--delay 1" [predict]="--delay 1 --delay-predict moments"
                  [gradient]="--delay 1 --delay-predict gradient")
curves=()
for run in $RUNS; do
  # shellcheck disable=SC2086
  python3 -m train.gpt --preset "$PRESET" --batch "$BATCH" --seq-len "$SEQ" --steps "$STEPS" --eval-every 50 \
    --log-every 10 --lr "$LR" --offload host ${FLAGS[$run]} --delay-warmup "$WARMUP" --out "/tmp/delay_runs/$run" \
    --overwrite 2>&1 | grep -v Warn | tr '\r' '\n' | grep -v "^\s*$" | tail -6
  cp "/tmp/delay_runs/$run/metrics.jsonl" "$OUT/metrics_$run.jsonl"
done 2>&1 | tee "$OUT/delay_curves.log"
for run in $RUNS; do curves+=("$run=$OUT/metrics_$run.jsonl"); done
python3 bench/analysis/compare_curves.py "$OUT/delay_curves.png" "${curves[@]}" | tee "$OUT/delay_compare.txt"
