"""Buffers on their way between threads, with one holder at a time: in code, not by convention.

The overlapped step's threads exchange buffers: a subgroup's gradients and parameters go from the training thread
to a worker, its new parameters come back, a fired clip's share of the host path's state goes to the stream path and
its new state back, copies into arena buffers come back from the copy workers, and rebalancing moves state between
the paths. Each goes in a :class:`HandOff`. The sender makes it from what it gives up and keeps no reference: it pops
them from its tables, or leaves a :class:`Given` in their place (:class:`Slots`, the training thread's parameters).
The receiver takes the contents once (:meth:`HandOff.take`); from then on it is their one holder, and only the
holder frees a buffer. Taking a hand-off twice, or reading a place whose buffer was given away, raises
:class:`HandOffError` naming the buffer and where it went, instead of a deleted or donated buffer's error from deep
inside XLA (or, worse, a read of memory another thread is writing).

Futures carry hand-offs between threads (:func:`send`, :func:`receive`): a thread that waits for another's buffers
waits on a future, never by polling. A value every thread may read (the clip decision) is not a buffer and is not
handed off.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from jax_dos.job_thread import Failure, hand_back, hand_off, result_of

T = TypeVar("T")
_TAKEN = object()


class HandOffError(RuntimeError):
  """A buffer used by a thread that does not hold it: taken twice, or read where it was given away."""


class HandOff(Generic[T]):
  """``contents`` (buffers, or a structure of them) on their way to one receiver, who takes them once.

  ``what`` names them in errors ("subgroup 3's new parameters"). Thread-safe: one take succeeds.
  """

  __slots__ = ("_contents", "_lock", "what")

  def __init__(self, contents: T, what: str):
    self._contents: Any = contents
    self._lock = threading.Lock()
    self.what = what

  def take(self) -> T:
    """The contents, whose holder the caller now is; :class:`HandOffError` where they were taken before."""
    hand_off()  # the test hook's delay point: a buffer changes hands here
    with self._lock:
      contents, self._contents = self._contents, _TAKEN
    if contents is _TAKEN:
      raise HandOffError(f"{self.what} were taken already: a buffer has one holder, which alone uses and frees it.")
    return contents

  @property
  def taken(self) -> bool:
    return self._contents is _TAKEN

  def __repr__(self) -> str:
    return f"HandOff({self.what}{', taken' if self.taken else ''})"


def send(future: Future, contents: Any, what: str) -> None:
  """Resolves ``future`` with a :class:`HandOff` of ``contents``, which this thread gives up."""
  hand_back(future, HandOff(contents, what))


def receive(future: Future, failure: Failure | None, what: str) -> Any:
  """The contents another thread sent through ``future`` (:func:`send`), taken: waits for them, or raises once any
  thread of ``failure`` has failed (``job_thread.result_of``)."""
  given = result_of(future, failure, what) if failure is not None else future.result()
  return given.take()


class Given:
  """What a holder's place keeps once its buffer was handed off: any use raises :class:`HandOffError`.

  ``what`` names the buffer, ``to`` where it went, ``back`` how it comes back (said in the error). Reading an
  attribute, indexing it, converting it to an array (``__jax_array__``, ``__array__``) or computing with it all
  raise: a model whose parameters were handed to a step fails at its first use of one, with this message.
  """

  __slots__ = ("back", "to", "what")

  def __init__(self, what: str, to: str, back: str = "it holds it until it hands the new one back"):
    self.what, self.to, self.back = what, to, back

  def error(self) -> HandOffError:
    return HandOffError(f"{self.what} was handed to {self.to}: {self.back}.")

  def _use(self, *args: Any, **kwargs: Any) -> Any:
    raise self.error()

  def __getattr__(self, name: str) -> Any:  # any attribute not its own: jax reads .shape, .dtype first
    raise self.error()

  __getitem__ = __jax_array__ = __array__ = __len__ = __iter__ = __float__ = __int__ = __index__ = _use
  __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _use
  __matmul__ = __rmatmul__ = __pow__ = __neg__ = _use

  def __repr__(self) -> str:
    return f"Given({self.what} -> {self.to})"


class Slots:
  """A thread's list of buffers, some of which it may have handed off (the training thread's parameters).

  Reading a place whose buffer was given away (:meth:`give`) raises :class:`HandOffError` until a buffer is put back
  in it; :meth:`held` lists the buffers in hand. ``what``: the buffers' name, said in errors with the index.
  """

  def __init__(self, items: Iterable[Any], what: str):
    self._items = list(items)
    self._what = what

  def _check(self, x: Any) -> Any:
    if isinstance(x, Given):
      raise x.error()
    return x

  def __getitem__(self, index: int | slice) -> Any:
    if isinstance(index, slice):
      return [self._check(x) for x in self._items[index]]
    return self._check(self._items[index])

  def __setitem__(self, index: int, value: Any) -> None:
    self._items[index] = value

  def __len__(self) -> int:
    return len(self._items)

  def __iter__(self) -> Iterator[Any]:
    return (self._check(x) for x in self._items)

  def give(self, indices: Sequence[int], to: str) -> list[Any]:
    """The buffers at ``indices``, handed to ``to``: each place keeps a :class:`Given` until one is put back."""
    out = [self._check(self._items[i]) for i in indices]
    for i in indices:
      self._items[i] = Given(f"{self._what} {i}", to)
    return out

  def held(self) -> list[Any]:
    """The buffers in hand (those not given away)."""
    return [x for x in self._items if not isinstance(x, Given)]
