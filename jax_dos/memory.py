"""Memory kinds: where an array lives, and moving it there (eagerly or traced).

Every offloaded array keeps its parameter's sharding and differs only in its
memory kind, so host state sits per addressable shard, next to the device that
owns it.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import warnings
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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
  """The sharding of a concrete array, or the default device's for anything else."""
  if isinstance(x, jax.Array) and not is_traced(x):
    return x.sharding
  return SingleDeviceSharding(jax.local_devices()[0])


def with_kind(x: Any, kind: str) -> Sharding:
  """``x``'s sharding, in memory ``kind`` (``"device"`` or ``"pinned_host"``)."""
  return sharding_of(x).with_memory_kind(kind)


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


def device_free_bytes() -> int | None:
  """Smallest free accelerator memory over local devices (``bytes_limit - bytes_in_use``), or ``None``."""
  free = []
  for d in jax.local_devices():
    try:
      stats = d.memory_stats()
    except Exception:  # some backends raise instead of returning None
      stats = None
    if not stats or "bytes_limit" not in stats:
      return None
    free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
  return min(free) if free else None


def _meminfo(field: str) -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith(field + ":"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def host_memory_total() -> int:
  """Bytes of physical host memory (``MemTotal``)."""
  return _meminfo("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_available() -> int:
  """Bytes of host memory available for new allocations (``MemAvailable``)."""
  return _meminfo("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


POOL_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_POOL_GIB = 64  # XLA's GPU client caps its pinned host allocator here unless POOL_LIMIT_ENV says otherwise
DEFAULT_POOL_FRACTION = 0.9
# What a run's resident set holds beside its pinned need (XLA's pool margin, Python, jax, numba, data): a run whose
# need and this exceed the host's RAM is refused before anything moves (cap_pinned_pool).
HOST_HEADROOM_BYTES = 5 * 2**30
# XLA's BFC allocators (tsl/framework/bfc_allocator.h) keep, in ordinary host memory, an 8-byte chunk handle for every
# 256 bytes of each region they manage, all written when the region opens: 1/32 of the accelerator's pool and of the
# pinned host pool stays resident. Measured at 6.7B on an H100 (bench/tools/large_alloc_trace.c): 2.33 GiB for the
# 74.4 GiB accelerator pool, 3.47 GiB for the 111 GiB pinned pool.
BFC_TABLE_FRACTION = 1 / 32
# XLA's accelerator allocator, as jax reads it when its GPU client starts: jax's default is a BFC allocator (with the
# table above); "cuda_async" is CUDA's own stream-ordered pool (cudaMallocAsync), which keeps no such table.
ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
TABLE_FREE_ALLOCATORS = ("cuda_async", "platform")
# A GPU run's resident set beside XLA's pools and their tables: the C heap, Python, jax, numba, libraries, data
# (1.6-2.9 GiB measured at 6.7B on an H100).
PROCESS_BYTES = 3 * 2**30
# XLA's pinned pool beyond the planned need (cap_pinned_pool): what the plan does not count (transfer staging) and the
# pool's fragmentation. Measured at 6.7B (H100): the pool peaked 2.0 GiB above a plan of 107.0 GiB, and a pool of
# 109 GiB (a 2 GiB margin) ran out in the first step of a `--remat auto` plan.
POOL_MARGIN_BYTES = 4 * 2**30
_plan_pool_gib: int | None = None
_our_pool_limit: str | None = None  # the cap jax_dos set last (at import, from a plan), which a plan may lower


def _backends_started() -> bool:
  from jax._src import xla_bridge

  return xla_bridge.backends_are_initialized()


def raise_pinned_pool_limit(fraction: float = DEFAULT_POOL_FRACTION) -> None:
  """Lets XLA's GPU client pin up to ``fraction`` of host RAM (its default is 64 GiB).

  XLA reads ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` once, when the backend starts,
  so this only acts before the first computation; a value the user set is kept.
  ``import jax_dos`` calls it.
  """
  global _our_pool_limit
  if POOL_LIMIT_ENV in os.environ or _backends_started():
    return
  os.environ[POOL_LIMIT_ENV] = _our_pool_limit = str(
    max(XLA_DEFAULT_POOL_GIB, int(fraction * host_memory_total() / 2**30))
  )


def cap_pinned_pool(
  need_bytes: int,
  *,
  certain_bytes: int | None = None,
  host_memory_bytes: int | None = None,
  what: str = "the run",
  advice: str = "Keep more of the state on the accelerator, use a smaller model, or add host RAM.",
) -> int | None:
  """Caps XLA's pinned host pool at ``need_bytes`` + ``POOL_MARGIN_BYTES`` before the GPU client starts.

  ``need_bytes``: the most pinned host memory the run's plan can take (the
  offloaded state, its spare and transfer buffers); ``certain_bytes`` (default
  ``need_bytes``): what it takes in any plan. XLA's pool grows by doubling
  regions up to its cap, so a cap far above the need lets the process hold far
  more than it uses (docs/overlap.md, "Memory"). The cap is never set below
  XLA's own default (64 GiB) nor above the host's RAM less
  ``HOST_HEADROOM_BYTES``. A value the user set is kept, and once jax's
  backend has started nothing changes (``None`` is returned); the cap
  ``import jax_dos`` set is replaced. Returns the cap in bytes.

  Raises ``MemoryError`` naming the numbers and ``advice`` where
  ``certain_bytes`` and ``HOST_HEADROOM_BYTES`` exceed the host's RAM
  (``host_memory_bytes``, default the machine's), before anything moves.
  """
  total = host_memory_total() if host_memory_bytes is None else host_memory_bytes
  certain = need_bytes if certain_bytes is None else certain_bytes
  if certain + HOST_HEADROOM_BYTES > total:
    raise MemoryError(
      f"{what} needs {certain / 2**30:.1f} GiB of pinned host memory for its optimizer state and buffers, and"
      f" {HOST_HEADROOM_BYTES / 2**30:.0f} GiB beside it for the process: {(certain + HOST_HEADROOM_BYTES) / 2**30:.1f}"
      f" GiB, above this machine's {total / 2**30:.1f} GiB of RAM. {advice}"
    )
  gib = math.ceil((need_bytes + POOL_MARGIN_BYTES) / 2**30)
  gib = max(XLA_DEFAULT_POOL_GIB, min(gib, (total - HOST_HEADROOM_BYTES) // 2**30))
  if not pool_limit_is_ours():
    return None
  set_pool_limit(gib, from_plan=True)
  return gib * 2**30


def pool_limit_is_ours() -> bool:
  """Whether jax_dos may still set XLA's pinned pool cap: the user has not set it and the backend has not started."""
  current = os.environ.get(POOL_LIMIT_ENV)
  return not _backends_started() and (current is None or current == _our_pool_limit)


def set_pool_limit(gib: int, from_plan: bool = False) -> None:
  """Sets XLA's pinned pool cap to ``gib`` GiB (callers check :func:`pool_limit_is_ours` first); ``from_plan``: the
  cap is a run's need (:func:`cap_pinned_pool`), which a later cap (a process's share of its host) keeps if lower."""
  global _our_pool_limit, _plan_pool_gib
  os.environ[POOL_LIMIT_ENV] = _our_pool_limit = str(gib)
  if from_plan:
    _plan_pool_gib = gib


def plan_pool_gib() -> int | None:
  """The cap :func:`cap_pinned_pool` set from a run's need, in GiB; ``None`` if none was set."""
  return _plan_pool_gib


def pinned_pool_limit() -> int | None:
  """Bytes XLA's pinned host pool may hold on a GPU backend (``None`` elsewhere: no such cap)."""
  if jax.default_backend() != "gpu":
    return None
  try:
    return int(float(os.environ.get(POOL_LIMIT_ENV, XLA_DEFAULT_POOL_GIB)) * 2**30)
  except ValueError:
    return XLA_DEFAULT_POOL_GIB * 2**30


def accelerator_pool_bytes() -> int:
  """Bytes XLA's allocators hold for this process's local devices (each device's ``bytes_limit``; 0 on the CPU)."""
  stats = [d.memory_stats() for d in jax.local_devices()]
  return sum(int(s.get("bytes_limit", 0)) for s in stats if s)


def accelerator_table_fraction() -> float:
  """The share of the accelerator's pool that XLA's allocator keeps as a table in host memory: ``BFC_TABLE_FRACTION``
  under a BFC allocator (jax's default), 0 under one of ``TABLE_FREE_ALLOCATORS`` (``ALLOCATOR_ENV``)."""
  allocator = os.environ.get(ALLOCATOR_ENV, "default").lower()
  return 0.0 if allocator in TABLE_FREE_ALLOCATORS else BFC_TABLE_FRACTION


def resident_estimate(
  pinned_bytes: int, pool_bytes: int | None = None, accelerator_bytes: int | None = None, outside_pool: int = 0
) -> int:
  """The resident set a GPU process holding ``pinned_bytes`` of pinned host memory reaches, ``outside_pool`` of
  them in mappings of its own (``jax_dos.pinned_arena``).

  ``resident = outside + pool * (1 + BFC_TABLE_FRACTION) + accelerator * accelerator_table_fraction() +
  PROCESS_BYTES``, where the pool is ``pool_bytes`` (XLA's pinned pool cap, default :func:`pinned_pool_limit`)
  where the bytes in it (``pinned_bytes - outside_pool``) pass what its regions hold before the last one (XLA opens
  regions of 2 MiB doubling up to the cap, and the last takes the rest of the cap), else those bytes rounded up to
  the regions they open; ``accelerator_bytes`` defaults to :func:`accelerator_pool_bytes`.
  """
  cap = pinned_pool_limit() if pool_bytes is None else pool_bytes
  in_pool = pinned_bytes - outside_pool
  pool, region = 0, 2 * 2**20
  while pool < in_pool and (cap is None or pool < cap):
    take = region if cap is None else min(region, cap - pool)
    pool, region = pool + take, 2 * region
  accelerator = accelerator_pool_bytes() if accelerator_bytes is None else accelerator_bytes
  table = accelerator * accelerator_table_fraction()
  return int(outside_pool + pool * (1 + BFC_TABLE_FRACTION) + table + PROCESS_BYTES)


def bytes_on_this_host(nbytes: int) -> tuple[int, int]:
  """``(total, processes)``: ``nbytes`` summed over the processes of the job on this host (by host name), and their
  number. ``(nbytes, 1)`` in a single process; with several, a collective (every process calls it)."""
  if jax.process_count() == 1:
    return nbytes, 1
  from jax.experimental import multihost_utils

  host = np.uint32(zlib.crc32(socket.gethostname().encode())).view(np.int32)
  mine = np.array([host, -(-nbytes // 2**20)], np.int32)  # MiB: int32 holds 2 PiB
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
  here = every[every[:, 0] == host]
  return max(nbytes, int(here[:, 1].astype(np.int64).sum()) * 2**20), len(here)


def check_host_capacity(
  nbytes: int, what: str = "the offloaded Adam state", on_host: tuple[int, int] | None = None
) -> None:
  """Fails early, with advice, if ``nbytes`` of pinned host memory cannot be had by this process.

  ``on_host`` is :func:`bytes_on_this_host`'s ``(total, processes)``: the
  host's RAM must hold what every process of the job on it needs, XLA's pinned
  pool (one per process) this process's ``nbytes``.

  Raises ``MemoryError`` when the request exceeds the machine's physical
  memory or XLA's pinned pool limit on a GPU. When it exceeds what the OS
  reports available, only warns: XLA's pinned-host pool keeps memory it has
  freed (a previous state's, say), which the OS counts as used, so that figure
  understates what a new state can get.
  """
  advice = (
    "Keep more subgroups on the device (plan='device' or a larger resident budget), use a smaller model,"
    " or add host RAM."
  )
  host_bytes, processes = on_host or (nbytes, 1)
  on_this_host = f"{what} ({processes} processes on this host together)" if processes > 1 else what
  total, available = host_memory_total(), host_memory_available()
  if host_bytes > total:
    raise MemoryError(
      f"{on_this_host} needs {host_bytes / 2**30:.2f} GiB of pinned host memory but this machine has"
      f" {total / 2**30:.2f} GiB of RAM in all. {advice}"
    )
  pool = pinned_pool_limit()
  if pool is not None and nbytes > pool:
    raise MemoryError(
      f"{what} needs {nbytes / 2**30:.2f} GiB of pinned host memory but XLA's pinned pool is capped at"
      f" {pool / 2**30:.0f} GiB. Set {POOL_LIMIT_ENV} (GiB) above that before jax starts, or import jax_dos"
      f" before running anything with jax (it raises the cap to {DEFAULT_POOL_FRACTION:.0%} of RAM). {advice}"
    )
  if host_bytes > available:
    warnings.warn(
      f"{on_this_host} needs {host_bytes / 2**30:.2f} GiB of pinned host memory and the OS reports"
      f" {available / 2**30:.2f} GiB available; this fits only if memory already held by this process (XLA's pinned"
      " pool) is reused.",
      ResourceWarning,
      stacklevel=3,
    )


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
