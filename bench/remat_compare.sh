#!/usr/bin/env bash
# Rematerialisation planned beside the state's placement (issue #35), at 6.7B on one GPU, 2 micro-batches of 8 x 2048:
#   bench    the overlapped step with the clip silent under --remat full, then --remat auto (bench/train_step.py; each
#            variant in its own process). The auto run's JSON holds each policy's measured stage costs
#            (stage_times.remat: the forward/backward ceiling per policy is the sum of its forward and backward times
#            times the micro-batches), the chosen assignment (remat) and the plan's predicted step (plan_predicted).
#   train    the README's command (train.gpt, --remat auto by default) against --remat full, 30 steps each, timed from
#            outside (bench/tools/run_timed.py).
# Usage: OUT=/some/dir bash bench/remat_compare.sh [bench|train|all]   (default all; each part fits a 10-minute call)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/remat_compare}
mkdir -p "$OUT"
part=${1:-all}
if [[ $part == bench || $part == all ]]; then
  for remat in full auto; do
    python3 bench/train_step.py --preset gpt-6.7b --batch 8 --grad-accum 2 --clip 1e6 --variants peak,overlap \
      --remat "$remat" --out "$OUT/train_step_overlap_remat_$remat.json" 2>&1 | tail -4
  done
fi
if [[ $part == train || $part == all ]]; then
  for remat in full auto; do  # the README's command (bench/readme_command.sh), overlapped step only
    NAME=train_gpt_remat_$remat EXTRA="--remat $remat" PLAIN=0 STEPS=30 bash bench/readme_command.sh
  done
fi
