"""Helpers shared by the benchmarks: environment before jax, timing, host memory bandwidth.

Import this module (and call :func:`setup_env`) before importing jax: XLA
reads its memory settings once, when the backend starts.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np


def _meminfo(field: str) -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def host_ram_bytes() -> int:
  """Total host RAM (``MemTotal``)."""
  return _meminfo("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_ram_available_bytes() -> int:
  """Host RAM available for new allocations (``MemAvailable``)."""
  return _meminfo("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def setup_env(pinned_fraction: float = 0.85, gpu_mem_fraction: str = "0.90") -> dict[str, str]:
  """Sets XLA's memory limits (unless the user set them) and returns the values used.

  XLA caps its pinned host pool at 64 GiB unless ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``
  is raised; offloaded state for billions of parameters needs more. XLA's GPU command buffers are turned off
  (``jax_dos.OverlappedStep`` launches from several threads).
  """
  os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(int(pinned_fraction * host_ram_bytes() / 2**30)))
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", gpu_mem_fraction)
  os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")  # as train.gpt: no BFC table in host RAM
  # Command buffers off in every variant (jax_dos.OverlappedStep needs it; the others then run on equal terms).
  flag = "--xla_gpu_enable_command_buffer="
  if flag not in os.environ.get("XLA_FLAGS", "").split():
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
  keys = (
    "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "XLA_FLAGS",
    "JAX_PLATFORMS",
  )
  return {k: os.environ[k] for k in keys if k in os.environ}


def timed(fn: Callable[[], object], *, reps: int = 3, warmup: int = 1) -> dict[str, object]:
  """Runs ``fn`` ``warmup`` times, then ``reps`` timed times; ``fn`` must block until its work is done."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return {"time_s": statistics.median(times), "times_s": times}


def _parallel(fn: Callable[[slice], None], n: int, threads: int) -> None:
  bounds = np.linspace(0, n, threads + 1).astype(np.int64)
  with ThreadPoolExecutor(threads) as pool:
    list(pool.map(fn, [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]))


def dram_bandwidth(n: int, threads: int | None = None, reps: int = 3) -> dict[str, float]:
  """Host memory bandwidth (bytes/s) from multi-threaded numpy copy and add (STREAM-like).

  ``copy`` (``a = b``) counts 8 bytes per float32 element, ``add`` (``a = b + c``)
  12; write-allocate traffic is not counted, so the figures are conservative.
  numpy releases the GIL in these loops, so a thread pool drives all cores.
  """
  threads = threads or os.cpu_count() or 1
  a, b, c = (np.full(n, x, np.float32) for x in (0.0, 1.0, 2.0))
  copy = timed(lambda: _parallel(lambda s: np.copyto(a[s], b[s]), n, threads), reps=reps)["time_s"]
  add = timed(lambda: _parallel(lambda s: np.add(b[s], c[s], out=a[s]), n, threads), reps=reps)["time_s"]
  out = {"copy_Bps": 8 * n / copy, "add_Bps": 12 * n / add, "threads": threads, "elements": n}
  out["bandwidth_Bps"] = max(out["copy_Bps"], out["add_Bps"])
  return out
