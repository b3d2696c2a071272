"""A run that is stopped loses nothing: SIGINT, SIGTERM and SIGUSR1 stop it at a step boundary, saved; checkpoints
come by time as well as by steps, each save's cost measured.

:class:`Signals` turns the first of those signals into a request the training loop reads at its next step boundary:
the step in flight finishes, its threads settle, the loop saves that step and ends with status ``128 + signum``. No
``KeyboardInterrupt`` is raised anywhere (inside a thread's join it left the host worker running as Python shut down,
and the process aborted). The signal's own handler does nothing; Python's wakeup file descriptor carries each
signal's number to a watcher thread, which says what will happen and, at a second signal, ends the process at once
(``os._exit``, one line, no traceback, no exit handlers): whatever the main thread is waiting for in native code,
even a synchronous save. What is on disk is then as the checkpoint code leaves any interruption: a step being written
is Orbax's temporary folder, or committed without a manifest, and neither is ever taken for a whole step
(``docs/checkpoints.md``).

:func:`agree` makes every process of a job take the same decision at the same step: one tiny all-gather a step, of
each process's request and of process 0's clock's verdict on a save by time (:class:`SaveClock`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import jax
import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
# A save costs at most this share of the run's time: after a save that cost c seconds of training (all of its time
# where training waited for it), the next save by time comes no sooner than c / SAVE_SHARE seconds after it started.
SAVE_SHARE = 0.05
DEFAULT_CKPT_MINUTES = 15.0  # --ckpt-every-minutes: as Levanter's default; the share above may space saves further


def signal_name(signum: int) -> str:
  return signal.Signals(signum).name


def _write(line: str) -> None:
  """One line on stderr, from any thread, without Python's buffered stream (the main thread may hold its lock)."""
  try:
    os.write(2, (line + "\n").encode())
  except OSError:
    pass


def _ignore(signum, frame) -> None:  # the Python-level handler: the watcher thread acts on the signal
  pass


class Signals:
  """The run's stop requests (module docstring). :meth:`install` in the main thread, :meth:`uninstall` at the end.

  ``requested``: the number of the first signal received (``0``: none). ``saves``: whether a stop saves (``False``
  with ``--no-ckpt`` or a disk that cannot hold a checkpoint): the first signal's line says what will happen.
  A ``SIGINT`` that was ignored when the run started (a shell's background job: Ctrl-C at the terminal is meant for
  the job in front) stays ignored, as Python leaves it.
  """

  def __init__(self, process: int = 0, processes: int = 1):
    self.requested = 0
    self.saves = True
    self._count = 0
    self._where = "" if processes == 1 else f" (process {process} of {processes})"
    self._previous: dict[int, Any] = {}
    self._wakeup_previous: int | None = None
    self._pipe: tuple[int, int] | None = None
    self._thread: threading.Thread | None = None

  def install(self) -> Signals:
    """Takes over the signals (nothing outside the main thread, where Python allows no handler)."""
    if threading.current_thread() is not threading.main_thread():
      return self
    for sig in SIGNALS:
      previous = signal.getsignal(sig)
      if sig == signal.SIGINT and previous is signal.SIG_IGN:
        continue
      self._previous[sig] = previous
      signal.signal(sig, _ignore)
    read, write = os.pipe()
    os.set_blocking(write, False)
    self._pipe = (read, write)
    self._wakeup_previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    self._thread = threading.Thread(target=self._watch, args=(read,), name="train.gpt-signals", daemon=True)
    self._thread.start()
    return self

  def uninstall(self) -> None:
    """Gives the signals back as they were; the watcher ends."""
    if self._pipe is None:
      return
    signal.set_wakeup_fd(self._wakeup_previous if self._wakeup_previous is not None else -1)
    for sig, previous in self._previous.items():
      signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
    os.close(self._pipe[1])  # the watcher reads the end of the pipe, and closes its end
    self._thread.join(5)
    self._pipe = None

  def _watch(self, read: int) -> None:
    try:
      while True:
        data = os.read(read, 64)
        if not data:
          return
        for signum in data:
          if signum in self._previous:
            self._received(signum)
    finally:
      os.close(read)

  def _received(self, signum: int) -> None:
    self._count += 1
    name = signal_name(signum)
    if self._count == 1:
      self.requested = signum
      what = "saves it" if self.saves else "saves nothing"
      _write(f"{name}{self._where}: the run stops at the end of the step in flight and {what}; {name} again stops"
             " at once")  # fmt: skip
      return
    _write(f"stopped by a second {name}{self._where}: nothing more is saved; the checkpoints on disk are as they"
           " were (a save in flight is never taken for a whole one); --resume continues from the newest")  # fmt: skip
    os._exit(128 + signum)


