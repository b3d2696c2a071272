"""Copies of host-resident arrays made by all cores, at DRAM speed: a checkpoint's snapshot of live host state, and a
host array's values written into host buffers of our own (a restored leaf moved into the overlapped step's arena).

XLA's host-to-host ``device_put`` copies on one thread (1.7 GB/s measured on the H100 machine); a ``prange`` copy on
numba's parallel layer runs at the host's DRAM bandwidth, one launch at a time with the host kernels
(``parallel_launch``).
"""

from __future__ import annotations

import ctypes

import jax
import numba
import numpy as np

from jax_dos.parallel_launch import one_launch_at_a_time


@numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def _copy(dst, src):
  for i in numba.prange(src.shape[0]):
    dst[i] = src[i]


@one_launch_at_a_time
def _copy_of(src: np.ndarray) -> np.ndarray:
  """A copy of ``src`` in ordinary memory, made by all cores."""
  out = np.empty(src.shape, src.dtype)
  if src.size:
    _copy(out.reshape(-1).view(np.uint8), np.ascontiguousarray(src).reshape(-1).view(np.uint8))
  return out


def snapshot(x: jax.Array) -> np.ndarray | jax.Array:
  """A copy of a host-resident jax array that no later in-place update of ``x`` reaches, made by all cores.

  XLA's host-to-host ``device_put`` copies on one thread (1.7 GB/s measured on
  the H100 machine); this copies at DRAM speed. An array of one shard comes
  back as a numpy array. An array of several shards, or one that spans other
  processes' devices (no process can read it whole), comes back as a jax array
  laid out as ``x`` whose addressable shards are fresh copies of ``x``'s: this
  process copies only the shards it addresses, and a checkpoint writer then
  writes each process's shards as it would ``x``'s. Each shard's copy is
  placed back on its device (in ``x``'s memory kind) by ``jax.device_put``,
  which may alias the copy (the CPU backend) or copy it once more (a GPU's
  pinned host memory).
  """
  shards = x.addressable_shards
  if len(shards) == 1 and x.is_fully_addressable:
    return _copy_of(np.asarray(x))
  copies = [jax.device_put(_copy_of(np.asarray(s.data)), s.data.sharding, may_alias=True) for s in shards]
  return jax.make_array_from_single_device_arrays(x.shape, x.sharding, copies)


def _writable(shard: jax.Array) -> np.ndarray:
  """A writable numpy view of a host shard's bytes (``np.asarray`` of a ``pinned_host`` array is read-only)."""
  nbytes = shard.dtype.itemsize * int(np.prod(shard.shape, dtype=np.int64))
  raw = (ctypes.c_byte * nbytes).from_address(shard.unsafe_buffer_pointer())
  return np.frombuffer(raw, np.uint8).view(shard.dtype).reshape(shard.shape)


@one_launch_at_a_time
def _fill_shard(dst: np.ndarray, src: np.ndarray) -> None:
  if src.flags.c_contiguous and src.size:
    _copy(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))
  else:
    np.copyto(dst, src)


def fill(dst: jax.Array, src: np.ndarray) -> None:
  """Writes ``src`` (the whole array, host memory) into each addressable shard of ``dst``, by all cores.

  Contract: ``dst`` is a host array whose memory is this process's own (a ``PinnedArena``'s: XLA's buffers are not
  written behind its back), of ``src``'s shape and dtype, and nothing reads it until ``fill`` returns.
  """
  if tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
    raise ValueError(f"fill() needs equal shapes and dtypes, got {src.dtype}{src.shape} -> {dst.dtype}{dst.shape}.")
  for shard in dst.addressable_shards:
    _fill_shard(_writable(shard.data), src[shard.index])
