"""Several processes joined by ``jax.distributed``: 2 CPU processes with 2 devices each, gloo collectives.

Each process runs ``tests/multiprocess_worker.py`` (FSDP-sharded and
data-parallel parameters, every placement, against ``optax.adamw``) and
checks the shards it addresses. The processes are bounded in time and killed
if they outlive it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "multiprocess_worker.py"
CHECKPOINT_WORKER = Path(__file__).resolve().parent / "multiprocess_checkpoint_worker.py"
TIMEOUT_S = 240
CHECKS = 22  # "ok" per process: 2 layouts x (4 placements, update_params, write_behind, delay, auto), 6 whole copies


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_processes(worker: Path, *args: str, processes: int = 2, devices: int = 2) -> list[str]:
  """Runs ``worker PORT PROCESS_ID *args`` in ``processes`` CPU processes; returns their outputs (all must pass).

  A process that fails ends the others (they would wait for it in a collective); none outlives ``TIMEOUT_S``.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  port = str(_free_port())
  with tempfile.TemporaryDirectory() as tmp:
    logs = [open(Path(tmp) / f"process{i}.log", "w+") for i in range(processes)]
    command = lambda i: [sys.executable, str(worker), port, str(i), *args]  # noqa: E731
    procs = [subprocess.Popen(command(i), cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT) for i, log in
             enumerate(logs)]  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    try:
      while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
          break
        time.sleep(0.2)
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
        p.wait()
    outputs = []
    for log in logs:
      log.seek(0)
      outputs.append(log.read())
      log.close()
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0, f"process {i} failed (exit {p.returncode}; killed: timed out or another failed):\n{out}"
  return outputs


def test_two_processes_match_optax():
  seed = str(np.random.default_rng().integers(2**31))
  for out in run_processes(WORKER, seed):
    assert out.count("ok ") == CHECKS, out


def test_checkpoint_saved_by_two_processes_restores_in_two_and_in_one(tmp_path):
  """Each process writes its shards; the step restores bit-exact into 2 processes, and into 1 on other layouts."""
  seed = str(np.random.default_rng().integers(2**31))
  for out in run_processes(CHECKPOINT_WORKER, seed, str(tmp_path)):
    assert "ok restored in 2 processes" in out, out
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=4")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  command = [sys.executable, str(CHECKPOINT_WORKER), "single", str(tmp_path)]
  result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("ok restored in one process") == 2, result.stdout
