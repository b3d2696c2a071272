"""The training thread's dispatch: how far it runs ahead of the accelerator, and the first step's jobs held back.

**Run-ahead.** The workers' programs (streamed updates, the host path's copies) queue behind whatever the training
thread dispatched before them, and a launch into a full CUDA queue blocks the launching thread (``docs/overlap.md``,
"Pacing"). So the training thread keeps at most ``run_ahead_stages`` stage programs dispatched beyond the one the
accelerator runs: :meth:`Dispatch.pace` waits on the oldest one's marker once more are unrun.

**The first step.** A program's first run initialises it, and a cuDNN graph loaded then is captured from the
launching stream, which a launch from another thread fails (``docs/measurements.md``, the cuDNN race). So the first
step's worker jobs are held (:meth:`Dispatch.submit`) until every program of that step has run
(:meth:`Dispatch.release`); from then on jobs go to their workers at once.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import jax

from jax_dos import trace
from jax_dos.job_thread import JobThread


class Dispatch:
  """The training thread's pacing and its first step's held jobs (module docstring); the training thread's alone."""

  def __init__(self, run_ahead_stages: int):
    self.run_ahead_stages = run_ahead_stages
    self._unrun: deque = deque()  # markers of the stage programs dispatched and maybe not yet run, oldest first
    self._held: list | None = []  # the first step's jobs, until its programs have run

  @property
  def holding(self) -> bool:
    """Whether jobs are still held: the first step's programs have not all run."""
    return self._held is not None

  def pace(self, x: Any) -> None:
    """Waits until at most ``run_ahead_stages`` dispatched stage programs (the last one producing ``x``) are unrun."""
    if not jax.tree.leaves(x):
      return
    self._unrun.append(trace.ready_marker(x))
    while len(self._unrun) > self.run_ahead_stages + 1:
      with trace.span("overlap.pace"):
        jax.block_until_ready(self._unrun.popleft())

  def submit(self, worker: JobThread, *job) -> None:
    """Queues ``job`` for ``worker``, or holds it until the first step's programs have run."""
    if self._held is not None:
      self._held.append((worker, job))
    else:
      worker.submit(*job)

  def release(self, last: Any) -> None:
    """(the first step, once its last program is dispatched) Waits until ``last`` (its last programs' outputs) is
    ready, so that every program of the step has run once, then queues the held jobs; later jobs go at once."""
    if self._held is None:
      return
    jax.block_until_ready(last)
    for worker, job in self._held:
      worker.submit(*job)
    self._held = None
