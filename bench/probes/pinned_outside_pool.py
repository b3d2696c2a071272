"""Probe: pinned host arrays outside XLA's pinned pool, and what each kind of pinned memory costs to give back.

Run on a GPU machine: ``python bench/probes/pinned_outside_pool.py OUT.json [CASE ...]`` (default: all).
Each case runs in its own process:

- ``dlpack``: host memory we map ourselves (``mmap``, huge pages advised), registered for DMA with the client's
  ``dma_map`` and wrapped as a ``pinned_host`` jax.Array through DLPack (``kDLCUDAHost``): is it zero-copy, does it
  stay out of XLA's pool, how fast do copies to and from the device run beside the pool's own pinned arrays;
- ``exit_pool`` / ``exit_mapped``: GiB of pinned memory held at the end, XLA's pool against our own mapping, and how
  long the process takes to end after its last line (and, for our mapping, ``dma_unmap`` timed before the end);
- ``exit_device_bfc`` / ``exit_device_cuda_async``: the same for 60 GiB of accelerator memory under each allocator;
- ``allocator_default`` / ``allocator_cuda_async``: the resident set and a matmul loop under XLA's accelerator
  allocators (BFC keeps a table of 1/32 of its pool in host memory).
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np

GIB = 2**30


def rss_gib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024 / GIB
  return -1.0


def mapped(nbytes: int) -> np.ndarray:
  m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  try:
    m.madvise(mmap.MADV_HUGEPAGE)
  except (AttributeError, OSError):
    pass
  a = np.frombuffer(m, np.float32)
  a[:] = 1.0
  return a


class CudaHost:
  """A numpy array offered through DLPack as CUDA host (pinned) memory."""

  def __init__(self, a: np.ndarray):
    self.a = a

  def __dlpack_device__(self):
    return (3, 0)

  def __dlpack__(self, stream=None, **kw):
    return self.a.__dlpack__()


def timed(f, reps=5):
  f()
  t = time.perf_counter()
  for _ in range(reps):
    f()
  return (time.perf_counter() - t) / reps


def case_dlpack(gib: int) -> dict:
  import jax
  import jax.numpy as jnp

  dev = jax.devices()[0]
  pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  out: dict = {"rss_start_gib": rss_gib()}
  a = mapped(gib * GIB)
  out["rss_after_map_gib"] = rss_gib()
  t = time.perf_counter()
  dev.client.dma_map(a.ctypes.data, a.nbytes)
  out["dma_map_s"] = time.perf_counter() - t
  try:
    from jax._src.lib import _jax

    x = _jax.dlpack_managed_tensor_to_buffer(a.__dlpack__(), dev, None, False, 3)
  except Exception as e:  # noqa: BLE001 - the probe reports what failed
    out["from_dlpack_error"] = repr(e)[:400]
    return out
  out["memory_kind"] = x.sharding.memory_kind
  out["zero_copy"] = x.unsafe_buffer_pointer() == a.ctypes.data
  out["rss_after_wrap_gib"] = rss_gib()
  a[0] = 5.0
  y = jax.device_put(x, on_device)
  out["numpy_write_seen_on_device"] = float(y[0]) == 5.0
  nbytes = a.nbytes
  out["h2d_ours_gbps"] = nbytes / timed(lambda: jax.device_put(x, on_device).block_until_ready()) / 1e9
  z = jax.device_put(np.ones(a.size, np.float32), pinned)
  out["h2d_pool_gbps"] = nbytes / timed(lambda: jax.device_put(z, on_device).block_until_ready()) / 1e9
  out["d2h_pool_gbps"] = nbytes / timed(lambda: jax.device_put(y, pinned).block_until_ready()) / 1e9
  f = jax.jit(lambda s: s * 2.0, out_shardings=pinned)
  try:
    w = f(y)
    out["jit_into_pinned_ok"] = float(np.asarray(w)[0]) == 10.0
  except Exception as e:  # noqa: BLE001
    out["jit_into_pinned_error"] = repr(e)[:300]
  g = jax.jit(lambda s: jnp.sum(s), in_shardings=pinned)
  try:
    out["jit_reads_ours"] = float(g(x))
  except Exception as e:  # noqa: BLE001
    out["jit_reads_ours_error"] = repr(e)[:300]
  stats = dev.memory_stats() or {}
  out["device_stats_keys"] = sorted(stats)[:30]
  out["rss_end_gib"] = rss_gib()
  x = y = z = None
  t = time.perf_counter()
  dev.client.dma_unmap(a.ctypes.data)
  out["dma_unmap_s"] = time.perf_counter() - t
  return out


def case_exit(kind: str, gib: int) -> dict:
  import jax
  import jax.numpy as jnp

  dev = jax.devices()[0]
  out: dict = {}
  if kind == "device":  # the accelerator's pool filled (XLA_PYTHON_CLIENT_ALLOCATOR picks its allocator)
    chunks = [jnp.ones((GIB // 2,), jnp.bfloat16) for _ in range(gib)]
    jax.block_until_ready(chunks)
  elif kind == "pool":
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    chunks = [jax.device_put(np.ones(GIB // 4, np.float32), pinned) for _ in range(gib)]
    jax.block_until_ready(chunks)
  else:
    a = mapped(gib * GIB)
    dev.client.dma_map(a.ctypes.data, a.nbytes)
    if kind == "mapped_unmap":
      t = time.perf_counter()
      dev.client.dma_unmap(a.ctypes.data)
      out["dma_unmap_s"] = time.perf_counter() - t
  out["rss_gib"] = rss_gib()
  print(json.dumps(out), flush=True)
  return out


def case_allocator() -> dict:
  import jax
  import jax.numpy as jnp

  x = jnp.ones((8192, 8192), jnp.bfloat16)
  f = jax.jit(lambda a: (a @ a) * 0.5)
  y = f(x).block_until_ready()
  s = timed(lambda: f(y).block_until_ready(), reps=50)
  big = [jnp.zeros((GIB // 2,), jnp.bfloat16) for _ in range(20)]
  jax.block_until_ready(big)
  pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  h = jax.device_put(big[0], pinned).block_until_ready()
  on_device = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device")
  back = jax.device_put(h, on_device).block_until_ready()
  return {"matmul_tflops": 2 * 8192**3 / s / 1e12, "rss_gib": rss_gib(), "round_trip_ok": bool(back.shape == h.shape)}


def child(case: str, env: dict | None = None, gib: int = 8) -> dict:
  t = time.perf_counter()
  p = subprocess.Popen(
    [sys.executable, __file__, "--case", case, str(gib)],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, **(env or {})},
  )
  last_line_at, lines = None, []
  for line in p.stdout:
    lines.append(line)
    last_line_at = time.perf_counter()
  p.wait()
  end = time.perf_counter()
  result = json.loads(lines[-1]) if lines else {}
  result.update(rc=p.returncode, wall_s=end - t, stderr_tail=p.stderr.read()[-600:])
  if last_line_at is not None:
    result["exit_after_last_line_s"] = end - last_line_at
  return result


def main() -> None:
  if sys.argv[1] == "--case":
    case, gib = sys.argv[2], int(sys.argv[3])
    if case == "dlpack":
      print(json.dumps(case_dlpack(gib)), flush=True)
    elif case.startswith("exit_"):
      case_exit(case[5:], gib)
    else:
      print(json.dumps(case_allocator()), flush=True)
    return
  cases = {
    "dlpack": lambda: child("dlpack", gib=8),
    "exit_pool_48": lambda: child("exit_pool", {"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "100"}, gib=48),
    "exit_mapped_48": lambda: child("exit_mapped", gib=48),
    "exit_mapped_unmap_48": lambda: child("exit_mapped_unmap", gib=48),
    "exit_device_bfc_60": lambda: child("exit_device", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.94"}, gib=60),
    "exit_device_cuda_async_60": lambda: child(
      "exit_device", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.94", "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}, gib=60
    ),
    "allocator_default": lambda: child("allocator", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.94"}),
    "allocator_cuda_async": lambda: child(
      "allocator", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.94", "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async"}
    ),
  }
  results = {name: cases[name]() for name in (sys.argv[2:] or cases)}
  with open(sys.argv[1], "w") as f:
    json.dump(results, f, indent=1)
  print(json.dumps(results, indent=1))


if __name__ == "__main__":
  main()
