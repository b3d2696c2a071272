"""Memory kinds: where an array lives, and moving it there (eagerly or traced).

Every offloaded array keeps its parameter's sharding and differs only in its
memory kind, so host state sits per addressable shard, next to the device that
owns it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Sharding, SingleDeviceSharding


def is_traced(x: Any) -> bool:
  return isinstance(x, jax.core.Tracer)


def device_elements(x: Any) -> int:
  """Elements of ``x`` held by one device (its shard), or all of them."""
  shape = tuple(getattr(x, "shape", ()))
  sharding = getattr(x, "sharding", None)
  if sharding is not None:
    try:
      shape = tuple(sharding.shard_shape(shape))
    except Exception:  # traced values and exotic shardings: count the whole leaf
      pass
  return math.prod(shape)


def process_elements(x: Any) -> int:
  """Elements of ``x`` this process's devices hold, summed over them (each keeps its own shard), or all of them."""
  sharding = getattr(x, "sharding", None)
  if sharding is not None and not is_traced(x):
    try:
      return len(sharding.addressable_devices) * device_elements(x)
    except Exception:  # exotic shardings: count the whole leaf
      pass
  return math.prod(tuple(getattr(x, "shape", ()) or ()))


def sharding_of(x: Any) -> Sharding:
  """The sharding of a concrete array or of a ``ShapeDtypeStruct`` that has one, or the default device's for anything
  else."""
  if isinstance(x, jax.Array) and not is_traced(x):
    return x.sharding
  if isinstance(x, jax.ShapeDtypeStruct) and isinstance(x.sharding, Sharding):
    return x.sharding
  return SingleDeviceSharding(jax.local_devices()[0])


def with_kind(x: Any, kind: str) -> Sharding:
  """``x``'s sharding, in memory ``kind`` (``"device"`` or ``"pinned_host"``)."""
  return sharding_of(x).with_memory_kind(kind)


