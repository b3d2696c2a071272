"""The planner's calibration for a run of ``train.gpt`` (``--offload auto`` on an accelerator): measured once a
machine and cached, in a process of its own where it can be, before the run's GPU client starts."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import time

import jax

import jax_dos
from train.flags import Flags

CALIBRATION_APART_S = 600  # the calibration takes 20-30 s on a GPU; a child that takes this long is given up


def measure_apart(args: Flags, gpu: bool | None = None) -> bool:
  """On a GPU machine whose calibration is not cached (``gpu``: an NVIDIA driver here, unless ``JAX_PLATFORMS`` rules
  CUDA out), the planner's calibration measured in a process of its own, as the benchmarks do, before this process
  starts its GPU client; whether it ran and succeeded. Measured here, its pinned state (about 16 GiB) would stay in
  XLA's pool for the rest of the run, and the overlapped step would keep its state in that pool rather than in its
  own pinned memory (docs/overlap.md, "Pinned memory of our own"). Where the child fails, :func:`measure_here`
  measures in this process.

  One calibration a host: the processes of a job on one host (one per GPU) take a lock on the cache's folder in
  turn, so the first measures and caches, and the others, waiting for it before they start their GPU clients, read
  its cache."""
  if gpu is None:
    platforms = os.environ.get("JAX_PLATFORMS", "").lower()
    gpu = os.path.exists("/dev/nvidiactl") and (not platforms or "cuda" in platforms or "gpu" in platforms)
  given = os.environ.get("JAX_DOS_CALIBRATION")  # the planner reads that one instead
  if args.offload != "auto" or not gpu or given or jax_dos.accelerator_calibration_cached():
    return False
  with _host_lock():
    if jax_dos.accelerator_calibration_cached():  # another process of this host measured it while this one waited
      return False
    return _measure_in_child(args)


@contextlib.contextmanager
def _host_lock():
  """This host's calibration lock (``flock`` on a file in the calibration cache's folder), held until the block ends."""
  folder = jax_dos.calibration_cache_dir()
  folder.mkdir(parents=True, exist_ok=True)
  with open(folder / "calibration.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


def _measure_in_child(args: Flags) -> bool:
  """The calibration measured and cached by a child process; whether it succeeded."""
  t = time.perf_counter()
  code = "import jax_dos; print(jax_dos.calibrate().summary())"
  try:
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CALIBRATION_APART_S)
    status = child.returncode
  except subprocess.TimeoutExpired:
    status = f"no result in {CALIBRATION_APART_S} s"
  if status != 0:
    print(f"calibration in a process of its own failed ({status}); measuring it in this one", flush=True)
    return False
  if not args.quiet:
    print(f"calibration measured in a process of its own ({time.perf_counter() - t:.0f} s)", flush=True)
  return True


def measure_here(args: Flags) -> None:
  """``--offload auto`` on an accelerator: the planner's calibration (20-30 s once per machine, then cached), before
  the model exists: it runs on an empty accelerator and leaves no fragments behind for a large model's step."""
  if args.offload == "auto" and jax.default_backend() != "cpu":
    t = time.perf_counter()
    cal = jax_dos.calibrate()
    if jax.process_index() == 0:
      print(f"calibration ({time.perf_counter() - t:.0f} s; cached per machine): {cal.summary()}", flush=True)
