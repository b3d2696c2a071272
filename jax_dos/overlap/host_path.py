"""The overlapped step's host path: the host worker, the buffers it owns, and the new weights it hands back.

A :class:`HostPath` belongs to the host worker thread: every method but the
constructor runs there, and it alone writes its buffers: the host subgroups'
state (master, mu, nu in pinned host memory), their spare state (a
speculation steps from the state into it and leaves the state as it was; a
step with the decision known steps the state in place) and the staging
copies of the new weights. The training thread hands it
a subgroup's gradients (already on their way to pinned host memory), the
subgroup's parameters (which it gives up until the new ones come back) and a
``concurrent.futures.Future``; the host path resolves the future with the new
parameters once they are final. It never writes the step's parameters. The
kernel over a subgroup's shards and the weights' copy to the accelerator are
``paths.host``'s, which the eager engine runs too.

When the clip fires, the stream path steps a share of the host subgroups,
spread through the forward order (``overlap.routes.stream_share_of_host``): the host path hands it
their untouched state, gradients, parameters and spare buffers through
``StepRecord.host_share``, keeping none of them (one holder a buffer), and
takes their new state and the old one back through ``StepRecord.share_done``.

With a :class:`~jax_dos.memory.pinned_arena.PinnedArena` every buffer of the host
path (state, spare state, weight copies) is one of its arrays, outside XLA's
pinned pool; a fired clip's share hands the stream path its spare buffers
too, which that path's new state is copied into.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import jax

from jax_dos import trace
from jax_dos.hand_off import HandOff, receive, send
from jax_dos.job_thread import Failure, result_of
from jax_dos.memory import kinds as memory
from jax_dos.memory import pinned_arena
from jax_dos.memory.pinned_arena import PinnedArena
from jax_dos.optimizer import device_steps
from jax_dos.optimizer.paths import host
from jax_dos.overlap.clip import StepRecord
from jax_dos.overlap.routes import Routes


@dataclasses.dataclass
class HostStep:
  """The host worker's record of one step (written by the host worker only)."""

  # subgroup -> leaf -> gradient; emptied once its last kernel has read them (freed before its new weights go back)
  grads: dict[int, dict[int, jax.Array]] = dataclasses.field(default_factory=dict)
  params: dict[int, list[jax.Array]] = dataclasses.field(default_factory=dict)  # subgroup -> its parameters now
  futures: dict[int, Future] = dataclasses.field(default_factory=dict)  # subgroup -> the training thread's future
  speculated: list[int] = dataclasses.field(default_factory=list)
  deferred: list[int] = dataclasses.field(default_factory=list)  # waiting for the decision (no speculation)
  in_place: set[int] = dataclasses.field(default_factory=set)  # stepped with the true scale: the state is the new one
  sent: list[jax.Array] = dataclasses.field(default_factory=list)  # new weights written, their copies maybe in flight
  end: float | None = None  # when the worker last finished a subgroup of this step (perf_counter)

  @staticmethod
  def of(record: StepRecord) -> HostStep:
    """``record``'s host record, made at the host worker's first job of the step (the host worker's alone)."""
    if record.host is None:
      record.host = HostStep()
    return record.host


@dataclasses.dataclass
class ShareInput:
  """A host subgroup handed to the stream path after a fired clip: its untouched state ``[masters, mus, nus]``, its
  gradients in host memory, its parameters (donated to the update), the future of its new parameters and, with an
  arena, the buffers its new state is copied into (its spare state, given up until it comes back as the state).
  The host path holds none of them once it has handed this over (``HostPath._give_share``); the stream path hands
  the new state and the old one back (``(new, old)``, each ``[masters, mus, nus]``)."""

  state: list[list[jax.Array]]
  grads: list[jax.Array]
  params: list[jax.Array]
  future: Future
  into: list[list[jax.Array]] | None = None


