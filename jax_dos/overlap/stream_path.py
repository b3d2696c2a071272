"""The overlapped step's stream path: the stream worker, the streamed state it owns, its slots and copies.

A :class:`StreamPath` belongs to the stream worker thread: every method but
the constructor runs there, and it alone writes the streamed subgroups' state
(master, mu, nu in pinned host memory) and its slots (state on its way in,
ahead of its gradients; new state on its way back). For each streamed
subgroup the training thread hands it the gradients, the subgroup's
parameters (given up until the new ones come back) and a
``concurrent.futures.Future``; the stream path copies the state in, updates
it on the accelerator (the old parameters donated), copies the new state
back into new host buffers and resolves the future with the new parameters
once they are final. It never writes the step's parameters. The copy in, the
step on the accelerator, the copy back and the slots' bookkeeping are
``paths.stream``'s, which the eager engine runs too.

Speculation: a subgroup stepped on the speculated scale keeps its old state
until the decision, for at most ``Routes.stream_speculation`` parameters a
step; past that the worker waits for the decision. After a fired clip it
also steps the host path's share (``StepRecord.host_share``), returning the
new state and the old one through ``StepRecord.share_done``.

With a :class:`~jax_dos.memory.pinned_arena.PinnedArena` the streamed state lives
in it, outside XLA's pinned pool, and the new state is copied into it by a
:class:`~jax_dos.memory.copy_out.CopyOut` (XLA writes only buffers of its own): a
subgroup stepped with the true scale into its own buffers (their copy in has
landed once the update has run), a speculated one into new buffers, a host
subgroup of the fired clip's share into the spare buffers the host path hands
over. The destinations go to the copy worker with the request, and the
tables list none of them until they come back through the copy's future, a
``hand_off.HandOff`` taken once it has landed (``StreamPath._landing``,
``paths.stream.landed``): one holder a buffer, the arena's as XLA's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import jax

from jax_dos import trace
from jax_dos.hand_off import HandOff, receive, send
from jax_dos.job_thread import Failure
from jax_dos.memory import kinds as memory
from jax_dos.memory.copy_out import CopyOut
from jax_dos.memory.pinned_arena import PinnedArena
from jax_dos.optimizer.paths import stream
from jax_dos.overlap.clip import Decision, StepRecord
from jax_dos.overlap.host_path import ShareInput
from jax_dos.overlap.routes import Routes

# How often the stream worker, while it waits (for a copy in to land, or for gradients), tops up its copies in: a slot
# whose copy back has landed takes the next subgroup's state at once (docs/measurements.md).
IDLE_POLL_S = 0.002


@dataclasses.dataclass
class Streamed:
  """A streamed subgroup updated on a speculated scale, its old state kept until the decision."""

  old: list[list[jax.Array]]  # the state before the step (host buffers), kept until the decision
  new: list[list[jax.Array]] | None  # the state after it (XLA's host buffers); None with an arena:
  landed: Future | None  # the copy of the new state into arena buffers, which hands them back (paths.stream.landed)
  grads: list[jax.Array]  # kept for a redo
  params: list[jax.Array]  # the speculated new parameters (donated to a redo)
  future: Future  # the training thread's future of the final parameters


@dataclasses.dataclass
class StreamStep:
  """The stream worker's record of one step (written by the stream worker only)."""

  streamed: dict[int, Streamed] = dataclasses.field(default_factory=dict)  # speculated on, until the decision
  speculated_elements: int = 0  # parameters of the streamed subgroups speculated on
  end: float | None = None  # when the worker last finished a subgroup of this step (perf_counter)

  @staticmethod
  def of(record: StepRecord) -> StreamStep:
    """``record``'s stream record, made at the stream worker's first job of the step (the stream worker's alone)."""
    if record.stream is None:
      record.stream = StreamStep()
    return record.stream


