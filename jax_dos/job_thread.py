"""A daemon thread that runs queued jobs in order (the overlapped step's host, stream and decider workers), and the
one failure event its threads share.

Each job's result comes back through the ``concurrent.futures.Future`` that
:meth:`JobThread.submit` returns. The first error a job raises fails that
future and is reported to the owner's :class:`Failure`, which every thread of
the owner shares: any wait on another thread's future waits on that event too
(:func:`result_of`), so a wait ends when its result comes or when any thread
has failed, with no polling. Once the failure is set, every later job is
skipped (its future cancelled). A job that has run is dropped at once, so that
a finished job keeps nothing alive.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, InvalidStateError, wait
from typing import Any

# Tests only (delay_hand_offs): called at every hand-off between the step's threads; None in a run. Set before a
# step's threads start and read by them, never written while they run.
_hand_off_delay: Callable[[], None] | None = None


def delay_hand_offs(delay: Callable[[], None] | None) -> None:
  """(tests) Calls ``delay`` on the thread at every hand-off between the overlapped step's threads, before its
  threads start: a job queued and taken, a result handed back through a future, a wait woken, a copy begun. A
  stress test passes random sleeps, so that every order of the threads' work that can happen comes up; ``None``
  (the default) calls nothing."""
  global _hand_off_delay
  _hand_off_delay = delay


def hand_off() -> None:
  """A hand-off between threads: where the test hook (:func:`delay_hand_offs`) delays this thread."""
  if _hand_off_delay is not None:
    _hand_off_delay()


def hand_back(future: Future, value: Any) -> None:
  """Resolves ``future`` with ``value`` for another thread to read (a job's result, the clip decision): a hand-off
  point. Buffers travel in a ``hand_off.HandOff`` (``hand_off.send``), which one thread takes."""
  hand_off()
  future.set_result(value)


class Failure:
  """The first error any thread of one owner reports: one event, as a future that waits join (:func:`result_of`).

  Thread-safe: the future's own lock orders the reports, and the first one is kept.
  """

  def __init__(self):
    self.future: Future = Future()

  def report(self, error: BaseException) -> None:
    """Sets the event to ``error`` unless an earlier error set it."""
    try:
      self.future.set_result(error)
    except InvalidStateError:  # a thread failed first: its error is the one kept
      pass

  def error(self) -> BaseException | None:
    """The first error reported, or ``None``."""
    return self.future.result() if self.future.done() else None


class JobThread:
  """A daemon thread running queued jobs in order; a job's error fails its future and is reported to ``failure``.

  ``failure``: the owner's :class:`Failure`, shared by its threads; once it is
  set (by this thread or another), the jobs still queued are skipped. With
  ``idle`` (a weak reference to its owner's method), the thread calls it every
  ``idle_every_s`` seconds while no job is queued, and ends once the owner is
  gone: the one poll, of the stream worker, which tops up its copies in when a
  copy lands (JAX gives no callback when an array is ready; docs/overlap.md).
  """

  def __init__(
    self,
    name: str,
    failure: Failure,
    idle: weakref.WeakMethod | None = None,
    idle_every_s: float = 0.002,
  ):
    self._queue: queue.Queue = queue.Queue()
    self._failure, self._idle, self._idle_every_s = failure, idle, idle_every_s
    self._stopped = False
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)
    self._thread.start()

  def submit(self, fn: Callable, *args) -> Future:
    """Queues ``fn(*args)`` behind the jobs already queued; its result (or error) comes back in the future, which
    is cancelled where the job is skipped (a thread failed before)."""
    future: Future = Future()
    hand_off()
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
    if self._failure.error() is not None:
      if future is not None:
        future.cancel()
      return
    try:
      hand_off()
      result = fn(*args)
    except BaseException as e:  # re-raised on the calling thread
      if future is not None:
        future.set_exception(e)
      self._failure.report(e)
    else:
      if future is not None:
        hand_back(future, result)


def result_of(future: Future, failure: Failure, what: str) -> Any:
  """``future``'s result, waited for together with ``failure``: where another thread failed first, a
  ``RuntimeError`` saying ``what`` was waited for, from that error. No polling: one wait on both futures."""
  wait([future, failure.future], return_when=FIRST_COMPLETED)
  hand_off()
  if future.done():
    return future.result()
  raise RuntimeError(f"another thread of the overlapped step failed while this one waited for {what}") from (
    failure.error()
  )
