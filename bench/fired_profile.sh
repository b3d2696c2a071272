#!/usr/bin/env bash
# Issue 49's fired step on one H100, in one call of 10 minutes:
#   1. bench/probes/host_kernel_bound.py on this machine's cores (the kernels against their traffic twins, the
#      reciprocal-weight variants, the stream rates), at most PROBE_S seconds;
#   2. the README's 6.7B command (its clip fires in every one of its first steps), overlapped, STEPS steps, profiled in
#      steps PROFILE (train.gpt --profile: jax.profiler's trace, summarised here by bench/probes/trace_summary.py, and
#      jax_dos's host spans, profile/spans.json), so that the window of steps 6-10 runs unprofiled;
#   3. the same command with --overlap off (the plain step), PLAIN_STEPS steps, to the call's deadline.
# Writes OUT/probe/host_kernel_bound.{json,log}, OUT/readme_fired{,_plain}.{json,log} and _metrics.jsonl,
# OUT/readme_fired_spans.json and OUT/readme_fired_trace_summary.json.
# Usage: OUT=/some/dir [STEPS=15] [PROFILE=12:14] [PLAIN_STEPS=10] [PROBE_S=120] [DEADLINE_S=560] bash bench/fired_profile.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/fired_profile}
mkdir -p "$OUT/probe"
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-560} - ($(date +%s) - T0) )); }
OUT=$OUT/probe timeout "${PROBE_S:-120}" python3 bench/probes/host_kernel_bound.py --elements 134217728 --threads 8 16 \
  --stream-elements 134217728 --budget-s 40 > "$OUT/probe/host_kernel_bound.log" 2>&1
grep "^kernels\|^stream\|^core\|^same" "$OUT/probe/host_kernel_bound.log"
# the overlapped run gets what is left but the plain run's (about 110 s from the committed logs)
OUT=$OUT PLAIN=0 STEPS=${STEPS:-15} NAME=readme_fired EXTRA="--profile ${PROFILE:-12:14}" \
  DEADLINE_S=$(( $(left) - 120 )) bash bench/readme_command.sh
cp /tmp/readme_fired/profile/spans.json "$OUT/readme_fired_spans.json"
python3 bench/probes/trace_summary.py /tmp/readme_fired/profile --json "$OUT/readme_fired_trace_summary.json" \
  > "$OUT/readme_fired_trace_summary.txt" 2>&1
head -30 "$OUT/readme_fired_trace_summary.txt"  # not piped: a closed pipe stopped the summary before its JSON
OUT=$OUT PLAIN=0 STEPS=${PLAIN_STEPS:-10} NAME=readme_fired_plain EXTRA="--overlap off" DEADLINE_S=$(( $(left) )) \
  bash bench/readme_command.sh
