"""Pinned host memory outside XLA's pool: mappings of our own, cut into ``pinned_host`` arrays.

XLA's GPU client keeps pinned host memory in one growing pool: regions of
doubling size that are never given back while the process lives, each with a
table of 1/32 of its size, unpinned page by page when the process ends
(docs/overlap.md, "Memory" and "Leaving the process"). A :class:`PinnedArena`
maps host memory itself instead, in chunks (``mmap``, huge pages advised),
registers each with the accelerator's client for DMA (``client.dma_map``,
XLA's ``cudaHostRegister``; the CPU backend needs none), and hands out
**zero-copy** ``pinned_host`` arrays of any shape and sharding through DLPack
(``kDLCUDAHost``). The host kernel writes them in place; ``jax.device_put``
copies them to the accelerator at the pool's rate; a jitted program reads
them. XLA cannot write them (a program's output is always a fresh buffer of
its own), so copies from the accelerator into them go through
:mod:`jax_dos.memory.copy_out`.

Contract:

- A slot is one addressable shard's bytes, 4 KiB aligned, inside one chunk.
  :meth:`PinnedArena.array_like` takes a slot per shard (a free one of the
  same size, else the next bytes of the first chunk of its class with room,
  else a new chunk: slots under 2 MiB in chunks of 64 MiB, the others in
  chunks of 1 GiB) and returns the array; :meth:`PinnedArena.free` gives its slots back and deletes it. Only
  the thread that owns an array frees it (the allocator's own lists are
  behind a lock: the host and stream workers both allocate).
- Fresh bytes are zero (the kernel's anonymous pages); a reused slot holds
  what its last array left: :meth:`PinnedArena.zeros_like` clears it.
- A chunk's memory lives as long as any array made from it (each array holds
  its chunk through the DLPack capsule); its DMA registration ends with it.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

SLOT_ALIGN = 4096  # bytes: every slot starts on a page
CHUNK_BYTES = 1 << 30  # a chunk's size, unless one slot needs more
# Slots below SMALL_SLOT (norms, biases) go to chunks of their own, SMALL_CHUNK each: among the large ones they cut
# every gap a little short of the next large slot (the GPT 6.7B's state mapped 7.8 GiB more than it held).
SMALL_SLOT = 2 << 20
SMALL_CHUNK = 64 << 20
_KDL_CUDA_HOST = 3  # DLPack's device type of pinned host memory


def _aligned(nbytes: int) -> int:
  return -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN


def supported(devices: Sequence[jax.Device]) -> bool:
  """Whether arrays of this arena can stand for ``pinned_host`` arrays on ``devices``: the CPU backend, or CUDA
  (whose client registers host memory for DMA, and whose driver copies into it: :mod:`jax_dos.memory.copy_out`)."""
  try:
    from jax._src.lib import _jax
  except ImportError:
    return False
  if not hasattr(_jax, "dlpack_managed_tensor_to_buffer"):
    return False
  platforms = {d.platform for d in devices}
  if platforms == {"cpu"}:
    return True
  return platforms == {"gpu"} and all("cuda" in d.client.platform_version.lower() for d in devices)


_DLPACK_CODE_OFFSET = 20  # DLTensor: data (8 B), device (8 B), ndim (4 B), then dtype's code (1 B)
_KDL_BFLOAT = 4


def _capsule(view: np.ndarray) -> Any:
  """``view``'s DLPack capsule (it keeps ``view`` alive until the array made from it is freed). numpy exports no
  bfloat16: such a view is exported as uint16 and its DLPack dtype code set to bfloat16 (the same 16 bits)."""
  if view.dtype != np.dtype(jax.numpy.bfloat16):
    return view.__dlpack__()
  capsule = view.view(np.uint16).__dlpack__()
  get = ctypes.pythonapi.PyCapsule_GetPointer
  get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
  ctypes.c_uint8.from_address(get(capsule, b"dltensor") + _DLPACK_CODE_OFFSET).value = _KDL_BFLOAT
  return capsule


class _Chunk:
  """One mapping: its bytes as a numpy array, registered with the accelerator's clients until it is collected."""

  def __init__(self, nbytes: int, clients: list[Any]):
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
      mem.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):  # no transparent huge pages here: 4 KiB pages, slower to pin and unpin
      pass
    self.bytes = np.frombuffer(mem, np.uint8)
    self.address = self.bytes.ctypes.data
    self.used = 0
    for client in clients:
      client.dma_map(self.address, nbytes)
    # The registration ends when the last array of the chunk is gone (not at exit: the process's end unpins it).
    unmap = weakref.finalize(self.bytes, _dma_unmap, clients, self.address)
    unmap.atexit = False


def _dma_unmap(clients: list[Any], address: int) -> None:
  for client in clients:
    try:
      client.dma_unmap(address)
    except Exception:  # the client went first (the process is ending): nothing is registered any more
      pass


