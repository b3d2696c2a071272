"""One parallel numba kernel at a time in the process: every function that launches one holds one lock.

numba picks its threading layer when it first launches a parallel kernel: its default, TBB where installed, else
OpenMP, else its own workqueue, unless ``NUMBA_THREADING_LAYER`` says otherwise; jax_dos leaves the choice to numba. The
workqueue layer aborts the process when two threads launch at once (two optimizers' host workers, a checkpoint's
snapshot or conversion beside an update), and on any layer two kernels at once would share the same cores. A launch
takes tens of microseconds beside kernels of milliseconds, so waiting for the other thread's launch costs nothing that
running both at once would have saved. (An OpenMP launch took 4-8 ms with any core busy in an early design on the H100
machine; on the development machine now, with both cores busy, OpenMP launched in 0.03 ms and the workqueue in 0.15.)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import TypeVar

_LAUNCH = threading.RLock()  # held by the one thread whose parallel kernel runs
F = TypeVar("F", bound=Callable)


def one_launch_at_a_time(fn: F) -> F:
  """``fn`` runs its parallel kernels while no other thread runs one (re-entrant: ``fn`` may call another such
  function)."""

  @functools.wraps(fn)
  def launch(*args, **kwargs):
    with _LAUNCH:
      return fn(*args, **kwargs)

  return launch  # type: ignore[return-value]
