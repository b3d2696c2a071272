"""The pinned host memory a plan needs, per process and on its host, checked before anything is allocated.

Each process pins its own share of the offloaded state (12 B a parameter it
holds, 4 more where the host kernel updates it, ``interleaved.host_state_bytes``)
in XLA's pinned pool. On a GPU that pool is a BFC allocator that grows by
regions, each twice the last (from 2 MiB, one region at least as large as
the request that opened it), up to a limit (``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``),
and every region is pinned whole when it is made: a process that needs ``N``
bytes holds up to about ``2 N`` of RAM (:func:`pool_reserved`). The processes
of one host share its RAM, so each process's pool is capped at its share,
``DEFAULT_POOL_FRACTION * RAM / processes on the host`` (:func:`pool_share`,
set by :func:`share_pinned_pool` before the backend starts), and a plan
whose state does not fit that share is refused (:func:`check`).

:class:`HostMemory` (the host's RAM, the job's processes on it) is an input
of the plan like the accelerator's budgets: read from the machine by default
(``/proc/meminfo`` and the coordination service), given to
``jax_dos.interleaved_adam(host_memory=...)`` to plan for another host.
The refusal is agreed: every process refuses if one does (a process refusing
alone would leave the others waiting in a collective).
"""

from __future__ import annotations

import dataclasses
import functools
import socket
from collections.abc import Sequence
from typing import NamedTuple

import jax
import numpy as np

from jax_dos.core import moment_formats
from jax_dos.memory import host_ram, pinned_pool
from jax_dos.memory import kinds as memory

REGION_START = 2 << 20  # the BFC allocator's first region when it grows (allow_growth)
ROUNDING = 256  # the BFC allocator's smallest unit


class HostMemory(NamedTuple):
  """A host's RAM and how many of the job's processes run on it (each with its own pinned pool)."""

  ram_bytes: int
  processes: int = 1

  @classmethod
  def here(cls, count_processes: bool = True) -> HostMemory:
    """This machine's RAM (``MemTotal``) and the job's processes on it (1 without ``count_processes``: a tree
    of this process alone, such as the calibration's, whose planning must not wait for the other processes)."""
    return cls(host_ram.host_memory_total(), processes_on_this_host() if count_processes else 1)


@functools.lru_cache(maxsize=1)
def processes_on_this_host() -> int:
  """The job's processes whose host name is this one's (1 without ``jax.distributed``).

  Exchanged once through the coordination service's key-value store, not a collective of the accelerators: it
  runs before any backend starts and from any thread. Every process of the job must call it (each waits for the
  others' names).
  """
  from jax._src import distributed

  client = distributed.global_state.client
  count = distributed.global_state.num_processes or 1
  if client is None or count == 1:
    return 1
  me = distributed.global_state.process_id
  client.key_value_set(f"jax_dos/host/{me}", socket.gethostname())
  names = [client.blocking_key_value_get(f"jax_dos/host/{i}", 300_000) for i in range(count)]
  return sum(name == socket.gethostname() for name in names)


def pool_share(host: HostMemory) -> int:
  """Bytes of pinned pool each process of ``host`` may hold: ``DEFAULT_POOL_FRACTION`` of its RAM, shared evenly."""
  return int(pinned_pool.DEFAULT_POOL_FRACTION * host.ram_bytes / max(1, host.processes))


