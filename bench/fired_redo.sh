#!/usr/bin/env bash
# Issue 49's fired step: the README's 6.7B command (its clip fires in every one of its first steps), overlapped, with
# the host subgroups' redo after the decision on the host kernel alone (JAX_DOS_FIRED_REDO_ON_STREAM=0) and shared
# with the stream path (the default, jax_dos.planning.fired.fired_share), then the plain step (--overlap off), STEPS steps
# each, in one call of 10 minutes on one H100. Writes OUT/redo_{host_only,shared,plain}.{json,log} and _metrics.jsonl.
# Usage: OUT=/some/dir [STEPS=12] [DEADLINE_S=520] bash bench/fired_redo.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/fired_redo}
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-520} - ($(date +%s) - T0) )); }
JAX_DOS_FIRED_REDO_ON_STREAM=0 OUT=$OUT PLAIN=0 STEPS=${STEPS:-12} NAME=redo_host_only DEADLINE_S=$(( $(left) - 270 )) \
  bash bench/readme_command.sh
OUT=$OUT PLAIN=0 STEPS=${STEPS:-12} NAME=redo_shared DEADLINE_S=$(( $(left) - 120 )) bash bench/readme_command.sh
OUT=$OUT PLAIN=0 STEPS=10 NAME=redo_plain EXTRA="--overlap off" DEADLINE_S=$(left) bash bench/readme_command.sh
