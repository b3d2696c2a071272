"""Copies from the accelerator into arrays of a :class:`~jax_dos.memory.pinned_arena.PinnedArena`.

XLA writes the result of a copy to pinned host memory only into a fresh
buffer of its own pool. A :class:`CopyOut` writes it into arena arrays we
already own instead: one worker thread takes each request in order, waits
until its sources are ready (XLA's own events), and copies every shard with
``cuMemcpyDtoHAsync`` on a stream of its own per device, then waits for the
streams (the CPU backend: ``memmove``). The request's ``Future`` resolves
with a :class:`~jax_dos.hand_off.HandOff` of the destinations once their
bytes are there.

Ownership: a request hands the sources and destinations to the worker; the
future hands the destinations back (``hand_off.receive`` takes them). The
caller neither reads nor writes the destinations until the future is done,
and keeps the sources alive or gives them up (``free_sources``: the worker
deletes them once copied). The stream path takes its new state back from the
future (``paths.stream.landed``), the host path its gradients.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax

from jax_dos.hand_off import HandOff
from jax_dos.job_thread import hand_off


class _Cuda:
  """The CUDA driver calls a copy needs: each device's primary context (XLA's) and one stream of ours."""

  def __init__(self):
    self.lib = ctypes.CDLL("libcuda.so.1")
    self._check(self.lib.cuInit(0), "cuInit")
    self._contexts: dict[int, ctypes.c_void_p] = {}
    self._streams: dict[int, ctypes.c_void_p] = {}

  def _check(self, status: int, call: str) -> None:
    if status != 0:
      name = ctypes.c_char_p()
      self.lib.cuGetErrorName(status, ctypes.byref(name))
      raise RuntimeError(f"{call} failed: {name.value.decode() if name.value else status}")

  def stream(self, ordinal: int) -> ctypes.c_void_p:
    """Device ``ordinal``'s stream, its context made current on this thread."""
    if ordinal not in self._contexts:
      device, context, stream = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p()
      self._check(self.lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
      self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
      self._check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
      self._check(self.lib.cuStreamCreate(ctypes.byref(stream), 1), "cuStreamCreate")  # CU_STREAM_NON_BLOCKING
      self._contexts[ordinal], self._streams[ordinal] = context, stream
    self._check(self.lib.cuCtxSetCurrent(self._contexts[ordinal]), "cuCtxSetCurrent")
    return self._streams[ordinal]

  def copy(self, ordinal: int, dst: int, src: int, nbytes: int) -> None:
    stream = self.stream(ordinal)
    self._check(
      self.lib.cuMemcpyDtoHAsync_v2(ctypes.c_void_p(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes), stream),
      "cuMemcpyDtoHAsync",
    )

  def wait(self, ordinal: int) -> None:
    self._check(self.lib.cuStreamSynchronize(self.stream(ordinal)), "cuStreamSynchronize")


def _shards(x: jax.Array) -> list[Any]:
  return sorted(x.addressable_shards, key=lambda s: s.device.id)


class CopyOut:
  """The copies from the accelerator into arena arrays of one process (module docstring)."""

  def __init__(self, name: str = "jax_dos-copy-out"):
    self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
    self._cuda: _Cuda | None = None  # (worker thread) made at the first copy from a GPU

  def submit(self, sources: list[jax.Array], destinations: list[jax.Array], free_sources: bool = False) -> Future:
    """Copies each source into its destination (same dtype and shard shapes, on the same devices), in the order
    requested; the future resolves with a ``HandOff`` of ``destinations``."""
    for src, dst in zip(sources, destinations, strict=True):
      if src.dtype != dst.dtype or src.shape != dst.shape:
        raise ValueError(
          f"a copy out needs equal dtypes and shapes, got {src.dtype}{src.shape} -> {dst.dtype}{dst.shape}."
        )
    return self._executor.submit(self._copy, list(sources), list(destinations), free_sources)

  def _copy(self, sources: list[jax.Array], destinations: list[jax.Array], free_sources: bool) -> HandOff:
    hand_off()
    jax.block_until_ready(sources)
    used: set[int] = set()
    for src, dst in zip(sources, destinations):
      for s, d in zip(_shards(src), _shards(dst), strict=True):
        if s.device != d.device:
          raise ValueError(f"a copy out stays on its device: shard on {s.device}, destination on {d.device}.")
        nbytes = s.data.nbytes
        if s.device.platform == "cpu" or src.sharding.memory_kind != "device":
          ctypes.memmove(d.data.unsafe_buffer_pointer(), s.data.unsafe_buffer_pointer(), nbytes)
          continue
        if self._cuda is None:
          self._cuda = _Cuda()
        ordinal = s.device.local_hardware_id
        self._cuda.copy(ordinal, d.data.unsafe_buffer_pointer(), s.data.unsafe_buffer_pointer(), nbytes)
        used.add(ordinal)
    for ordinal in used:
      self._cuda.wait(ordinal)
    if free_sources:
      for src in sources:
        src.delete()
    return HandOff(destinations, f"{len(destinations)} buffers copied out")

  def close(self) -> None:
    """Waits for the copies requested and ends the worker."""
    self._executor.shutdown(wait=True)
