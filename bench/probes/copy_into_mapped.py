"""Probe: copies from accelerator memory into host memory we map ourselves, issued through the CUDA driver.

Run on a GPU machine: ``python bench/probes/copy_into_mapped.py OUT.json``.

XLA copies device arrays to pinned host memory only into its own pool. Host memory mapped by us (``mmap``, huge
pages advised) and registered with ``client.dma_map`` can also be written by ``cuMemcpyDtoHAsync`` on a stream of
our own, from the device array's ``unsafe_buffer_pointer`` once it is ready. The probe checks the numbers, the rate
alone and beside XLA's own copies to the device, from a worker thread, and whether the result read back through a
DLPack ``pinned_host`` view equals the source.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import sys
import threading
import time

import numpy as np

GIB = 2**30


def mapped(nbytes: int) -> np.ndarray:
  m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  m.madvise(mmap.MADV_HUGEPAGE)
  return np.frombuffer(m, np.uint8)


class Cuda:
  def __init__(self, ordinal: int):
    self.lib = lib = ctypes.CDLL("libcuda.so.1")
    self.check(lib.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    self.check(lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
    self.ctx = ctypes.c_void_p()
    self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
    self.bind()
    self.stream = ctypes.c_void_p()
    self.check(lib.cuStreamCreate(ctypes.byref(self.stream), 1), "cuStreamCreate")

  def bind(self):
    self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

  def check(self, rc, what):
    if rc != 0:
      raise RuntimeError(f"{what}: CUresult {rc}")

  def d2h(self, dst: int, src: int, n: int):
    self.check(
      self.lib.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(dst), ctypes.c_uint64(src), ctypes.c_size_t(n), self.stream),
      "cuMemcpyDtoHAsync",
    )

  def sync(self):
    self.check(self.lib.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


def main(out_path: str) -> None:
  import jax
  import jax.numpy as jnp
  from jax._src.lib import _jax

  out: dict = {"jax": jax.__version__}
  dev = jax.devices()[0]
  out["device"] = dev.device_kind
  on_device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
  n = 4 * GIB
  arena = mapped(2 * n)
  t = time.perf_counter()
  dev.client.dma_map(arena.ctypes.data, arena.nbytes)
  out["dma_map_s_8gib"] = time.perf_counter() - t
  cuda = Cuda(dev.local_hardware_id)
  x = jax.jit(lambda k: jax.random.normal(k, (n // 4,), jnp.float32), out_shardings=on_device)(jax.random.key(0))
  x.block_until_ready()
  src = x.unsafe_buffer_pointer()
  dst = arena.ctypes.data
  cuda.d2h(dst, src, n)
  cuda.sync()
  t = time.perf_counter()
  for _ in range(3):
    cuda.d2h(dst, src, n)
  cuda.sync()
  out["d2h_ours_gbps"] = 3 * n / (time.perf_counter() - t) / 1e9
  view = arena[:n].view(np.float32)
  out["equal_numpy"] = bool(np.array_equal(view[: 1 << 20], np.asarray(x[: 1 << 20])))
  host = _jax.dlpack_managed_tensor_to_buffer(view.__dlpack__(), dev, None, False, 3)
  out["view_kind"] = host.sharding.memory_kind
  back = jax.device_put(host, on_device)
  out["equal_round_trip"] = bool(jnp.array_equal(back, x))
  pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
  t = time.perf_counter()
  for _ in range(3):
    y = jax.device_put(x, pinned)
    y.block_until_ready()
    del y
  out["d2h_xla_gbps"] = 3 * n / (time.perf_counter() - t) / 1e9
  # beside XLA's copies in (the step's other direction), our copies out from a worker thread
  z = jax.device_put(np.ones(n // 4, np.float32), pinned)
  result: dict = {}

  def worker():
    cuda.bind()
    t0 = time.perf_counter()
    for _ in range(4):
      cuda.d2h(dst + n, src, n)
    cuda.sync()
    result["s"] = time.perf_counter() - t0

  th = threading.Thread(target=worker)
  t = time.perf_counter()
  th.start()
  ins = [jax.device_put(z, on_device) for _ in range(4)]
  jax.block_until_ready(ins)
  t_in = time.perf_counter() - t
  th.join()
  out["beside_d2h_ours_gbps"] = 4 * n / result["s"] / 1e9
  out["beside_h2d_xla_gbps"] = 4 * n / t_in / 1e9
  out["equal_second_half"] = bool(np.array_equal(arena[n:].view(np.float32)[: 1 << 20], view[: 1 << 20]))
  with open(out_path, "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main(sys.argv[1])