def share_pinned_pool(host: HostMemory | None = None) -> None:
  """Caps this process's pinned pool at its share of the host (:func:`pool_share`), before the GPU backend starts.

  Call after ``jax.distributed.initialize`` and before the first computation (``train.gpt`` does). A value the
  user set is kept.
  """
  if not pinned_pool.pool_limit_is_ours():
    return
  host = HostMemory.here() if host is None else host
  share, need = max(1, pool_share(host) // 2**30), pinned_pool.plan_pool_gib()
  pinned_pool.set_pool_limit(share if need is None else min(share, need))  # a cap from the run's need may be lower


def pool_reserved(sizes: Sequence[int], limit: int) -> int:
  """Bytes a growing BFC pool of ``limit`` bytes pins to hold buffers of ``sizes`` allocated in order, none freed.

  Regions double from ``REGION_START``; a request larger than the next region opens one of the first power-of-two
  multiple that holds it (and the one after that is not doubled again). A request is placed in the first region
  with room; a region's tail is never split across requests. Returns ``limit + 1`` if they do not fit ``limit``.
  """
  regions: list[int] = []  # free bytes left in each region
  total, region = 0, REGION_START
  for size in sizes:
    need = -(-int(size) // ROUNDING) * ROUNDING
    if not need:
      continue
    j = next((j for j, free in enumerate(regions) if free >= need), None)
    if j is None:
      grew = False
      while need > region:
        region *= 2
        grew = True
      opened = min(region, limit - total)
      if opened < need:
        return limit + 1
      regions.append(opened)
      total += opened
      j = len(regions) - 1
      if not grew:
        region *= 2
    regions[j] -= need
  return total


@dataclasses.dataclass(frozen=True)
class HostPlan:
  """A plan's pinned host memory on ``host``: ``buffers`` are one process's pinned buffers in allocation order."""

  host: HostMemory
  buffers: tuple[int, ...]
  moments: str = "float32"

  @property
  def state_bytes(self) -> int:
    """Pinned bytes one process needs (its share of the state and the host path's buffers)."""
    return sum(self.buffers)

  @property
  def share_bytes(self) -> int:
    """The pinned pool each process may hold on this host (:func:`pool_share`)."""
    return pool_share(self.host)

  def reserved_bytes(self, limit: int | None = None) -> int:
    """RAM one process's pool pins for the buffers under a pool limit (its share by default)."""
    return pool_reserved(self.buffers, self.share_bytes if limit is None else limit)

  def host_bytes(self, limit: int | None = None) -> int:
    """RAM the host's processes pin together under a pool limit per process (each its share by default)."""
    return self.host.processes * self.reserved_bytes(limit)

  @property
  def fits(self) -> bool:
    return self.reserved_bytes() <= self.share_bytes

  def refusal(self) -> str | None:
    """Why this layout cannot fit the host, with its numbers and what to change; ``None`` if it fits."""
    if self.fits:
      return None
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    host = self.host
    per = f"each of the {host.processes} processes on this host" if host.processes > 1 else "this process"
    return (
      f"the offloaded Adam state does not fit this host's RAM: {per} needs {gib(self.state_bytes)} of pinned host"
      f" memory ({moment_formats.state_bytes_per_param(self.moments):.3g} B a parameter it holds with {self.moments}"
      f" moments, 4 more where the host kernel updates it), and its pinned pool may hold"
      f" {gib(self.share_bytes)} ({pinned_pool.DEFAULT_POOL_FRACTION:.0%} of {gib(host.ram_bytes)} RAM"
      + (f" shared by {host.processes} processes)" if host.processes > 1 else ")")
      + ". Change one of: "
      + ("--moments bfloat16 or int8 (8 or about 6 B a parameter, not 12), " if self.moments == "float32" else "")
      + "fewer processes on this host"
      " (spread them over more hosts), a smaller model, or --offload auto or a resident budget (part of the state"
      " on the accelerator)."
    )


def host_plan(leaves: Sequence, placements: Sequence[str], host: HostMemory, float32_copies: bool = False,
              moment_copies: bool = False, moments: str = "float32") -> HostPlan:  # fmt: skip
  """The :class:`HostPlan` of a plan's ``placements`` (one per leaf) for ``leaves`` (arrays or ShapeDtypeStructs,
    in the state's layout) on ``host``.

    The buffers, in the order the optimizer allocates them: every offloaded leaf's master (4 B a parameter, this
  X
    bfloat16 gradient and weight copy) and the copies ``float32_copies`` and ``moment_copies`` add
    (``interleaved.host_state_bytes``).
  """
  size = memory.process_elements
  offloaded = [size(x) for x, p in zip(leaves, placements) if p in ("host", "stream")]
  host_leaves = [x for x, p in zip(leaves, placements) if p == "host"]

  def extra(x) -> int:
    bf16 = np.dtype(x.dtype) == np.dtype(jax.numpy.bfloat16)
    return 4 + (4 if float32_copies and not bf16 else 0) + (4 if moment_copies and bf16 else 0)

  moment = moment_formats.bytes_per_moment(moments)
  state = [4 * n for n in offloaded] + [int(np.ceil(moment * n)) for n in offloaded] * 2
  return HostPlan(host, tuple(state + [extra(x) * size(x) for x in host_leaves]), moments)


def spans_processes(leaves: Sequence) -> bool:
  """Whether some leaf (an array or a ``ShapeDtypeStruct``) is laid out over devices of other processes too."""
  shardings = [getattr(x, "sharding", None) for x in leaves if not memory.is_traced(x)]
  return any(s is not None and not s.is_fully_addressable for s in shardings)


def agreed_refusal(message: str | None) -> str | None:
  """``message``, or the first process's refusal if another process of the job has one; ``None`` if none has.

  A collective: every process of the job calls it, at the same point.
  """
  if jax.process_count() == 1:
    return message
  from jax.experimental import multihost_utils

  mine = np.array([0 if message is None else 1], np.int32)
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
  if message is not None or not every.any():
    return message
  return f"process {int(np.argmax(every))} of the job refused its layout (see its message); so does this one"


def check(plan: HostPlan, agree: bool = True) -> None:
  """Raises ``MemoryError`` if ``plan`` does not fit its host; with ``agree`` (a collective: a tree that spans the
  processes), on every process if it does not fit on some process."""
  message = agreed_refusal(plan.refusal()) if agree else plan.refusal()
  if message is not None:
    raise MemoryError(message)
