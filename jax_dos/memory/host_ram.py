"""The host's RAM, as ``/proc/meminfo`` reports it: its total, what is available, the headroom a run keeps beside its
pinned need, and the bytes the job's processes on this host need together.
"""

from __future__ import annotations

import os
import socket
import zlib

import jax
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


def host_memory_total() -> int:
  """Bytes of physical host memory (``MemTotal``)."""
  return _meminfo("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_memory_available() -> int:
  """Bytes of host memory available for new allocations (``MemAvailable``)."""
  return _meminfo("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# What a run's resident set holds beside its pinned need (XLA's pool margin, Python, jax, numba, data): a run whose
# need and this exceed the host's RAM is refused before anything moves (pinned_pool.cap_pinned_pool).
HOST_HEADROOM_BYTES = 5 * 2**30


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