def agree(requested: int, save_due: bool) -> tuple[int, bool]:
  """``(signal, save_due)`` as every process of the job takes them at this step boundary: the signal some process
  received (the lowest number where several did; ``0``: none), and process 0's ``save_due`` (its clock decides). One
  all-gather of two integers a process; in a single process, the values themselves."""
  if jax.process_count() == 1:
    return requested, save_due
  from jax.experimental import multihost_utils

  rows = np.asarray(multihost_utils.process_allgather(np.array([requested, int(save_due)], np.int32)))
  received = [int(s) for s in rows[:, 0] if s]
  return (min(received) if received else 0), bool(rows[0, 1])


class SaveClock:
  """When the next save by time is due, and what each save cost the training.

  ``minutes``: ``--ckpt-every-minutes`` (``0``: no saves by time). After a save that started at ``t`` and cost ``c``
  seconds of training, the next is due at ``t + max(60 * minutes, c / SAVE_SHARE)``. A save's cost is the time the
  training waited for it, plus, where it was written beside the next steps, what those steps took beyond the steps
  before it (their median): measured, not assumed.
  """

  BASELINE_STEPS = 20  # the steps before a save whose median duration is the steps' own

  def __init__(self, minutes: float, now: float):
    self.minutes = minutes
    self.due_at = now + 60 * minutes if minutes > 0 else None
    self._durations: list[float] = []  # recent steps' durations, none of them beside a save
    self._beside: list[float] | None = None  # steps' durations while a save is written beside them
    self._save: dict[str, float] | None = None

  def step_took(self, seconds: float) -> None:
    (self._beside if self._beside is not None else self._durations).append(seconds)
    del self._durations[: -self.BASELINE_STEPS]

  def due(self, now: float) -> bool:
    return self.due_at is not None and now >= self.due_at and self._beside is None

  def saved(self, started: float, waited: float, beside: bool) -> None:
    """A save began at ``started`` and held the training ``waited`` seconds; ``beside``: it is still being written,
    beside the next steps (:meth:`written` once it is)."""
    self._save = {"started": started, "waited": waited}
    if beside:
      self._beside = []
    else:
      self._plan_next(waited)

  def written(self, now: float) -> dict[str, float] | None:
    """The save written beside the steps has finished (at ``now``): its measured cost (``seconds`` from its start,
    ``steps`` beside it, ``per_step`` each took more, ``cost`` in all), and the next save planned from it."""
    if self._beside is None or self._save is None:
      return None
    beside, self._beside = self._beside, None
    base = float(np.median(self._durations)) if self._durations else 0.0
    extra = [max(0.0, d - base) for d in beside]
    cost = self._save["waited"] + sum(extra)
    self._plan_next(cost)
    return {"seconds": now - self._save["started"], "steps": len(beside), "cost": cost,
            "per_step": float(np.mean(extra)) if extra else 0.0, "base": base}  # fmt: skip

  def _plan_next(self, cost: float) -> None:
    if self.minutes > 0 and self._save is not None:
      self.due_at = self._save["started"] + max(60 * self.minutes, cost / SAVE_SHARE)

  @property
  def gap_s(self) -> float | None:
    """Seconds from the last save's start to the next save by time (``None``: none planned)."""
    if self.due_at is None or self._save is None:
      return None
    return self.due_at - self._save["started"]


def now() -> float:
  return time.perf_counter()