def cpu_device() -> jax.Device | None:
  """This process's first CPU device (every process has one unless ``JAX_PLATFORMS`` leaves the CPU out), or
  ``None``."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


def memory_kind(x: Any) -> str | None:
  if isinstance(x, jax.Array) and not is_traced(x):
    return x.sharding.memory_kind
  return None


def traced_put(x: jax.Array, kind: str) -> jax.Array:
  """In-jit transfer to ``kind`` (XLA schedules it; the MaxText idiom)."""
  space = jax.memory.Space.Host if kind == "pinned_host" else jax.memory.Space.Device
  return jax.device_put(x, space)


def traced_put_like(x: jax.Array, ref) -> jax.Array:
  """In-jit transfer of ``x`` to the memory space of ``ref`` (a tracer or an abstract value)."""
  space = str(getattr(ref if isinstance(ref, jax.core.AbstractValue) else jax.typeof(ref), "memory_space", "Device"))
  return traced_put(x, "pinned_host" if space.endswith("Host") else "device")


# jax's default share of a GPU's memory for XLA's allocator (``XLA_PYTHON_CLIENT_MEM_FRACTION`` unset).
JAX_DEFAULT_MEM_FRACTION = 0.75


def _cuda_memory(ordinal: int) -> tuple[int, int] | None:
  """``(free, total)`` bytes of CUDA device ``ordinal`` (the driver's ``cuMemGetInfo`` in its primary context, the
  one XLA uses), or ``None`` where the driver cannot be asked."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
  except OSError:
    return None
  device, context = ctypes.c_int(), ctypes.c_void_p()
  free, total = ctypes.c_size_t(), ctypes.c_size_t()
  if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), ordinal):
    return None
  if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device):
    return None
  try:
    if cuda.cuCtxPushCurrent_v2(context):
      return None
    try:
      if cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)):
        return None
    finally:
      cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
  finally:
    cuda.cuDevicePrimaryCtxRelease_v2(device)
  return int(free.value), int(total.value)


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
  """An accelerator's memory as this process may use it: ``limit_bytes`` XLA's allocator may hand out, of which
  ``in_use_bytes`` it holds now; ``total_bytes`` the card's (``None`` where not read); ``source`` how the limit was
  read, for the run's log.

  The limit is ``memory_stats()``'s ``bytes_limit`` where XLA's allocator took its share of the card when it started
  (jax's default, ``XLA_PYTHON_CLIENT_PREALLOCATE`` unset or true). Where it took nothing
  (``XLA_PYTHON_CLIENT_PREALLOCATE=false``, JAX's way to share a GPU) ``bytes_limit`` reports what the allocator holds
  so far, not what it may grow to: the limit is then ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (jax's default
  :data:`JAX_DEFAULT_MEM_FRACTION`) of the card's memory, at most what this process holds and the card has free now
  (another process may hold the rest), both read from the CUDA driver.
  """

  limit_bytes: int
  in_use_bytes: int
  total_bytes: int | None = None
  source: str = "bytes_limit"

  @property
  def free_bytes(self) -> int:
    return max(0, self.limit_bytes - self.in_use_bytes)

  @classmethod
  def of(cls, device: jax.Device) -> DeviceMemory | None:
    """``device``'s memory, or ``None`` where the backend reports none (the CPU)."""
    try:
      stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
      stats = None
    if not stats or "bytes_limit" not in stats:
      return None
    limit, in_use = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
    preallocated = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower() not in ("false", "0")
    if preallocated or device.platform != "gpu":
      return cls(limit, in_use)
    cuda = _cuda_memory(device.local_hardware_id)
    if cuda is None:
      return cls(limit, in_use, None, "bytes_limit (XLA_PYTHON_CLIENT_PREALLOCATE=false, the card not read)")
    free, total = cuda
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_MEM_FRACTION))
    return cls.growing(limit, in_use, free, total, fraction)

  @classmethod
  def growing(cls, held: int, in_use: int, free: int, total: int, fraction: float) -> DeviceMemory:
    """The memory of an allocator that took nothing when it started and grows to ``fraction`` of the card's
    ``total`` bytes, at most what it ``held`` already (its ``bytes_limit``) and the card's ``free`` bytes now."""
    grows_to = min(int(fraction * total), max(held, in_use) + free)
    source = (f"XLA_PYTHON_CLIENT_PREALLOCATE=false: {fraction:g} of the card's {total / 2**30:.1f} GiB"
              f" (XLA_PYTHON_CLIENT_MEM_FRACTION), {free / 2**30:.1f} GiB of it free now")  # fmt: skip
    return cls(max(held, grows_to), in_use, total, source)

  def describe(self) -> str:
    """One line: the limit, what is in use, and where the limit comes from."""
    return f"{self.limit_bytes / 2**30:.1f} GiB usable ({self.source}), {self.in_use_bytes / 2**30:.1f} GiB in use"


def device_memories() -> list[tuple[jax.Device, DeviceMemory]] | None:
  """Each local device's :class:`DeviceMemory`, or ``None`` where any reports none (the CPU backend)."""
  out = []
  for d in jax.local_devices():
    m = DeviceMemory.of(d)
    if m is None:
      return None
    out.append((d, m))
  return out


def device_free_bytes() -> int | None:
  """Smallest free accelerator memory over local devices (:attr:`DeviceMemory.free_bytes`), or ``None``."""
  memories = device_memories()
  return min(m.free_bytes for _, m in memories) if memories else None


@functools.lru_cache(maxsize=512)
def _zeros_fn(shape: tuple[int, ...], dtype, sharding: Sharding):
  return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=512)
def _cast_fn(dtype, sharding: Sharding):
  return jax.jit(lambda a: a.astype(dtype), out_shardings=sharding)


