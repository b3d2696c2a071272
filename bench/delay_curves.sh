#!/usr/bin/env bash
# Convergence of the one-step delayed update: GPT-2 124M on the built-in corpus, every subgroup on the host kernel
# (so that the delay applies to all of the state), --delay 0 against --delay 1 (after $WARMUP normal steps), same seed,
# data and schedule. Writes metrics_delay<k>.jsonl, delay_curves.log and (compare_curves.py) curves under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
STEPS=${STEPS:-300} WARMUP=${WARMUP:-10} LR=${LR:-6e-4}
for delay in 0 1; do
  python3 -m train.gpt --preset gpt2-124m --batch 16 --seq-len 1024 --steps "$STEPS" --eval-every 50 --log-every 10 \
    --lr "$LR" --offload host --delay "$delay" --delay-warmup "$WARMUP" --out "/tmp/delay_runs/d$delay" --overwrite 2>&1 \
    | grep -v Warn | tr '\r' '\n' | grep -v "^\s*$" | tail -6
  cp "/tmp/delay_runs/d$delay/metrics.jsonl" "$OUT/metrics_delay$delay.jsonl"
done 2>&1 | tee "$OUT/delay_curves.log"
python3 bench/compare_curves.py "$OUT/delay_curves.png" delay0="$OUT/metrics_delay0.jsonl" \
  delay1="$OUT/metrics_delay1.jsonl" | tee "$OUT/delay_compare.txt"
