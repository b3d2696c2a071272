"""A daemon thread that runs queued jobs in order: the overlapped step's host, stream and decider workers.

Each job's result comes back through the ``concurrent.futures.Future`` that
:meth:`JobThread.submit` returns. The first error a job raises is also kept in
the thread's own :attr:`JobThread.errors` (written by that thread alone), so
that its owner can re-raise it on its own thread, and every later job is
skipped while ``failed()`` says some thread of the owner has failed; a job
that has run is dropped at once, so that a finished job keeps nothing alive.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class JobThread:
  """A daemon thread running queued jobs in order; the first error stops it and is kept for the caller.

  With ``idle`` (a weak reference to its owner's method), the thread calls it
  every ``idle_every_s`` seconds while no job is queued, and ends once the
  owner is gone. ``wake`` is notified when an error is kept, so that a caller
  waiting on it sees the error at once. ``failed`` (default: this thread's
  own error) says whether to skip the jobs still queued; ``errors``: the list
  the thread keeps its error in (a new one by default), which only this
  thread writes.
  """

  def __init__(
    self,
    name: str,
    wake: threading.Condition,
    idle: weakref.WeakMethod | None = None,
    idle_every_s: float = 0.002,
    failed: Callable[[], bool] | None = None,
    errors: list[BaseException] | None = None,
  ):
    self.errors: list[BaseException] = [] if errors is None else errors
    self._queue: queue.Queue = queue.Queue()
    self._wake, self._idle, self._idle_every_s = wake, idle, idle_every_s
    self._failed = failed or (lambda: bool(self.errors))
    self._stopped = False
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)
    self._thread.start()

  def submit(self, fn: Callable, *args) -> Future:
    """Queues ``fn(*args)`` behind the jobs already queued; its result (or error) comes back in the future, which
    is cancelled where the job is skipped (a thread failed before)."""
    future: Future = Future()
    self._queue.put((fn, args, future))
    return future

  def ask(self, fn: Callable, *args) -> Any:
    """``fn(*args)`` run by this thread, waited for; by the caller where the thread has ended (it owns nothing then)."""
    if self._stopped:
      self.wait_stopped()
      return fn(*args)
    return self.submit(fn, *args).result()

  def join(self) -> None:
    """Waits until every job queued so far has run."""
    self._queue.join()

  def stop(self) -> None:
    """Ends the thread once the jobs queued before have run."""
    self._stopped = True
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
        self._call(idle, (), None)
        del idle
        continue
      if job is None:
        self._queue.task_done()
        return
      try:
        self._call(*job)
      finally:
        del job  # a finished job must not keep its owner alive
        self._queue.task_done()

  def _call(self, fn: Callable, args: tuple, future: Future | None) -> None:
    if self._failed():
      if future is not None:
        future.cancel()
      return
    try:
      result = fn(*args)
    except BaseException as e:  # re-raised on the calling thread
      self.errors.append(e)
      if future is not None:
        future.set_exception(e)
      with self._wake:
        self._wake.notify_all()
    else:
      if future is not None:
        future.set_result(result)


def first_error(*lists: list[BaseException]) -> Callable[[], BaseException | None]:
  """A function giving the first error kept in ``lists`` (each written by one thread), or ``None``. It holds the lists
  only, so that a thread given it keeps no owner alive."""
  return lambda: next((errors[0] for errors in lists if errors), None)


def result_of(future: Future, check: Callable[[], None], poll_s: float) -> Any:
  """``future``'s result, calling ``check`` (which raises where the result will never come) every ``poll_s``."""
  while True:
    try:
      return future.result(timeout=poll_s)
    except FutureTimeout:
      check()
