#!/usr/bin/env bash
# GPU session, part 1: environment, the optax-equivalence tests on real pinned memory,
# the host-kernel benchmark against torch, probes, and a fresh calibration.
# Run from the repo root on the GPU machine:  bash bench/gpu_session_core.sh   (writes under $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-bench/results}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; free -g | head -2
  python3 -c "import sys, jax, flax, optax, orbax.checkpoint as ocp, numba, torch; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__, 'numba', numba.__version__, 'torch', torch.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_interleaved_adam.py tests/test_errors.py tests/test_checkpoint.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
python3 bench/host_kernel.py 2>&1 | tee "$OUT/host_kernel.log" | grep -v Warn
python3 bench/gpu_probes.py 2>&1 | grep -v Warn
python3 -c "import jax_dos, json; c = jax_dos.calibrate(force=True); print(json.dumps(c.to_dict(), indent=1))" 2>&1 | tee "$OUT/calibration.json" | tail -30