def zeros_like_in(x: Any, kind: str, dtype=jnp.float32) -> jax.Array:
  """A fresh float32 zero array shaped like ``x`` in memory ``kind``."""
  if is_traced(x):
    return traced_put(jnp.zeros(jnp.shape(x), dtype), kind)
  return _zeros_fn(tuple(jnp.shape(x)), jnp.dtype(dtype), with_kind(x, kind))()


def copy_in(x: Any, kind: str, dtype=jnp.float32) -> jax.Array:
  """A fresh float32 copy of ``x`` in memory ``kind`` (never an alias of ``x``)."""
  if is_traced(x):
    return traced_put(jnp.asarray(x, dtype), kind)
  x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
  if x.dtype != dtype:
    # Cast where arithmetic is allowed (accelerator memory), then move.
    x = _cast_fn(jnp.dtype(dtype), with_kind(x, "device"))(jax.device_put(x, with_kind(x, "device")))
  return jax.device_put(x, with_kind(x, kind), may_alias=False)


# ----------------------------------------------------------------------------- eager, batched moves


def committed(tree: Any) -> Any:
  """``tree`` with every array committed to its devices (no copy).

  A jitted program is compiled and loaded again for committed arguments
  where it first ran with uncommitted ones (arrays made without a device:
  ``jnp.ones``, a model's initialisation), and an optimizer's outputs are
  committed: committing first keeps the programs of the first step those of
  every later one.
  """
  return jax.tree.map(lambda x: x if getattr(x, "committed", True) else jax.device_put(x, x.sharding), tree)


def shards(x: jax.Array) -> list[jax.Array]:
  """The single-device arrays of ``x``'s addressable shards, in device-id order."""
  return [s.data for s in sorted(x.addressable_shards, key=lambda s: s.device.id)]


def put(xs: list[jax.Array], kind: str, likes: list[jax.Array] | None = None) -> list[jax.Array]:
  """Fresh copies of ``xs`` in memory ``kind`` (sharded like ``likes``), as one batched ``device_put``."""
  shardings = [with_kind(x, kind) for x in (xs if likes is None else likes)]
  return list(jax.device_put(list(xs), shardings, may_alias=False))


def put_groups(groups: list[list[jax.Array]], kind: str) -> list[list[jax.Array]]:
  """:func:`put` of several lists of arrays as one batched ``device_put``, split back into the lists."""
  moved = iter(put([x for g in groups for x in g], kind))
  return [[next(moved) for _ in g] for g in groups]


def free_groups(groups: list[list[jax.Array]]) -> None:
  """Frees the buffers of several lists of arrays whose copies are done (like a donated buffer: whatever read them
  has waited for them to land)."""
  for a in (a for group in groups for a in group):
    a.delete()


def like_states(grads: list[jax.Array], masters: list[jax.Array], kind: str = "device") -> list[jax.Array]:
  """``grads`` in memory ``kind`` with their states' shardings (so that shards line up leaf by leaf).

  Those that must move do so in one batched ``device_put``.
  """
  targets = [m.sharding.with_memory_kind(kind) for m in masters]
  move = [
    j for j, (g, t) in enumerate(zip(grads, targets))
    if not (g.sharding.is_equivalent_to(t, g.ndim) and g.sharding.memory_kind == kind)
  ]  # fmt: skip
  out = list(grads)
  for j, x in zip(move, put([grads[j] for j in move], kind, likes=[masters[j] for j in move])):
    out[j] = x
  return out


def zeros_like_each(likes: list[tuple[jax.Array, Any]]) -> list[jax.Array]:
  """Zero arrays shaped and sharded like each ``(array, dtype)``'s array (in its memory), of that dtype."""
  if not likes:
    return []
  structs = [jax.ShapeDtypeStruct(a.shape, d, sharding=a.sharding) for a, d in likes]
  return jax.jit(lambda: [jnp.zeros(x.shape, x.dtype) for x in structs], out_shardings=[x.sharding for x in structs])()
