"""A daemon thread that runs queued jobs in order: the overlapped step's host, stream and decider workers.

The first error a job raises is kept in a list shared with the caller, and
every later job is skipped, so that the caller can re-raise it on its own
thread; a job that has run is dropped at once, so that a finished job keeps
nothing alive.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable


class JobThread:
  """A daemon thread running queued jobs in order; the first error stops it and is kept for the caller.

  With ``idle`` (a weak reference to its owner's method), the thread calls it
  every ``idle_every_s`` seconds while no job is queued, and ends once the
  owner is gone. ``wake`` is notified when an error is kept, so that a caller
  waiting on it sees the error at once.
  """

  def __init__(
    self,
    name: str,
    errors: list[BaseException],
    wake: threading.Condition,
    idle: weakref.WeakMethod | None = None,
    idle_every_s: float = 0.002,
  ):
    self._queue: queue.Queue = queue.Queue()
    self._errors, self._wake, self._idle, self._idle_every_s = errors, wake, idle, idle_every_s
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)
    self._thread.start()

  def submit(self, fn: Callable, *args) -> None:
    """Queues ``fn(*args)`` behind the jobs already queued."""
    self._queue.put((fn, args))

  def join(self) -> None:
    """Waits until every job queued so far has run."""
    self._queue.join()

  def stop(self) -> None:
    """Ends the thread once the jobs queued before have run."""
    self._queue.put(None)

  def wait_stopped(self) -> None:
    """Waits for the thread to end (after :meth:`stop`)."""
    if self._thread is not threading.current_thread():
      self._thread.join()

  def _run(self) -> None:
    while True:
      try:
        job = self._queue.get(timeout=self._idle_every_s) if self._idle else self._queue.get()
      except queue.Empty:  # idle: its owner's idle method, while the owner lives
        idle = self._idle()
        if idle is None:
          return
        self._call(idle)
        del idle
        continue
      if job is None:
        self._queue.task_done()
        return
      try:
        self._call(job[0], *job[1])
      finally:
        del job  # a finished job must not keep its owner alive
        self._queue.task_done()

  def _call(self, fn: Callable, *args) -> None:
    try:
      if not self._errors:
        fn(*args)
    except BaseException as e:  # re-raised on the calling thread
      self._errors.append(e)
      with self._wake:
        self._wake.notify_all()