class HostPath:
  """The host subgroups' state and the host worker's step (module docstring).

  Args:
    routes: the plan as the threads read it.
    hyper: the AdamW hyperparameters; ``decay``: per leaf, whether weight decay applies.
    state: leaf -> ``(master, mu, nu)`` of the host leaves (owned from here on).
    low_dtypes: per leaf, the dtype its new weights are sent in (the parameter's, bfloat16 or float32).
    failure: the step's one failure event (a wait on another thread gives up once it is set).
    arena: where its buffers live (``None``: XLA's pinned pool).
    weights_on_host: leaves whose weights live in pinned host memory: the parameters handed over with them are host
      buffers, into which the kernel writes the new weights (no copy of them, none to the accelerator), and which go
      back to the training thread as the new parameters.
  """

  def __init__(
    self, routes: Routes, hyper: Any, decay: tuple[bool, ...], state: dict[int, tuple], low_dtypes: list[Any],
    failure: Failure, arena: PinnedArena | None = None, weights_on_host: frozenset[int] = frozenset(),
  ):  # fmt: skip
    self.routes, self.hyper, self.decay, self._failure = routes, hyper, decay, failure
    self.weights_on_host = weights_on_host
    self.arena = arena
    self._low_dtypes = low_dtypes
    self._kernel = host.Kernel(hyper, decay)
    self.masters: dict[int, jax.Array] = {}
    self.mus: dict[int, jax.Array] = {}
    self.nus: dict[int, jax.Array] = {}
    self.lows: dict[int, jax.Array] = {}
    self.spares: dict[int, tuple] = {}
    self._sending: deque = deque()  # new weights on their way in: (record, subgroup, arrays, final)
    self._own(state, routes)

  # ----------------------------------------------------------------------------- ownership

  def take(self, given: HandOff[dict[int, tuple]], routes: Routes) -> None:
    """(rebalancing) Takes these leaves' state (``leaf -> (master, mu, nu)``, handed over by the other path's
    :meth:`give`) and ``routes``."""
    self._own(given.take(), routes)

  def _own(self, state: dict[int, tuple], routes: Routes) -> None:
    """Becomes the owner of these leaves' state, allocating their spare state and weight copies; takes ``routes``."""
    self.routes = routes
    leaves = sorted(state)
    for i in leaves:
      self.masters[i], self.mus[i], self.nus[i] = state[i]
    own = lambda i: (self.masters[i], self.mus[i], self.nus[i])  # noqa: E731
    copied = [i for i in leaves if i not in self.weights_on_host]  # the others' new weights go into their own buffers
    if self.arena is not None:  # what the kernel writes before anything reads it: no zeros needed
      self.lows.update({i: self.arena.array_like(self.masters[i], self._low_dtypes[i]) for i in copied})
      self.spares.update({i: tuple(self.arena.array_like(a) for a in own(i)) for i in leaves})
      return
    self.lows.update(zip(copied, memory.zeros_like_each([(self.masters[i], self._low_dtypes[i]) for i in copied])))
    spares = memory.zeros_like_each([(a, a.dtype) for i in leaves for a in own(i)])  # each in its own format
    self.spares.update({i: tuple(spares[3 * j : 3 * j + 3]) for j, i in enumerate(leaves)})

  def _release(self, a: jax.Array) -> None:
    pinned_arena.release(self.arena, a)

  def give(self, leaves: list[int], routes: Routes) -> HandOff[dict[int, tuple]]:
    """Hands these leaves' state over (``leaf -> (master, mu, nu)``) and frees their other buffers; takes
    ``routes``."""
    self.routes = routes
    out = {i: (self.masters.pop(i), self.mus.pop(i), self.nus.pop(i)) for i in leaves}
    for i in leaves:
      for a in ((self.lows.pop(i),) if i in self.lows else ()) + self.spares.pop(i):
        self._release(a)
    return HandOff(out, f"the host path's state of leaves {leaves}")

  def state(self) -> dict[int, tuple]:
    """``leaf -> (master, mu, nu)`` of the host leaves now (for the step's ``opt_state``, once settled)."""
    return {i: (self.masters[i], self.mus[i], self.nus[i]) for i in self.masters}

  # ----------------------------------------------------------------------------- a step

  def update(self, record: StepRecord, s: int, given: HandOff, future: Future) -> None:
    """(a hand-over) Subgroup ``s``'s step: speculated, with the true scale where the decision is known, or kept for
    the decision (:meth:`finish`). ``given``: its gradients and its parameters, ``(grads, params)``; ``grads``:
    leaf -> gradient in pinned host memory, or (with an arena) the future of the subgroup's gradients in its leaves'
    order, sent by the copy worker (``copy_out``). ``future``: where its new parameters go back."""
    grads, params = given.take()
    with trace.span("host.wait_grads"):
      if isinstance(grads, Future):
        grads = dict(zip(self.routes.plan.subgroups[s], receive(grads, None, f"subgroup {s}'s gradients")))
      else:
        jax.block_until_ready(list(grads.values()))
    st = HostStep.of(record)
    st.grads[s], st.params[s], st.futures[s] = grads, params, future
    decision = record.decided()
    if decision is not None and decision.fired and s in self.routes.redo_on_stream:
      return  # the stream worker steps it
    if decision is None and not record.speculate:
      st.deferred.append(s)  # stepped once the decision is known, in forward order (finish)
      return
    self._host_weights(record, s, decision.host if decision else record.spec_host(), final=decision is not None)
    if decision is None:
      st.speculated.append(s)

  def _host_weights(self, record: StepRecord, s: int, scalars: Any, final: bool) -> None:
    """The kernel's step, the new weights sent to the parameters. A speculation (not ``final``) steps into the spare
    buffers and leaves the state as it was; a step with the true scale (``final``) steps the state in place.

    In place moves 30 bytes of host DRAM a parameter; into the spare, 42: a store to a line the cache does not hold
    reads it first, so each new state buffer is read as well as written (0.69-0.76x in place's rate on an H100
    machine's 16 cores, docs/overlap.md, "The cause, and the fix").
    The copy to the accelerator is issued and left in flight (it starts only once the compute queue has reached
    the point where it was issued, a few stage programs later); the program that writes the weights in place
    is dispatched once the copy has landed (:meth:`_assign_sent`), while the kernel steps later subgroups.
    """
    st = HostStep.of(record)
    leaves, grads = self.routes.plan.subgroups[s], st.grads[s]
    state = lambda i: (grads[i], self.masters[i], self.mus[i], self.nus[i])  # noqa: E731
    on_host = leaves[0] in self.weights_on_host  # a subgroup lies within one group, whose weights live in one place
    into = dict(zip(leaves, st.params[s])) if on_host else self.lows  # where the kernel writes the new weights
    with trace.span("host.kernel"):
      if final:  # the state is untouched (a speculation wrote the spare), and the step is the one that counts
        self._kernel.step(leaves, lambda i: (*state(i), into[i]), scalars)
        st.in_place.add(s)
      else:
        self._kernel.step_into(leaves, lambda i: (*state(i), *self.spares[i], into[i]), scalars)
    if final:
      self._release_grads(st, s)
    if on_host:  # the parameters handed over are the new weights now: nothing to copy
      st.end = time.perf_counter()
      if final:
        self._final(st, s)
      return
    with trace.span("host.send"):
      sent = host.send([self.lows[i] for i in leaves], st.params[s])
    self._sending.append((record, s, sent, final))
    self._assign_sent(wait=False)

  def _assign_sent(self, wait: bool) -> None:
    """Writes the new weights of the subgroups whose copies have landed (all of them with ``wait``), in order, into
    the parameters the host path holds; final ones go back to the training thread."""
    while self._sending and (wait or all(x.is_ready() for x in self._sending[0][2])):
      record, s, sent, final = self._sending.popleft()
      st = HostStep.of(record)
      with trace.span("host.assign"):
        jax.block_until_ready(sent)  # never dispatch a program whose input is in flight: it would hold the queue
        new = device_steps.assign(st.params[s], sent)
      st.params[s] = new
      st.sent += new
      st.end = time.perf_counter()
      if final:
        self._final(st, s)

  def _release_grads(self, st: HostStep, s: int) -> None:
    """Frees subgroup ``s``'s gradients, which no kernel reads again this step: before its new weights go back to the
    training thread, which hands over the next step's gradients of ``s`` only after that (``host_bytes`` counts one
    gradient a parameter)."""
    for a in st.grads[s].values():
      self._release(a)
    st.grads[s] = {}

  @staticmethod
  def _final(st: HostStep, s: int) -> None:
    """Subgroup ``s``'s new parameters are final: they go back to the training thread, which owns them again."""
    send(st.futures.pop(s), st.params.pop(s), f"subgroup {s}'s new parameters")

  def finish(self, record: StepRecord) -> None:
    """(after the step's last hand-over) The decision's consequences for the host subgroups; a fired clip's redo in
    the order the next forward pass needs them, shared with the stream worker (which takes its share of them), then
    the spare buffers become the state."""
    try:
      self._finish(record)
    except BaseException as e:
      if not record.host_share.done():  # the stream worker must not wait for a share that will never come
        record.host_share.set_exception(e)
      raise

  def _finish(self, record: StepRecord) -> None:
    decision = result_of(record.decision, self._failure, "the clip decision")
    st = HostStep.of(record)
    self._assign_sent(wait=True)
    on_stream = self.routes.redo_on_stream if decision.fired else frozenset()
    shared: dict[int, tuple[list, list]] = {}  # subgroup -> (its new state, its old one), handed back
    if decision.fired:
      with trace.span("host.wait_sent"):
        jax.block_until_ready(st.sent)  # the copies read the buffers the redo writes
      st.sent.clear()  # the redo writes into (donates) these
      share = {s: self._give_share(st, s) for s in on_stream & st.grads.keys()}
      send(record.host_share, share, "the host path's share of a fired clip's redo")  # the stream worker's now
      for s in sorted(set(st.speculated + st.deferred) - on_stream, key=self.routes.forward_rank.__getitem__):
        with trace.span("host.redo" if s in st.speculated else "host.kernel_after_decision"):
          self._host_weights(record, s, decision.host, final=True)
      self._assign_sent(wait=True)
      if share:  # committed below, after the swap
        with trace.span("host.wait_stream_redo"):
          shared = receive(record.share_done, self._failure, "the stream worker's share of the redo")
    else:
      for s in st.speculated:
        self._release_grads(st, s)
        self._final(st, s)
      for s in sorted(st.deferred, key=self.routes.forward_rank.__getitem__):
        with trace.span("host.kernel_after_decision"):
          self._host_weights(record, s, decision.host, final=True)
      self._assign_sent(wait=True)
    with trace.span("host.wait_sent"):
      jax.block_until_ready(st.sent)
    for s in st.grads:  # a speculation's new state becomes the state; the old one is the next step's spare
      if s in on_stream or s in st.in_place:
        continue
      for i in self.routes.plan.subgroups[s]:
        current = (self.masters[i], self.mus[i], self.nus[i])
        (self.masters[i], self.mus[i], self.nus[i]), self.spares[i] = self.spares[i], current
    for s, (new, old) in shared.items():  # handed back: the stream path's new state, and the old one as the spare
      for j, i in enumerate(self.routes.plan.subgroups[s]):
        self.masters[i], self.mus[i], self.nus[i] = new[0][j], new[1][j], new[2][j]
        self.spares[i] = (old[0][j], old[1][j], old[2][j])
    st.grads.clear()  # each freed after its last kernel (a fired clip's share: by the stream path, which held them)

  def _give_share(self, st: HostStep, s: int) -> ShareInput:
    """Host subgroup ``s`` handed to the stream worker after a fired clip: its state, gradients, parameters, future
    and (with an arena) its spare buffers leave this path's tables, so that only the stream worker holds them until
    it hands back the new state and the old one (:meth:`_finish`). Without an arena the spare (a wasted
    speculation, or nothing) is freed here: the stream path's new state takes its place, so that the state is never
    held three times (``host_bytes`` counts two)."""
    leaves = self.routes.plan.subgroups[s]
    state = [[table.pop(i) for i in leaves] for table in (self.masters, self.mus, self.nus)]
    spares = [self.spares.pop(i) for i in leaves]
    into = None
    if self.arena is not None:  # the stream path's new state is copied into the spare
      into = [[spare[k] for spare in spares] for k in range(3)]
    else:
      for a in (a for spare in spares for a in spare):
        a.delete()
    grads = st.grads.pop(s)
    return ShareInput(state, [grads[i] for i in leaves], st.params.pop(s), st.futures.pop(s), into)
