#!/usr/bin/env bash
# Fine-tuning a Hugging Face checkpoint against training the same model from scratch, on one GPU, in one call:
#   1. bench/pretrained_checkpoint.py writes a random-weight checkpoint of PRESET (default llama-7b) in Hugging Face's
#      format (models.hf.save), its tokenizer, and prompt/completion rows of the built-in corpus (timed);
#   2. scratch:   python -m train.gpt --arch llama --preset PRESET                  (the built-in corpus, bytes)
#   3. init_from: python -m train.gpt --init-from CHECKPOINT --data ROWS.jsonl      (the checkpoint's tokenizer)
#   (scratch_rows: python -m train.gpt --arch llama --preset PRESET --data ROWS.jsonl --tokenizer CHECKPOINT: the
#   init-from run's data from random weights, to tell the data's share of a difference from the weights')
# both with --batch 8 --grad-accum 2 --seq-len 2048 --steps STEPS --clip 1e6 (the clip silent in both, so that the
# steps compare) and EXTRA, each timed from outside (bench/tools/run_timed.py: exit status, peak RSS, exit after the
# last line) with its time-stamped log (the setup phases and the time to the first step) and metrics.jsonl.
# Usage: OUT=/some/dir [PRESET=llama-7b] [STEPS=15] [RUNS="scratch init_from"] [DEADLINE_S=570] bash bench/fine_tune.sh
# (RUNS: the runs in their order, of scratch, init_from and scratch_rows)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/fine_tune} STEPS=${STEPS:-15}
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-dos-compile-cache}
preset=${PRESET:-llama-7b} ckpt=/tmp/hf-$preset rows=/tmp/hf-$preset-rows.jsonl
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $(( ${DEADLINE_S:-570} - ($(date +%s) - T0) )); }
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc; free -g | sed -n 2p
 python3 -c 'import jax, flax, optax, safetensors, tokenizers; print("jax", jax.__version__, "flax", flax.__version__,
 "optax", optax.__version__, "safetensors", safetensors.__version__, "tokenizers", tokenizers.__version__)'
 git rev-parse HEAD 2>/dev/null) > "$OUT/device.txt" 2>&1
rm -rf "$ckpt"
python3 bench/pretrained_checkpoint.py --preset "$preset" --out "$ckpt" --rows "$rows" 2>&1 | tail -3 |
  tee "$OUT/checkpoint.txt"
run() {  # name, flags...
  local name=$1; shift
  python3 bench/tools/run_timed.py --deadline-s "$(left)" --json "$OUT/$name.json" --log "$OUT/$name.log" -- \
    python3 -m train.gpt "$@" --batch 8 --grad-accum 2 --seq-len 2048 --steps "$STEPS" --clip 1e6 --no-ckpt \
    --log-every 5 --out "/tmp/$name" --overwrite ${EXTRA:-} | tail -1
  cp "/tmp/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  grep -h "^ *[0-9.]* \(model   \|data    \|step    \|setup\|memory  \|host    \|  predicted\|clip \|done\)" \
    "$OUT/$name.log" | head -12
}
for which in ${RUNS:-scratch init_from}; do
  case $which in
    scratch) run "${preset//[-.]/_}_scratch" --arch llama --preset "$preset" ;;
    init_from) run "${preset//[-.]/_}_init_from" --init-from "$ckpt" --data "$rows" ;;
    scratch_rows) run "${preset//[-.]/_}_scratch_rows" --arch llama --preset "$preset" --data "$rows" --tokenizer "$ckpt" ;;
    *) echo "unknown run $which (scratch, init_from, scratch_rows)"; exit 2 ;;
  esac
done
