"""One parallel numba kernel at a time in the process, on numba's workqueue layer, flushing subnormals.

numba picks its threading layer when it first launches a parallel kernel; the first launch through
:func:`one_launch_at_a_time` selects the workqueue layer unless ``NUMBA_THREADING_LAYER`` chose one (importing
jax_dos changes nothing). OpenMP's barriers wait for every thread of the team, and with the cores busy (XLA's
threads, the engine's dispatch thread, a test run beside) one launch took 4-8 ms: on the H100 machine in an early
design (0.8 s a step for the 123-leaf 1B tree), and on the development machine now (a kernel of 4 M parameters 8.0 ms
a call, median, against the workqueue's 3.2 with both cores busy: ``bench/results/host_kernel_subnormal-cpu/``). This
selection fell out of the code with the launch lock (79653c4); the GPU measurements from then on ran on numba's
default (OpenMP where TBB is not installed).

The workqueue layer aborts the process when two threads launch at once (two optimizers' host workers, a checkpoint's
snapshot or conversion beside an update), and on any layer two kernels at once would share the same cores: every
launching function holds one process-wide lock. A launch takes tens of microseconds beside kernels of milliseconds, so
waiting for the other thread's launch costs nothing that running both at once would have saved.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from typing import TypeVar

import numba

from jax_dos import subnormals

_LAUNCH = threading.RLock()  # held by the one thread whose parallel kernel runs
_layer_chosen = False
F = TypeVar("F", bound=Callable)


def one_launch_at_a_time(fn: F) -> F:
  """``fn`` runs its parallel kernels while no other thread runs one (re-entrant: ``fn`` may call another such
  function), flushing subnormal floats to zero as XLA's CPU backend does (``subnormals.flushing``)."""

  @functools.wraps(fn)
  def launch(*args, **kwargs):
    with _LAUNCH:
      use_workqueue_layer()
      with subnormals.flushing():
        return fn(*args, **kwargs)

  return launch  # type: ignore[return-value]


def use_workqueue_layer() -> None:
  """Selects numba's workqueue threading layer, once, before the process's first parallel launch (module docstring),
  unless ``NUMBA_THREADING_LAYER`` is set; numba reads the setting when it first starts its threads. Called with the
  launch lock held."""
  global _layer_chosen
  if not _layer_chosen:
    if "NUMBA_THREADING_LAYER" not in os.environ:
      numba.config.THREADING_LAYER = "workqueue"
    _layer_chosen = True