class StreamPath:
  """The streamed subgroups' state and the stream worker's step (module docstring).

  Args:
    routes: the plan as the threads read it (its ``stream_slots``: subgroups in flight at most).
    hyper: the AdamW hyperparameters; ``decay``: per leaf, whether weight decay applies.
    state: leaf -> ``(master, mu, nu)`` of the streamed leaves (owned from here on).
    failure: the step's one failure event (a wait on another thread gives up once it is set).
    arena, copier: where the streamed state lives and what copies it there (``None``: XLA's pinned pool).
  """

  def __init__(
    self, routes: Routes, hyper: Any, decay: tuple[bool, ...], state: dict[int, tuple],
    failure: Failure, arena: PinnedArena | None = None, copier: CopyOut | None = None,
  ):  # fmt: skip
    self.routes, self.hyper, self.decay, self._failure = routes, hyper, decay, failure
    self.arena = arena
    self._landing: dict[int, Future] = {}  # subgroup -> the copy of its new state into its buffers (an arena's)
    self.masters: dict[int, jax.Array] = {}
    self.mus: dict[int, jax.Array] = {}
    self.nus: dict[int, jax.Array] = {}
    self._in_flight = stream.CopiesBack(arena, copier)  # copies back to the host, oldest first
    self._prefetched: dict[int, list] = {}  # subgroup -> its state on its way in, ahead of its gradients
    self._prefetch_next = 0  # index into routes.stream_order of the next subgroup to prefetch
    self._step_open = False  # between a step's first prefetch and its finish
    self._own(state, routes)

  # ----------------------------------------------------------------------------- ownership

  def take(self, given: HandOff[dict[int, tuple]], routes: Routes) -> None:
    """(rebalancing) Takes these leaves' state (``leaf -> (master, mu, nu)``, handed over by the other path's
    :meth:`give`) and ``routes``."""
    self._own(given.take(), routes)

  def _own(self, state: dict[int, tuple], routes: Routes) -> None:
    """Becomes the owner of these leaves' state; takes ``routes``."""
    self.routes = routes
    for i, (m, mu, nu) in state.items():
      self.masters[i], self.mus[i], self.nus[i] = m, mu, nu

  def give(self, leaves: list[int], routes: Routes) -> HandOff[dict[int, tuple]]:
    """Hands these leaves' state over (``leaf -> (master, mu, nu)``); takes ``routes``."""
    self._wait_copies()
    self.routes = routes
    out = {i: (self.masters.pop(i), self.mus.pop(i), self.nus.pop(i)) for i in leaves}
    return HandOff(out, f"the stream path's state of leaves {leaves}")

  def state(self) -> dict[int, tuple]:
    """``leaf -> (master, mu, nu)`` of the streamed leaves now (for the step's ``opt_state``, once settled)."""
    self._wait_copies()
    return {i: (self.masters[i], self.mus[i], self.nus[i]) for i in self.masters}

  def _wait_copies(self) -> None:
    """Waits until every copy back has landed, and lists none: the arrays they name may go to another thread
    (:meth:`give`, a fired clip's share), which may free them, and only an array's owner may read it. The
    subgroups' new state in arena buffers is taken back from the copies (:meth:`_take_landed`)."""
    self._in_flight.wait_all()
    for s in list(self._landing):
      self._take_landed(s)

  def _take_landed(self, s: int) -> None:
    """Subgroup ``s``'s new state, taken from its copy into arena buffers once it has landed, becomes its state."""
    new = stream.landed(self._landing.pop(s))
    for i, m, mu, nu in zip(self.routes.plan.subgroups[s], *new):
      self.masters[i], self.mus[i], self.nus[i] = m, mu, nu

  def _state(self, s: int) -> list[list[jax.Array]]:
    """Subgroup ``s``'s state ``[masters, mus, nus]`` (taken from its last copy back, once that has landed)."""
    if s in self._landing:
      with trace.span("stream.wait_copy_out"):
        self._take_landed(s)
    leaves = self.routes.plan.subgroups[s]
    return [[d[i] for i in leaves] for d in (self.masters, self.mus, self.nus)]

  def _free(self, groups: list[list[jax.Array]]) -> None:
    """Frees host buffers whose copies are done (back to the arena, or to XLA's pool)."""
    stream.free(self.arena, groups)

  # ----------------------------------------------------------------------------- slots and copies in

  def _slots_used(self) -> int:
    return len(self._prefetched) + len(self._in_flight)

  def _wait_for_slot(self) -> None:
    """Frees the oldest slots, waiting for their copies back, until one is free."""
    while self._slots_used() >= self.routes.plan.stream_slots and self._in_flight:
      self._in_flight.wait_oldest()

  def prefetch(self, more: int | None = None) -> None:
    """Starts the copies in of the next streamed subgroups' state, in hand-over order, before their gradients exist.

    A copy into the accelerator starts only once the compute queue has reached
    the point where it was issued (a few stage programs later), so each is
    issued well ahead of its update. ``more=None`` begins a step: as many as
    the slots hold, waiting for the last step's copies out where needed;
    otherwise up to ``more`` further ones, only into slots already free: the
    worker must not wait here while gradients of prefetched subgroups are
    ready (each such wait queues behind the backward pass's programs). A slot
    is held from the copy in to the copy back out.
    """
    if more is None:  # a new step: whatever is left from the last one is stale
      self._prefetched.clear()
      self._prefetch_next = 0
      self._step_open = True
    order, slots, issued = self.routes.stream_order, self.routes.plan.stream_slots, 0
    while self._prefetch_next < len(order) and (more is None or issued < more):
      while self._slots_used() >= slots and self._in_flight:
        if more is not None and not self._in_flight.oldest_landed():
          return
        self._in_flight.wait_oldest()
      if self._slots_used() >= slots:
        return
      s = order[self._prefetch_next]
      with trace.span("stream.prefetch"):
        self._prefetched[s] = stream.copy_in(self._state(s))
      self._prefetch_next += 1
      issued += 1

  def top_up(self) -> None:
    """(idle or waiting) Copies in the next subgroups' state into every slot already free."""
    if self._step_open:
      self.prefetch(more=self.routes.plan.stream_slots)

  def _wait_landed(self, state: Any) -> None:
    """Waits until ``state`` is on the accelerator, topping up the copies in meanwhile."""
    arrays = jax.tree.leaves(state)
    with trace.span("stream.wait_state"):
      while not all(a.is_ready() for a in arrays):
        self.top_up()
        time.sleep(IDLE_POLL_S)

  # ----------------------------------------------------------------------------- a step

  def update(self, record: StepRecord, s: int, given: HandOff, future: Future):
    """(a hand-over) Subgroup ``s``'s step: speculated while the step's speculation allows, else with the true
    scale (waiting for the decision). ``given``: its gradients and its parameters, ``(grads, params)`` (on the
    accelerator); ``future``: where its new parameters go back."""
    grads, params = given.take()
    decision = record.decided()
    if decision is None and not self._may_speculate(record, s):
      decision = self._wait_decision(record, "stream.wait_decision")
    scalars = decision.device if decision else record.spec_device
    self._dispatch(record, s, grads, params, future, scalars, final=decision is not None)

  def _may_speculate(self, record: StepRecord, s: int) -> bool:
    """Whether subgroup ``s`` fits the step's streamed speculation (``Routes.stream_speculation``); counts it if so."""
    if not record.speculate:
      return False
    st = StreamStep.of(record)
    size, cap = self.routes.held_sizes[s], self.routes.stream_speculation
    if cap is not None and st.speculated_elements + size > cap:
      return False
    st.speculated_elements += size
    return True

  def _wait_decision(self, record: StepRecord, span: str | None) -> Decision:
    """Waits for the clip decision, topping up the copies in meanwhile."""
    with trace.span(span) if span else contextlib.nullcontext():
      while not record.decision.done():
        error = self._failure.error()
        if error is not None:
          raise RuntimeError("the step failed before its clip decision") from error
        self.top_up()
        wait_futures([record.decision], timeout=IDLE_POLL_S)
    return record.decision.result()

  def _dispatch(
    self, record: StepRecord, s: int, grads: list[jax.Array], params: list[jax.Array], future: Future, scalars: Any,
    final: bool,
  ) -> None:  # fmt: skip
    st = StreamStep.of(record)
    leaves = list(self.routes.plan.subgroups[s])
    earlier = st.streamed.get(s)
    state = None if earlier else self._prefetched.pop(s, None)
    if not earlier:  # updates come in hand-over order: never prefetch this one or an earlier one again this step
      self._prefetch_next = max(self._prefetch_next, self.routes.stream_rank[s] + 1)
    if state is None:
      self._wait_for_slot()
    with trace.span("stream.dispatch"):
      old = earlier.old if earlier else self._state(s)
      if earlier:  # a wasted speculation's new state goes before the redo's comes (host_bytes counts one of them)
        if earlier.landed is not None:
          wasted = stream.landed(earlier.landed)
        else:
          wasted = earlier.new
          jax.block_until_ready(wasted)  # its copies out must land before the host buffers are freed
        self._free(wasted)
      if state is None:
        state = stream.copy_in(old)
      self._wait_landed(state)  # the update waits here, not on the accelerator's compute queue
      if final and self.arena is None:  # its copy in has landed: the old host state goes before the new comes
        memory.free_groups(old)  # (host_bytes counts one)
      # With an arena, a final state is copied into the old one's buffers: the update has read their copy in.
      new_params, back, landed = stream.step(grads, state, params, scalars, self.hyper,
                                             tuple(self.decay[i] for i in leaves), self._in_flight,
                                             old if final else None)  # fmt: skip
    st.end = time.perf_counter()
    if final:
      st.streamed.pop(s, None)
      self._commit(s, back, landed)
      send(future, new_params, f"subgroup {s}'s new parameters")
    else:
      st.streamed[s] = Streamed(old, back, landed, grads, new_params, future)
    if not earlier:
      self.top_up()

  def _commit(self, s: int, new: list[list[jax.Array]] | None, landed: Future | None) -> None:
    """The new state becomes subgroup ``s``'s (its old host buffers freed already, or handed to the copy as its
    destination): ``new``, XLA's buffers, at once; or with an arena the copy ``landed``, whose buffers are taken
    back before the state is next read (:meth:`_state`). Meanwhile the tables list nothing of ``s``: the copy
    worker holds its buffers."""
    leaves = self.routes.plan.subgroups[s]
    if landed is None:
      for i, m, mu, nu in zip(leaves, *new):
        self.masters[i], self.mus[i], self.nus[i] = m, mu, nu
      return
    for i in leaves:
      del self.masters[i], self.mus[i], self.nus[i]
    self._landing[s] = landed

  def finish(self, record: StepRecord) -> None:
    """(after the step's last hand-over) Commits or redoes the speculated subgroups, in forward order, once the
    decision is known; after a fired clip, steps the host path's share."""
    decision = self._wait_decision(record, None)
    self._step_open = False
    st = StreamStep.of(record)
    for s in sorted(st.streamed, key=self.routes.forward_rank.__getitem__):  # the speculated ones
      streamed = st.streamed[s]
      if decision.fired:
        self._dispatch(record, s, streamed.grads, streamed.params, streamed.future, decision.device, True)  # commits
      else:
        del st.streamed[s]
        self._free(streamed.old)
        self._commit(s, streamed.new, streamed.landed)
        send(streamed.future, streamed.params, f"subgroup {s}'s new parameters")
    st.streamed.clear()
    if decision.fired and self.routes.redo_on_stream:
      self._host_share(record, decision)

  def _host_share(self, record: StepRecord, decision: Decision) -> None:
    """(clip fired) Steps its share of the host subgroups (``Routes.redo_on_stream``) on the accelerator, while the
    host worker redoes the others: the work after the backward pass takes both paths. A fixed share, so that a
    subgroup's numbers never depend on which thread came first."""
    try:
      with trace.span("stream.wait_host"):
        share = receive(record.host_share, self._failure, "the host worker's share of the redo")  # its buffers: ours
      order = sorted(share, key=self.routes.forward_rank.__getitem__)
      redone = {s: self._redo_host(s, share[s], decision) for s in order}
      with trace.span("stream.wait_share_copies"):
        self._wait_copies()
      backs = {s: (stream.landed(landed) if landed is not None else back, old)
               for s, (back, landed, old) in redone.items()}  # fmt: skip
    except BaseException as e:
      record.share_done.set_exception(e)
      raise
    send(record.share_done, backs, "the new state and the old one of the host path's share")

  def _redo_host(self, s: int, share: ShareInput, decision: Decision) -> tuple[list | None, Future | None, list]:
    """Host subgroup ``s`` stepped on the accelerator with the true scale from its untouched state; returns ``(new,
    landed, old)``: the new state in new host buffers (listed in flight), or with an arena the copy into the
    share's spare buffers (whose future hands them back), and the untouched state; the new state and the old one
    go back to the host path (the state and the spare). The share's gradients are freed here, their last holder."""
    leaves = list(self.routes.plan.subgroups[s])
    self._wait_for_slot()
    with trace.span("stream.redo_host"):
      old = share.state
      state = stream.copy_in(old)
      grads = memory.put(share.grads, "device")
      self._wait_landed([state, grads])
      self._free([share.grads])  # their host copies, freed before the next step's land
      into, share.into = share.into, None  # the copy worker's until they have landed
      new_params, back, landed = stream.step(grads, state, share.params, decision.device, self.hyper,
                                             tuple(self.decay[i] for i in leaves), self._in_flight, into)  # fmt: skip
    send(share.future, new_params, f"subgroup {s}'s new parameters")
    return back, landed, old
