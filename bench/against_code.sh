#!/usr/bin/env bash
# The README's 6.7B command on this code against the same command on other code, on one GPU, in one call: a
# redesign's "speed unchanged". BEFORE is a folder holding the other code's jax_dos/, models/, train/ and
# bench/tools/ (e.g. `git archive COMMIT jax_dos models train bench/tools | tar -x -C .before && echo COMMIT >
# .before/COMMIT`, carried to the machine). Runs alternate, ours then before for the first clip setting, before then
# ours for the next (so that a drift of the machine weighs on both), through bench/readme_command.sh (timed from
# outside).
#   CLIPS: "silent fired" (default): silent = --clip 1e6, fired = the default clip 1.0 (fires at 6.7B's start)
#   STEPS: steps a run (default 15); EXTRA: more flags for every run
# Usage: OUT=/abs/dir BEFORE=.before [CLIPS="silent fired"] [STEPS=15] [DEADLINE_S=580] bash bench/against_code.sh
# Each run writes OUT/<clip>_<ours|before>.json, .log and _metrics.jsonl; the last lines compare them.
set -uo pipefail
export OUT=${OUT:?an absolute OUT} STEPS=${STEPS:-15}
before=$(cd "${BEFORE:?the other code folder}" && pwd)
T0=$(date +%s)
mkdir -p "$OUT"
# The other code's commit: its COMMIT file (a `git archive` has no .git of its own), else its checkout's HEAD.
cat "$before/COMMIT" 2>/dev/null > "$OUT/before_commit.txt" ||
  (cd "$before" && git rev-parse HEAD) > "$OUT/before_commit.txt"
flip=0
for clip in ${CLIPS:-silent fired}; do
  extra=${EXTRA:-}
  [[ $clip == silent ]] && extra="$extra --clip 1e6"
  order="ours before"; (( flip )) && order="before ours"; flip=$((1 - flip))
  for code in $order; do
    left=$(( ${DEADLINE_S:-580} - ($(date +%s) - T0) ))
    (( left < 60 )) && { echo "no time left for ${clip}_$code"; continue; }
    echo "=== ${clip}_$code ($left s left)"
    if [[ $code == ours ]]; then
      EXTRA="$extra" NAME="${clip}_$code" PLAIN=0 DEADLINE_S=$left bash bench/readme_command.sh
    else
      (cd "$before" && EXTRA="$extra" NAME="${clip}_$code" PLAIN=0 DEADLINE_S=$left \
        bash "$OLDPWD/bench/readme_command.sh")
    fi
  done
done
python3 - <<'PY'
import glob, json, os
out = os.environ["OUT"]
rate = {}
for path in sorted(glob.glob(f"{out}/*_metrics.jsonl")):
  name = os.path.basename(path)[: -len("_metrics.jsonl")]
  rows = [r for r in map(json.loads, open(path)) if r.get("tokens_per_s")]
  rate[name] = rows[-1]["tokens_per_s"] if rows else None  # the last window (steps after the first windows' warm-up)
  print(f"{name:16s} {rate[name] or 0:9,.0f} tokens/s at step {rows[-1]['step'] if rows else '-'}")
for clip in ("silent", "fired"):
  if rate.get(f"{clip}_ours") and rate.get(f"{clip}_before"):
    print(f"{clip}: ours / before = {rate[f'{clip}_ours'] / rate[f'{clip}_before']:.3f}")
PY