class PinnedArena:
  """Pinned host memory of this process for ``pinned_host`` arrays (module docstring).

  Args:
    devices: the devices whose arrays it makes (their clients register its chunks).
    chunk_bytes: the size of a mapping; a slot larger than that gets one of its own.
  """

  def __init__(self, devices: Sequence[jax.Device], chunk_bytes: int = CHUNK_BYTES):
    if not supported(devices):
      raise ValueError(
        f"a PinnedArena needs the CPU backend or CUDA devices, got {sorted({d.platform for d in devices})}."
      )
    self.chunk_bytes = chunk_bytes
    clients = {id(d.client): d.client for d in devices if d.platform != "cpu"}
    self._clients = list(clients.values())  # the CPU backend registers nothing
    self._lock = threading.Lock()
    self._chunks: dict[bool, list[_Chunk]] = {False: [], True: []}  # small slots' chunks, the others' (by class)
    self._free: dict[int, list[tuple[_Chunk, int]]] = defaultdict(list)  # slot bytes -> free slots
    self._slots: dict[int, list[tuple[_Chunk, int, int]]] = {}  # id(array) -> its slots (chunk, offset, bytes)
    self.live_bytes = 0  # the bytes of the arrays now, as their shapes count them (slots unaligned)
    self.peak_bytes = 0  # the most live_bytes have been

  @property
  def mapped_bytes(self) -> int:
    """Bytes mapped (and pinned) so far."""
    return sum(c.bytes.nbytes for chunks in self._chunks.values() for c in chunks)

  def _take(self, nbytes: int) -> tuple[_Chunk, int, bool]:
    """A slot of ``nbytes``: ``(chunk, offset, fresh)``, fresh bytes being zero."""
    size = _aligned(nbytes)
    with self._lock:
      self.live_bytes += nbytes
      self.peak_bytes = max(self.peak_bytes, self.live_bytes)
      if self._free[size]:
        chunk, offset = self._free[size].pop()
        return chunk, offset, False
      small = size < SMALL_SLOT
      chunks = self._chunks[small]
      chunk = next((c for c in chunks if c.bytes.nbytes - c.used >= size), None)  # first fit
      if chunk is None:
        chunk = _Chunk(max(min(SMALL_CHUNK, self.chunk_bytes) if small else self.chunk_bytes, size), self._clients)
        chunks.append(chunk)
      offset, chunk.used = chunk.used, chunk.used + size
      return chunk, offset, True

  def array_like(self, like: Any, dtype: Any = None, zero: bool = False) -> jax.Array:
    """A ``pinned_host`` array shaped and sharded like ``like``, of ``dtype`` (``like``'s by default); its bytes
    are whatever its slots hold, or zero with ``zero``."""
    dtype = np.dtype(dtype or like.dtype)
    sharding = like.sharding.with_memory_kind("pinned_host")
    shard_shape = sharding.shard_shape(like.shape)
    devices = sorted(sharding.addressable_devices, key=lambda d: d.id)
    from jax._src.lib import _jax

    parts, slots = [], []
    for device in devices:
      nbytes = int(np.prod(shard_shape, dtype=np.int64)) * dtype.itemsize
      chunk, offset, fresh = self._take(nbytes)
      view = chunk.bytes[offset : offset + max(nbytes, dtype.itemsize)].view(dtype)[: nbytes // dtype.itemsize]
      view = view.reshape(shard_shape)
      if zero and not fresh:
        view.fill(0)
      parts.append(_jax.dlpack_managed_tensor_to_buffer(_capsule(view), device, None, False, _KDL_CUDA_HOST))
      slots.append((chunk, offset, nbytes))
    if len(devices) == 1 and isinstance(sharding, jax.sharding.SingleDeviceSharding):
      array = parts[0]
    else:
      array = jax.make_array_from_single_device_arrays(like.shape, sharding, parts)
    with self._lock:
      self._slots[id(array)] = slots
    return array

  def _slots_of(self, x: Any) -> list[tuple[_Chunk, int, int]] | None:
    """``x``'s slots, if ``x`` is a live array of this arena (checked by address: an id outlives its array)."""
    slots = self._slots.get(id(x))
    if slots is None or not isinstance(x, jax.Array) or x.is_deleted():
      return None
    first = min(x.addressable_shards, key=lambda s: s.device.id).data.unsafe_buffer_pointer()
    return slots if first == slots[0][0].address + slots[0][1] else None

  def zeros_like(self, like: Any, dtype: Any = None) -> jax.Array:
    """:meth:`array_like` with every byte zero."""
    return self.array_like(like, dtype, zero=True)

  def owns(self, x: Any) -> bool:
    """Whether ``x`` is an array of this arena, not yet freed."""
    with self._lock:
      return self._slots_of(x) is not None

  def free(self, x: jax.Array) -> None:
    """Gives ``x``'s slots back and deletes ``x`` (the caller owns ``x``, and whatever read it has waited for its
    copies to land)."""
    with self._lock:
      if self._slots_of(x) is None:
        raise ValueError("free() takes a live array of this arena.")
      slots = self._slots.pop(id(x))
      for chunk, offset, nbytes in slots:
        self._free[_aligned(nbytes)].append((chunk, offset))
        self.live_bytes -= nbytes
    x.delete()


def release(arena: PinnedArena | None, x: jax.Array) -> None:
  """Frees a buffer its owner is done with: back to ``arena`` if it is one of its arrays, else to XLA's pool."""
  if arena is not None and arena.owns(x):
    arena.free(x)
  else:
    x.delete()
