#!/usr/bin/env bash
# The README's 6.7B command, unchanged, on one GPU of this machine and on all of its GPUs, in one call: what
# "all of a host's GPUs by default" gives per GPU (bench/readme_command.sh runs each, timed from outside).
#   RUNS: a list of GPUS:CLIP, GPUS a count (CUDA_VISIBLE_DEVICES=0..GPUS-1) or "all" (the default: every GPU),
#         CLIP "silent" (--clip 1e6), "fired" (the default clip 1.0, which fires at 6.7B's start) or "plain" (fired,
#         on the plain step: --overlap off)
#   EXTRA: more flags for every run; STEPS: steps a run (default 10); PRESET: the model (default gpt-6.7b)
# Usage: OUT=/some/dir RUNS="1:silent all:silent all:fired" STEPS=10 DEADLINE_S=570 bash bench/scaling.sh
# Each run writes OUT/<name>.json, .log and _metrics.jsonl, <name> = <preset>_2x8_<GPUS>gpu_<CLIP> (gpt6p7b_2x8_...).
set -uo pipefail
export OUT=${OUT:-bench/results/scaling} STEPS=${STEPS:-10} PRESET=${PRESET:-gpt-6.7b}
stem=$(echo "$PRESET" | sed 's/\./p/; s/-//g')_2x8
T0=$(date +%s)
for spec in ${RUNS:-1:silent all:silent all:fired}; do
  gpus=${spec%%:*} clip=${spec##*:}
  extra="--preset $PRESET ${EXTRA:-}"
  [[ $clip == silent ]] && extra="$extra --clip 1e6"
  [[ $clip == plain ]] && extra="$extra --overlap off"
  left=$(( ${DEADLINE_S:-570} - ($(date +%s) - T0) ))
  (( left < 60 )) && { echo "no time left for $spec"; break; }
  echo "=== $spec ($left s left)"
  if [[ $gpus == all ]]; then
    EXTRA="$extra" NAME="${stem}_${gpus}gpu_$clip" PLAIN=0 DEADLINE_S=$left bash bench/readme_command.sh
  else
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((gpus - 1))) EXTRA="$extra" NAME="${stem}_${gpus}gpu_$clip" PLAIN=0 \
      DEADLINE_S=$left bash bench/readme_command.sh
  fi
done
python3 - <<'PY'
import glob, json, os, re
out = os.environ["OUT"]
print(f"{'run':30s} {'tok/s':>8s} {'per GPU':>8s} {'exit':>5s} {'after':>6s} {'RSS GiB':>8s}  step")
for path in sorted(glob.glob(f"{out}/*_2x8_*_metrics.jsonl")):
  name = os.path.basename(path)[: -len("_metrics.jsonl")]
  rates = [r["tokens_per_s"] for r in map(json.loads, open(path)) if r.get("tokens_per_s")]
  meta = json.load(open(f"{out}/{name}.json")) if os.path.exists(f"{out}/{name}.json") else {}
  log = open(f"{out}/{name}.log").read() if os.path.exists(f"{out}/{name}.log") else ""
  n = int(m.group(1)) if (m := re.search(r"devices (\d+) x", log)) else 1
  step = m.group(1) if (m := re.search(r"step    (\w+)", log)) else "?"
  last = rates[-1] if rates else 0
  after = meta.get("exit_after_mark_s")
  print(f"{name:30s} {last:8,.0f} {last / n:8,.0f} {str(meta.get('returncode')):>5s}"
        f" {after if after is None else round(after, 1)!s:>6s} {meta.get('peak_rss_gib', 0):8.1f}  {step}")
PY
