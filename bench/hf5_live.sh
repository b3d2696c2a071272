#!/usr/bin/env bash
# transformers 5's PyTorch models against models/hf.py, on a machine with torch, transformers 5 and a GPU, in one call:
#   1. tests/fixtures/hf5/make_fixtures.py --check: the committed fixtures made again by this machine's transformers
#      and torch (tensors equal, logits within 1e-5 of their scale);
#   2. tests/test_hf5.py (the CI tests of those fixtures) and tests/test_hf5_live.py (live: each family's load,
#      hf.save and fine-tune export within 1e-5 of transformers' logits, on jax's and torch's CPUs in float32; and a
#      tied model's python -m train.export beside a training run that holds 90 % of the GPU).
# Usage: OUT=/some/dir bash bench/hf5_live.sh   (about 3 minutes; writes device.txt, fixtures_check.txt, tests.txt,
# tests.xml under OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results/hf5_live}
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error TRANSFORMERS_NO_ADVISORY_WARNINGS=1
mkdir -p "$OUT"
(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
 python3 -c 'import jax, torch, transformers; print("jax", jax.__version__, "torch", torch.__version__,
 "transformers", transformers.__version__)'
 git rev-parse HEAD 2>/dev/null) > "$OUT/device.txt" 2>&1
timeout 120 python3 tests/fixtures/hf5/make_fixtures.py --check > "$OUT/fixtures_check.txt" 2>&1
echo "exit status $?" >> "$OUT/fixtures_check.txt"
JAX_PLATFORMS=cpu timeout 420 python3 -m pytest -o addopts="" -q -rs -s tests/test_hf5.py tests/test_hf5_live.py \
  --junitxml "$OUT/tests.xml" 2>&1 | grep -v -E "^(Loading weights|Writing model)" > "$OUT/tests.txt"
echo "exit status ${PIPESTATUS[0]}" >> "$OUT/tests.txt"
tail -n 5 "$OUT/fixtures_check.txt" "$OUT/tests.txt"
