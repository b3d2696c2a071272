#!/usr/bin/env bash
# GPT-2 124M on the built-in corpus, 200 steps, with the optimizer on the GPU (optax.adamw, fp32 params) and with
# jax_dos (auto plan; and every subgroup on the host kernel), bf16 params from an fp32 master. Curves must agree to
# within bf16 noise. Writes metrics_<mode>.jsonl, loss_<mode>.png and gpt124m_curves.log under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
for mode in none auto host; do
  python3 -m train.gpt --preset gpt2-124m --batch 16 --seq-len 1024 --steps 200 --eval-every 50 --log-every 10 \
    --offload "$mode" --out "/tmp/gpt_runs/$mode" --overwrite --plot 2>&1 | grep -v Warn | tr '\r' '\n' | grep -v "^\s*$" | tail -8
  cp "/tmp/gpt_runs/$mode/metrics.jsonl" "$OUT/metrics_$mode.jsonl"; cp "/tmp/gpt_runs/$mode/loss.png" "$OUT/loss_$mode.png"
done 2>&1 | tee "$OUT/gpt124m_curves.log"
