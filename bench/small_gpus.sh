#!/usr/bin/env bash
# The README's 6.7B command on one GPU held to a smaller card's memory (XLA_PYTHON_CLIENT_MEM_FRACTION) against the
# same command on the whole GPU, in one call, each run timed from outside (bench/tools/run_timed.py):
#   whole_<clip>   python -m train.gpt --preset gpt-6.7b --batch 8 --grad-accum 2 --no-ckpt   (the README's command)
#   card24_<clip>  the same 16 sequences of 2048 a step as --batch 4 --grad-accum 4, the GPU held to 22.5 GiB
#                  (0.2825 of an 80 GB H100's 81,559 MiB: a 24 GB card's memory)
# CLIP=silent adds --clip 1e6 (the clip never fires), CLIP=fired keeps the default 1.0 (it fires in every step).
# REFUSALS=1 also runs what no plan holds there (the 13B with int8 moments on 22.5 GiB, the 6.7B on 11 GiB: both need
# their weights on the GPU) and a probe of what the GPU reports under XLA_PYTHON_CLIENT_PREALLOCATE=false.
# TINY=1 runs the README's first command with XLA_PYTHON_CLIENT_PREALLOCATE=false.
# Everything goes to OUT/small_gpus.tar.gz (logs, JSON, metrics) and OUT/summary_<clip>.txt (the lines to read).
# Usage: OUT=/some/dir CLIP=silent STEPS=10 [REFUSALS=1] [TINY=1] bash bench/small_gpus.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 STEPS=${STEPS:-10} CLIP=${CLIP:-silent}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-dos-compile-cache}
work=/tmp/small_gpus; mkdir -p "$work" "$OUT"
summary=$OUT/summary_$CLIP.txt
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-580} - ($(date +%s) - T0) )); }
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | sed -n 2p
 python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__)'
 git rev-parse HEAD 2>/dev/null) > "$work/device.txt" 2>&1
cat "$work/device.txt" >> "$summary"
clip=(); [[ $CLIP == silent ]] && clip=(--clip 1e6)
run() {  # name, memory fraction ("" for train.gpt's default), flags...
  local name=$1 fraction=$2; shift 2
  echo "== $name (XLA_PYTHON_CLIENT_MEM_FRACTION=${fraction:-default}) $*" >> "$summary"
  env ${fraction:+XLA_PYTHON_CLIENT_MEM_FRACTION=$fraction} python3 bench/tools/run_timed.py --deadline-s "$(left)" \
    --json "$work/$name.json" --log "$work/$name.log" --mark 'done: step' -- \
    python3 -m train.gpt --no-ckpt --log-every 5 --out "/tmp/$name" --overwrite "$@" | tail -1 >> "$summary"
  cp "/tmp/$name/metrics.jsonl" "$work/${name}_metrics.jsonl" 2>/dev/null
  grep -h "^ *[0-9.]* *\(gpu     \|step    \|memory  \|host    \|error\|done\|  predicted\)" "$work/$name.log" | cut -c1-400 >> "$summary"
  python3 - "$work/${name}_metrics.jsonl" >> "$summary" 2>/dev/null <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tokens_per_s"' in l]
print("tokens/s at logged steps:", [(r["step"], round(r["tokens_per_s"])) for r in rows])
PY
}
gpt67=(--preset gpt-6.7b --steps "$STEPS" "${clip[@]}")
run "whole_$CLIP" "" "${gpt67[@]}" --batch 8 --grad-accum 2
run "card24_$CLIP" 0.2825 "${gpt67[@]}" --batch 4 --grad-accum 4
if [[ ${REFUSALS:-0} == 1 ]]; then
  run refused_13b_int8_card24 0.2825 --preset gpt-13b --moments int8 --batch 4 --grad-accum 4 --steps 2
  run refused_6p7b_card12 0.138 --preset gpt-6.7b --batch 4 --grad-accum 4 --steps 2
  for alloc in cuda_async default; do
    echo "== memory_stats, XLA_PYTHON_CLIENT_PREALLOCATE=false, allocator $alloc" >> "$summary"
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=$alloc python3 -c '
import jax, jax_dos, jax.numpy as jnp
d = jax.local_devices()[0]; print("before", d.memory_stats()); print(jax_dos.DeviceMemory.of(d).describe())
x = jnp.ones((1 << 28,), jnp.float32); x.block_until_ready()
print("after 1 GiB", {k: v for k, v in d.memory_stats().items() if "limit" in k or "in_use" in k})
print(jax_dos.DeviceMemory.of(d).describe())' >> "$summary" 2>&1
  done
fi
if [[ ${TINY:-0} == 1 ]]; then
  echo "== the README's first command, XLA_PYTHON_CLIENT_PREALLOCATE=false" >> "$summary"
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/tools/run_timed.py --deadline-s "$(left)" --json "$work/tiny_noprealloc.json" \
    --log "$work/tiny_noprealloc.log" --mark 'done: step' -- python3 -m train.gpt --out /tmp/tiny_noprealloc --overwrite \
    | tail -1 >> "$summary"
  grep -h "gpu     \|step    \|done\|error" "$work/tiny_noprealloc.log" | cut -c1-300 >> "$summary"
fi
tar czf "$OUT/small_gpus_$CLIP.tar.gz" -C "$work" .
cat "$summary"
