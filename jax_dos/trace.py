"""Where an eager update's time goes: named spans per thread, recorded on request.

::

    with jax_dos.trace.recording() as spans:
        params, state = jax_dos.update_params(tx, grads, state, params)
    print(jax_dos.trace.summary(spans))

The engine marks what its threads do on the host: the calling thread's
resident and streaming dispatch and its waits for free stream slots, the
worker thread's waits for gradients, host kernel calls and sends. Device work
is asynchronous and shows up only as waits, except where a caller watches a
program's output (:func:`watch`; the overlapped step does, for its stage
programs): the ``"accelerator"`` row then shows when each one finished. Off by
default: :func:`span` is then ``contextlib.nullcontext``, so a span enters
nothing of this module, and :func:`watch` costs one check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class Span:
  name: str
  thread: str
  start: float  # time.perf_counter() seconds
  end: float

  @property
  def seconds(self) -> float:
    return self.end - self.start


_spans: list[Span] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[Span]]:
  """Records the spans of everything run inside the block (all threads) into the list it yields."""
  global _spans
  if _spans is not None:
    raise RuntimeError("jax_dos.trace.recording() is already active; nest nothing inside it.")
  global span
  spans: list[Span] = []
  _spans, span = spans, _recorded_span
  try:
    yield spans
  finally:
    _spans, span = None, contextlib.nullcontext


def active() -> list[Span] | None:
  """The list the active :func:`recording` appends to, or ``None`` when nothing records."""
  return _spans


@contextlib.contextmanager
def _recorded_span(name: str) -> Iterator[None]:
  spans = _spans
  if spans is None:  # the recording ended as this span began
    yield
    return
  start = time.perf_counter()
  try:
    yield
  finally:
    spans.append(Span(name, threading.current_thread().name, start, time.perf_counter()))  # append is atomic


# ``with span(name):`` marks the block as ``name`` on the current thread while a :func:`recording` is active. Outside
# one it is ``contextlib.nullcontext``: the threads' spans enter nothing of this module. Call it as ``trace.span``
# (the name is bound anew when a recording starts and ends).
span: Callable[[str], contextlib.AbstractContextManager] = contextlib.nullcontext


def totals(spans: list[Span]) -> dict[str, dict[str, float]]:
  """``{name: {"count", "seconds"}}`` summed over spans, plus ``"wall"``: first start to last end."""
  out: dict[str, dict[str, float]] = {}
  for s in spans:
    t = out.setdefault(s.name, {"count": 0, "seconds": 0.0})
    t["count"] += 1
    t["seconds"] += s.seconds
  if spans:
    out["wall"] = {"count": 1, "seconds": max(s.end for s in spans) - min(s.start for s in spans)}
  return out


def summary(spans: list[Span]) -> str:
  """One line per span name: count and total milliseconds, longest first."""
  rows = sorted(totals(spans).items(), key=lambda kv: -kv[1]["seconds"])
  return "\n".join(f"{name:>22}: {t['seconds'] * 1e3:9.2f} ms in {int(t['count'])}" for name, t in rows)


class _Watcher:
  """Records when dispatched accelerator work finishes (spans on the ``"accelerator"`` row), while tracing."""

  def __init__(self):
    self._queue: queue.Queue = queue.Queue()
    self._last = 0.0
    threading.Thread(target=self._run, name="jax_dos-watch", daemon=True).start()

  def watch(self, name: str, x: Any, spans: list) -> None:
    # A one-element read right behind the stage's program: ``x`` itself may be donated before it is waited on.
    self._queue.put((name, ready_marker(x), time.perf_counter(), spans))

  def _run(self) -> None:
    while True:
      name, x, dispatched, spans = self._queue.get()
      jax.block_until_ready(x)
      end = time.perf_counter()
      spans.append(Span(name, "accelerator", max(dispatched, min(self._last, end)), end))
      self._last = end


_first_element = jax.jit(lambda x: x.ravel()[:1])


def ready_marker(x: Any) -> jax.Array:
  """A one-element array that is ready once the accelerator work producing ``x`` is done.

  Dispatched right behind that work (accelerator work runs in dispatch order),
  it stays valid when ``x`` itself is later donated. It reads one device's
  shard: a program over a sharded array could hold collectives, and
  collectives launched from two threads at once may meet in different orders
  on different devices and wait for each other forever.
  """
  return _first_element(jax.tree.leaves(x)[0].addressable_shards[0].data)


_WATCHER: _Watcher | None = None


def watch(name: str, x: Any) -> None:
  """While a :func:`recording` is active, records when the accelerator work that produces ``x`` has finished.

  A span named ``name`` on the ``"accelerator"`` row, from when the previous
  watched work finished (or ``x`` was dispatched, if later) to when ``x`` is
  ready. Accelerator work runs in dispatch order, so watching each program's
  output in that order gives the accelerator's timeline. Off: one check.
  """
  global _WATCHER
  spans = active()
  if spans is None or x is None:
    return
  if _WATCHER is None:
    _WATCHER = _Watcher()
  _WATCHER.watch(name, x, spans)
