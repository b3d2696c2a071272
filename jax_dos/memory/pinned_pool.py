"""XLA's pinned host pool and its cap: set to a share of the host's RAM (``raise_pinned_pool_limit``, which
``jax_dos.configure_process`` calls) or from a run's need before jax starts (``cap_pinned_pool``), what the pool and
its allocators' tables hold of the host's RAM (``resident_estimate``), and the check that a request fits both the
host's RAM and the cap (``check_host_capacity``).
"""

from __future__ import annotations

import math
import os
import warnings

import jax

from jax_dos.memory import host_ram
from jax_dos.memory.host_ram import HOST_HEADROOM_BYTES

POOL_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
XLA_DEFAULT_POOL_GIB = 64  # XLA's GPU client caps its pinned host allocator here unless POOL_LIMIT_ENV says otherwise
DEFAULT_POOL_FRACTION = 0.9
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
_our_pool_limit: str | None = None  # the cap jax_dos set last (configure_process, a plan), which a plan may lower


def _backends_started() -> bool:
  from jax._src import xla_bridge

  return xla_bridge.backends_are_initialized()


def raise_pinned_pool_limit(fraction: float = DEFAULT_POOL_FRACTION) -> None:
  """Lets XLA's GPU client pin up to ``fraction`` of host RAM (its default is 64 GiB).

  XLA reads ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` once, when the backend starts,
  so this only acts before the first computation; a value the user set is kept.
  ``jax_dos.configure_process`` calls it; importing jax_dos does not.
  """
  global _our_pool_limit
  if POOL_LIMIT_ENV in os.environ or _backends_started():
    return
  os.environ[POOL_LIMIT_ENV] = _our_pool_limit = str(
    max(XLA_DEFAULT_POOL_GIB, int(fraction * host_ram.host_memory_total() / 2**30))
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
  backend has started nothing changes (``None`` is returned); a cap
  ``jax_dos.configure_process`` set is replaced. Returns the cap in bytes.

  Raises ``MemoryError`` naming the numbers and ``advice`` where
  ``certain_bytes`` and ``HOST_HEADROOM_BYTES`` exceed the host's RAM
  (``host_memory_bytes``, default the machine's), before anything moves.
  """
  total = host_ram.host_memory_total() if host_memory_bytes is None else host_memory_bytes
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
  them in mappings of its own (``jax_dos.memory.pinned_arena``).

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


def check_host_capacity(
  nbytes: int, what: str = "the offloaded Adam state", on_host: tuple[int, int] | None = None, released: int = 0
) -> None:
  """Fails early, with advice, if ``nbytes`` of pinned host memory cannot be had by this process.

  ``on_host`` is :func:`host_ram.bytes_on_this_host`'s ``(total, processes)``: the
  host's RAM must hold what every process of the job on it needs, XLA's pinned
  pool (one per process) this process's ``nbytes``.

  Raises ``MemoryError`` when the request exceeds the machine's physical
  memory or XLA's pinned pool limit on a GPU. When it exceeds what the OS
  reports available, only warns: XLA's pinned-host pool keeps memory it has
  freed (a previous state's, say), which the OS counts as used, so that figure
  understates what a new state can get. ``released``: bytes this process holds now and frees as the request is
  met (a state given in ordinary host memory, moved leaf by leaf), counted as available.
  """
  advice = (
    "Keep more subgroups on the device (plan='device' or a larger resident budget), use a smaller model,"
    " or add host RAM."
  )
  host_bytes, processes = on_host or (nbytes, 1)
  on_this_host = f"{what} ({processes} processes on this host together)" if processes > 1 else what
  total, available = host_ram.host_memory_total(), host_ram.host_memory_available() + released
  if host_bytes > total:
    raise MemoryError(
      f"{on_this_host} needs {host_bytes / 2**30:.2f} GiB of pinned host memory but this machine has"
      f" {total / 2**30:.2f} GiB of RAM in all. {advice}"
    )
  pool = pinned_pool_limit()
  if pool is not None and nbytes > pool:
    raise MemoryError(
      f"{what} needs {nbytes / 2**30:.2f} GiB of pinned host memory but XLA's pinned pool is capped at"
      f" {pool / 2**30:.0f} GiB. Set {POOL_LIMIT_ENV} (GiB) above that before jax starts, or call"
      f" jax_dos.configure_process() before running anything with jax (it raises the cap to"
      f" {DEFAULT_POOL_FRACTION:.0%} of RAM). {advice}"
    )
  if host_bytes > available:
    warnings.warn(
      f"{on_this_host} needs {host_bytes / 2**30:.2f} GiB of pinned host memory and the OS reports"
      f" {available / 2**30:.2f} GiB available; this fits only if memory already held by this process (XLA's pinned"
      " pool) is reused.",
      ResourceWarning,
      stacklevel=3,
    )
