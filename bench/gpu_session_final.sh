#!/usr/bin/env bash
# Final checks on the GPU at the landing commit: the optax-equivalence, host-kernel and checkpoint tests on real
# pinned memory; the host kernel against torch (9 repeats); the update phase at 1B. Writes under $OUT.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  python3 -c "import sys, jax, flax, optax, numba, torch; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__, 'numba', numba.__version__, 'torch', torch.__version__)"
  git log -1 --format='%h %s' 2>/dev/null || true
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_interleaved_adam.py tests/test_errors.py tests/test_host_kernel.py \
  tests/test_checkpoint.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
python3 bench/host_kernel.py --repeats 9 2>&1 | grep -v Warn | tee "$OUT/host_kernel.log"
timeout 300 python3 bench/update_phase.py --sizes 1b --out "$OUT" 2>&1 | grep -v Warn | tail -20 | tee "$OUT/update_phase.log"
