"""A checkpoint's agreements between processes (``jax.distributed``); each call is nothing in a single process.

Every process calls these in the same order (they are collectives): process
0's value to all (:func:`from_primary`), whether a flag holds in any process
(:func:`any_process`), and a barrier (:func:`barrier`).
"""

from __future__ import annotations

import jax
import numpy as np


def from_primary(value: int) -> int:
  """Process 0's ``value`` in every process (``value`` itself in a single process); a collective."""
  if jax.process_count() == 1:
    return value
  from jax.experimental import multihost_utils

  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def any_process(flag: bool) -> bool:
  """Whether ``flag`` holds in some process (``flag`` itself in a single process); a collective."""
  if jax.process_count() == 1:
    return flag
  from jax.experimental import multihost_utils

  return bool(np.asarray(multihost_utils.process_allgather(np.int32(flag))).any())


def barrier(name: str) -> None:
  """Every process waits here for the others (nothing in a single process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
