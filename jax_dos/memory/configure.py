"""What XLA reads once, when its backend starts, set by one explicit call: ``jax_dos.configure_process()``.

Importing jax_dos changes nothing outside the package. A program that offloads more than 64 GiB of state to a GPU
host, or runs several CPU devices in one process, calls :func:`configure_process` before its first jax computation
(``python -m train.gpt`` sets each where it first needs it: ``train/host_memory.py``, ``train/parallel.py``).
"""

from __future__ import annotations

import os

from jax_dos.memory import cpu_client, pinned_pool

SET_BY_CONFIGURE = (pinned_pool.POOL_LIMIT_ENV, cpu_client.POOL_ENV)


def configure_process(pool_fraction: float = pinned_pool.DEFAULT_POOL_FRACTION) -> dict[str, str]:
  """Sets, before jax's backend starts, what XLA reads only then; returns the variables it set (``{}`` after).

  - ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``: XLA's GPU client pins at most 64 GiB of host memory unless it is set;
    this lets it pin ``pool_fraction`` of the host's RAM (``pinned_pool.raise_pinned_pool_limit``).
  - ``PJRT_NPROC``: with several CPU devices in the process, enough threads in XLA's CPU client's pool that a
    multi-device program always progresses (``cpu_client.size_pool``).

  A value the user set is kept, and once the backend has started nothing changes.
  """
  before = {k: os.environ.get(k) for k in SET_BY_CONFIGURE}
  pinned_pool.raise_pinned_pool_limit(pool_fraction)
  cpu_client.size_pool()
  return {k: os.environ[k] for k in SET_BY_CONFIGURE if os.environ.get(k) != before[k]}
