"""The overlapped step's worker threads and the paths they own: the host worker, the stream worker and the decider.

:class:`Workers` makes the host path (``overlap.host_path``) and the stream path (``overlap.stream_path``) from
their state, starts a ``job_thread.JobThread`` for each and one for the clip decision, all three sharing the step's
one failure event, and ends them. A path's methods run on its worker's thread only: the training thread
(``overlap.step``) queues them as jobs (``host`` with ``host_path``, ``stream`` with ``stream_path``) or asks for
them here (a rebalanced plan's moved state, the state for ``opt_state``). Nothing here refers to the step, so a
dropped step's threads end.
"""

from __future__ import annotations

import weakref
from typing import Any

from jax_dos.job_thread import Failure, JobThread
from jax_dos.kernels import host_kernels
from jax_dos.memory.copy_out import CopyOut
from jax_dos.memory.pinned_arena import PinnedArena
from jax_dos.overlap.host_path import HostPath
from jax_dos.overlap.routes import Routes
from jax_dos.overlap.stream_path import IDLE_POLL_S, StreamPath


class Workers:
  """The step's three worker threads and the host and stream paths (module docstring).

  Args:
    routes, hyper, decay: the plan as the threads read it, the AdamW hyperparameters, each leaf's decay flag.
    host_state, stream_state: ``leaf -> (master, mu, nu)`` of the host and streamed leaves (owned by the paths).
    low_dtypes: per leaf, the dtype the host path sends its new weights in.
    failure: the step's one failure event.
    arena, state_out: where the offloaded state lives and what copies the stream path's new state there (``None``:
      XLA's pinned pool).
    weights_on_host: the host leaves whose weights live in pinned host memory (``OverlappedStep``'s ``weights``).
  """

  def __init__(
    self, routes: Routes, hyper: Any, decay: tuple[bool, ...], host_state: dict[int, tuple],
    stream_state: dict[int, tuple], low_dtypes: list[Any], failure: Failure, arena: PinnedArena | None,
    state_out: CopyOut | None, weights_on_host: frozenset[int] = frozenset(),
  ):  # fmt: skip
    self.host_path = HostPath(routes, hyper, decay, host_state, low_dtypes, failure, arena, weights_on_host)
    self.stream_path = StreamPath(routes, hyper, decay, stream_state, failure, arena, state_out)
    self.host = JobThread("jax_dos-overlap-host", failure)
    # Between jobs the stream worker tops up its slots (the one poll, docs/overlap.md), where the plan streams: a
    # rebalanced plan never moves a subgroup to a stream path that had none (overlap.routes.rebalanced).
    top_up = weakref.WeakMethod(self.stream_path.top_up) if routes.stream_order else None
    self.stream = JobThread("jax_dos-overlap-stream", failure, top_up, IDLE_POLL_S)
    self.decider = JobThread("jax_dos-overlap-decide", failure)
    self.host.submit(host_kernels.set_num_threads, None, host_kernels.TRAINING_CORES)

  @property
  def threads(self) -> tuple[JobThread, JobThread, JobThread]:
    return self.decider, self.host, self.stream

  def move(self, to: str, leaves: list[int], routes: Routes) -> None:
    """(the step settled) These leaves' state from one path to the other (``to``: ``"host"`` or ``"stream"``), each
    path taking ``routes``: the giver hands the state over and frees its other buffers, the taker allocates its
    own."""
    (giver, frm), (taker, into) = (
      ((self.stream, self.stream_path), (self.host, self.host_path)) if to == "host"
      else ((self.host, self.host_path), (self.stream, self.stream_path))
    )  # fmt: skip
    given = giver.ask(frm.give, leaves, routes)
    taker.ask(into.take, given, routes)

  def state(self) -> dict[int, tuple]:
    """``leaf -> (master, mu, nu)`` of the host and streamed leaves (the step settled), each path's asked of its
    worker."""
    return {**self.host.ask(self.host_path.state), **self.stream.ask(self.stream_path.state)}

  def stop(self, wait: bool = True) -> None:
    """Ends the threads once the jobs queued before have run; with ``wait``, waits for them to end."""
    for worker in self.threads:
      worker.stop()
    if wait:
      for worker in self.threads:
        worker.wait_stopped()  # no thread of a closed step is left to be stopped as Python exits
