"""The overlapped step's timeline: when each subgroup's update can run and what the next forward pass waits for.

A model of one step of ``jax_dos.OverlappedStep`` on a staged model with
``k`` micro-batches. Times are seconds, sizes parameters, rates parameters per
second (``jax_dos.Calibration``'s). Time 0 is the start of the backward pass
that completes the gradients: the last micro-batch's in the ``"batch"`` order,
the one backward pass of every micro-batch in the ``"stage"`` order
(``jax_dos.staged.micro_batches.schedule``), where each stage's programs run ``k`` times
in a row, so every stage time below counts ``k`` times:

* stage ``i``'s backward pass ends at ``E_i = sum(backward[i:])``, and the
  subgroups of the groups it completes are handed over then;
* the host worker and the stream worker each take their subgroups in
  hand-over order, one at a time, a subgroup starting when it has been handed
  over and the previous one is done; each path runs at its concurrent rate
  while the other path has work in the step, else at its own rate;
* except that while the backward pass runs, the stream path moves at most
  ``stream_backward`` parameters a second: its copies and its update programs
  queue behind the stage programs already dispatched (6.7B on an H100: about
  0.3 G/s then, against 1.9 G/s calibrated);
* and that the stream path speculates on at most ``stream_speculation``
  parameters a step (their old state is kept in host memory until the clip
  decision): a streamed subgroup beyond that starts no earlier than the
  decision, the end of the backward pass;
* the backward pass ends at ``D = E_0``; resident subgroups are updated then,
  ``device_elements / device_rate`` long;
* the next step's forward pass starts at ``D`` plus the resident update, and
  stage ``j`` starts when stage ``j - 1`` is done and every group it uses is
  final (a group's subgroups are all final at its first stage, which is the
  stage that completed its gradient).

:func:`stage_ordered_placements` places by stage order alone, given how many
parameters each path takes. The exposed update is how much later the next forward pass ends than it would
with no update at all: ``step = k (sum(forward) + sum(backward)) + exposed``.
The first stages' gradients come last and their weights are needed first, so
:func:`choose_placements` keeps them resident. Of the rest it streams either
the first ones (the host takes the last stages, with the most time between
their gradients and their next use) or the last ones (the stream path then
works while the backward pass runs, and the host takes the stages between),
trying every such split that fits the host memory budget and keeping the one
predicted fastest.

Host memory (:class:`HostBytes`): every offloaded parameter's state (12 B);
host subgroups also a spare state and the gradient and new-weight copies; a
streamed parameter speculated on, its new state until the decision (12 B).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from jax_dos.planning.collectives import Collectives
from jax_dos.planning.rates import Rates

MICRO_BATCH_ORDERS = ("stage", "batch")  # jax_dos.staged.micro_batches.schedule
# The model's error on a step's time, relative, measured against the runs it predicted (docs/overlap.md, "How far to
# trust a prediction"): a choice between two plans is taken on a predicted gain larger than this, not on less.
PREDICTION_ERROR = 0.05


@dataclasses.dataclass(frozen=True)
class RematCosts:
  """What each stage costs under one rematerialisation policy, on one micro-batch (forward order).

  ``forward`` and ``backward``: seconds of the stage's programs;
  ``saved_bytes``: accelerator bytes (per device) its forward program keeps
  for its backward program beside the stage's input (0 under ``"full"``);
  ``temp_bytes``: its backward program's temporaries.
  """

  forward: tuple[float, ...]
  backward: tuple[float, ...]
  saved_bytes: tuple[int, ...]
  temp_bytes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class StageTimes:
  """Seconds each stage's forward and backward programs take on one micro-batch (forward order).

  ``boundary_bytes``: accelerator bytes (per device) of the stage inputs one
  micro-batch's forward pass keeps; the ``"stage"`` order keeps ``k``
  micro-batches' at once (0: not measured). ``remat``: each measured
  rematerialisation policy's :class:`RematCosts` (``"full"`` among them
  where any is), and ``remat_choices`` the policies a plan may choose among
  (``full`` always stays a choice): none, the stages run their own policies.
  ``temp_bytes``: the largest stage backward program's temporaries (per
  device) with every stage under ``"full"`` (``memory_analysis()``; on a
  sharded mesh they hold the stage's gathered weights and their gradients
  before the reduce-scatter), 0: not measured; ``input_bytes``: each
  stage's input (per device, one micro-batch; ``boundary_bytes`` is their
  sum), empty: not measured. ``gather_ahead``: where a block's weights are
  sharded, whether its backward program was faster given them whole and
  gathering the next block's beside its compute (``jax_dos.staged.gather_ahead``;
  the times are then that way's), ``None`` where none is or it was not
  measured; ``gather_ahead_s`` that program's seconds each way,
  ``(gathering its own, given them whole and gathering ahead)``.
  """

  forward: tuple[float, ...]
  backward: tuple[float, ...]
  boundary_bytes: int = 0
  remat: dict[str, RematCosts] = dataclasses.field(default_factory=dict, compare=False)
  remat_choices: tuple[str, ...] = ()
  temp_bytes: int = dataclasses.field(default=0, compare=False)
  input_bytes: tuple[int, ...] = dataclasses.field(default=(), compare=False)
  gather_ahead: bool | None = dataclasses.field(default=None, compare=False)
  gather_ahead_s: tuple[float, ...] = dataclasses.field(default=(), compare=False)

  def __post_init__(self):
    if len(self.forward) != len(self.backward) or not self.forward:
      raise ValueError("StageTimes needs one forward and one backward time per stage.")
    if min(self.forward) < 0 or min(self.backward) < 0:
      raise ValueError("stage times must be >= 0 seconds.")
    if self.input_bytes and len(self.input_bytes) != len(self.forward):
      raise ValueError(f"StageTimes.input_bytes has {len(self.input_bytes)} stages, the times {len(self.forward)}.")
    for name, costs in self.remat.items():
      if len(costs.forward) != len(self.forward):
        raise ValueError(f"StageTimes.remat[{name!r}] has {len(costs.forward)} stages, the times {len(self.forward)}.")
    if self.remat_choices and "full" not in self.remat:
      raise ValueError("StageTimes.remat_choices needs the costs of 'full' in StageTimes.remat (the fallback).")
    missing = [p for p in self.remat_choices if p not in self.remat]
    if missing:
      raise ValueError(f"StageTimes.remat_choices {missing} have no costs in StageTimes.remat.")

  @property
  def cotangent_bytes(self) -> int:
    """The largest cotangent a micro-batch's backward pass carries from stage to stage: a stage's output, the next
    stage's input (per device)."""
    return max(self.input_bytes, default=0)

  def compute_s(self, micro_batches: int) -> float:
    """The step's forward and backward passes alone."""
    return micro_batches * (sum(self.forward) + sum(self.backward))

  def per_window(self, micro_batches: int, order: str) -> StageTimes:
    """The stage times the update's window sees: each stage's ``k`` programs back to back in the ``"stage"``
    order, one micro-batch's in the ``"batch"`` order (whose last backward pass is the window)."""
    if order not in MICRO_BATCH_ORDERS:
      raise ValueError(f"micro_batch_order must be one of {MICRO_BATCH_ORDERS}, got {order!r}.")
    k = micro_batches if order == "stage" else 1
    return StageTimes(tuple(k * t for t in self.forward), tuple(k * t for t in self.backward), self.boundary_bytes,
                      temp_bytes=self.temp_bytes, input_bytes=self.input_bytes)  # fmt: skip

  def assigned(self, policies: Sequence[str]) -> StageTimes:
    """The stage times with stage ``i`` under ``policies[i]`` (from :attr:`remat`)."""
    costs = [self.remat[p] for p in policies]
    return StageTimes(tuple(c.forward[i] for i, c in enumerate(costs)),
                      tuple(c.backward[i] for i, c in enumerate(costs)), self.boundary_bytes,
                      temp_bytes=self.temp_bytes, input_bytes=self.input_bytes)  # fmt: skip

  def extra_activation_bytes(self, policies: Sequence[str], micro_batches: int, order: str) -> int:
    """Accelerator bytes the step holds at its peak under ``policies`` beyond all ``"full"``, from :attr:`remat`.

    ``k' sum_i saved_i(p_i) + max(0, max_i temp_i(p_i) - max_i temp_i(full))``:
    every micro-batch's saved residuals are alive when the backward pass
    starts in the ``"stage"`` order (``k' = k``), one micro-batch's in the
    ``"batch"`` order (``k' = 1``); and the largest backward program's
    temporaries may grow (a shrink is not counted on: the estimate errs
    toward holding less).
    """
    k = micro_batches if order == "stage" else 1
    costs = [self.remat[p] for p in policies]
    saved = sum(c.saved_bytes[i] for i, c in enumerate(costs))
    temp = max(c.temp_bytes[i] for i, c in enumerate(costs))
    return k * saved + max(0, temp - max(self.remat["full"].temp_bytes))


def remat_candidates(times: StageTimes) -> list[tuple[str, ...]]:
  """Policy assignments, each holding more activations for less recomputation: all ``"full"`` first.

  From all ``"full"``, each next assignment moves one stage (not the last,
  which has no forward program) to the choice (:attr:`StageTimes.remat_choices`)
  that saves the most step time per byte it adds to the stage's saved
  residuals; among equal stages, the last one first (its residuals are freed
  first in the backward pass). A move that saves no time is never made.
  One choice only: that policy on every stage but the last, after all ``"full"``.
  """
  n = len(times.forward)
  full = ("full",) * n
  choices = [p for p in times.remat_choices if p != "full"]
  if not choices:
    return [full]
  if len(times.remat_choices) == 1:
    return [full, (*((choices[0],) * (n - 1)), "full")]
  cost = lambda p, i: times.remat[p].forward[i] + times.remat[p].backward[i]  # noqa: E731
  saved = lambda p, i: times.remat[p].saved_bytes[i]  # noqa: E731
  current, out = list(full), [full]
  while True:
    best = None
    for i in reversed(range(n - 1)):
      for p in choices:
        gain, more = cost(current[i], i) - cost(p, i), saved(p, i) - saved(current[i], i)
        if gain <= 0 or p == current[i]:
          continue
        ratio = gain / max(more, 1)
        if best is None or ratio > best[0] * (1 + 1e-9):
          best = (ratio, i, p)
    if best is None:
      return out
    current[best[1]] = best[2]
    out.append(tuple(current))


@dataclasses.dataclass(frozen=True)
class Subgroup:
  """A subgroup's size and its stage: the first stage using its group, whose backward pass completes its gradient."""

  size: int
  stage: int
  param_bytes: int = 2  # bytes of one parameter (the new weights' copy; the gradient's on the host path)


@dataclasses.dataclass(frozen=True)
class HostBytes:
  """Pinned host bytes a placement needs, per parameter: ``OverlappedStep.host_bytes``'s terms.

  Every offloaded parameter's state (float32 master, mu, nu); a host
  parameter's spare state (the kernel's speculated step writes there) and
  its gradient and new weights (``param_bytes`` each); a streamed parameter
  speculated on, its new state until the clip decision.
  """

  state: int = 12
  spare: int = 12
  speculation: int = 12

  def per_parameter(self, placement: str, param_bytes: int) -> int:
    """Bytes a parameter of that placement needs before any streamed speculation."""
    return {"host": self.state + self.spare + 2 * param_bytes, "stream": self.state}.get(placement, 0)

  def fixed(self, subgroups: Sequence[Subgroup], placements: Sequence[str]) -> int:
    """Bytes before any streamed speculation."""
    return sum(g.size * self.per_parameter(p, g.param_bytes) for g, p in zip(subgroups, placements))

  def speculation_cap(self, subgroups: Sequence[Subgroup], placements: Sequence[str], budget: int | None) -> int | None:
    """Streamed parameters the budget lets the step speculate on (``None``: no limit); -1 when even the fixed bytes
    do not fit."""
    if budget is None:
      return None
    room = budget - self.fixed(subgroups, placements)
    return -1 if room < 0 else room // self.speculation


def simulate(
  times: StageTimes, subgroups: Sequence[Subgroup], placements: Sequence[str], rates: Rates,
  stream_speculation: int | None = None, collectives: Collectives | None = None,
) -> dict:  # fmt: skip
  """The timeline of one step: ``{"exposed_s", "backward_end_s", "forward_end_s", "host_end_s", "stream_end_s"}``.

  ``times`` as the window sees them (:meth:`StageTimes.per_window`);
  ``stream_speculation``: streamed parameters speculated on at most (``None``:
  no limit; the model's parameters). ``collectives``: the step of one rank of a data-parallel job
  (:class:`Collectives`); ``times`` are one rank's stage programs without
  them. One link carries them in order: stage ``i``'s reduction starts when
  its backward pass ends and the link is free, and its subgroups are handed
  over when it ends; the clip is decided once every reduction has ended
  (``backward_end_s``); stage ``j``'s all-gather starts once its groups are
  final and the link is free, and the next forward pass's stage ``j`` waits
  for it (:func:`next_forward`). With ``collectives`` the result also holds
  ``"reduce_end_s"`` (the last reduction's end) and ``"gather_end_s"``.
  """
  subgroups, rates, ends, gathers = per_rank(times, subgroups, rates, collectives)
  backward_end = ends[0]
  both = {"host", "stream"} <= set(placements)
  rate = {
    "host": rates.host_concurrent if both else rates.host,
    "stream": rates.stream_concurrent if both else rates.stream,
  }
  order = sorted(range(len(subgroups)), key=lambda s: (-subgroups[s].stage, s))  # hand-over order
  done = [0.0] * len(subgroups)
  free = {"host": 0.0, "stream": 0.0}
  during_backward = {"host": rate["host"], "stream": min(rate["stream"], rates.stream_backward or rate["stream"])}
  speculation = math.inf if stream_speculation is None else stream_speculation
  if collectives is not None:  # the cap counts the model's parameters; a rank speculates on its share of them
    speculation = collectives.updated(speculation)
  for s in order:
    path = placements[s]
    if path in free:
      start = max(ends[subgroups[s].stage], free[path])
      if path == "stream" and start < backward_end:
        if subgroups[s].size > speculation:
          start = backward_end
        else:
          speculation -= subgroups[s].size
      free[path] = done[s] = _finish(start, subgroups[s].size, backward_end, during_backward[path], rate[path])
  return next_forward(times, subgroups, placements, rates, done, backward_end, free, gathers)


def per_rank(
  times: StageTimes, subgroups: Sequence[Subgroup], rates: Rates, collectives: Collectives | None
) -> tuple[Sequence[Subgroup], Rates, list[float], list[float] | None]:
  """One rank's view of a step: ``(subgroups, rates, ends, gathers)``. ``ends[i]``: when stage ``i``'s gradients
  are final, after its backward programs and (with ``collectives``) its reduction, on one link in the backward
  pass's order; ``gathers``: each stage's all-gather in seconds (``None`` without ``collectives``). With
  ``collectives`` each subgroup is the rank's share and the offloaded paths' rates its share of the host's."""
  n = len(times.forward)
  ends = [sum(times.backward[i:]) for i in range(n)]
  if collectives is None:
    return subgroups, rates, ends, None
  stage_sizes = [sum(g.size for g in subgroups if g.stage == i) for i in range(n)]
  gathers = [collectives.gather_s(z) for z in stage_sizes]
  link = 0.0
  for i in reversed(range(n)):  # the backward pass's order: each stage's reduction after its programs
    link = ends[i] = max(link, ends[i]) + collectives.reduce_s(stage_sizes[i])
  shares = [dataclasses.replace(g, size=collectives.updated(g.size)) for g in subgroups]
  return shares, collectives.shared_rates(rates), ends, gathers


def next_forward(times, subgroups, placements, rates, done, backward_end, path_ends, gathers=None) -> dict:
  """The step's result once each offloaded subgroup's update ends at ``done[s]``: resident subgroups are updated at
  ``backward_end``, and the next forward pass runs stage by stage, each waiting for its groups' final weights and,
  with ``gathers`` (seconds per stage), for their all-gather, in stage order on the link after the last reduction.
  The exposed time counts from the end of the backward pass's programs, so a reduction that ends later is exposed
  too."""
  resident = sum(g.size for g, p in zip(subgroups, placements) if p == "device") / max(rates.device, 1e-30)
  ready = [backward_end + resident] * len(times.forward)
  for s, g in enumerate(subgroups):
    ready[g.stage] = max(ready[g.stage], done[s] if placements[s] != "device" else backward_end + resident)
  extra = {}
  if gathers is not None:
    link = backward_end  # every reduction has ended by the decision
    for j, gather in enumerate(gathers):
      if gather:
        link = ready[j] = max(link, ready[j]) + gather
    extra = {"reduce_end_s": backward_end, "gather_end_s": link}
  t = backward_end + resident
  for j, forward in enumerate(times.forward):
    t = max(t, ready[j]) + forward
  return {
    "exposed_s": t - (sum(times.backward) + sum(times.forward)),
    "backward_end_s": backward_end,
    "forward_end_s": t,
    "host_end_s": path_ends["host"],
    "stream_end_s": path_ends["stream"],
    **extra,
  }


def stream_rate_during_backward(times: StageTimes, subgroup_size: float, run_ahead_stages: int) -> float:
  """The stream path's rate while the backward pass runs: one subgroup per ``run_ahead_stages + 1`` stage programs.

  A copy into the accelerator and an update program each start only once the
  compute queue has reached the point where they were issued, and the
  training thread keeps ``run_ahead_stages`` stage programs queued ahead. So
  while the backward pass runs, each streamed subgroup waits about that many
  programs behind the last one. At 6.7B on an H100 (41 M-parameter
  subgroups, 33 ms a backward stage, 2 stages ahead) this gives 0.42 G/s; the
  trace measured about 0.3 (``docs/overlap.md``).
  """
  stage = sum(times.backward) / len(times.backward)
  return subgroup_size / max((run_ahead_stages + 1) * stage, 1e-30)


def _finish(start: float, size: int, backward_end: float, backward_rate: float, rate: float) -> float:
  """When ``size`` parameters begun at ``start`` are done: ``backward_rate`` until ``backward_end``, then ``rate``."""
  before = max(0.0, backward_end - start) * backward_rate
  if size <= before:
    return start + size / max(backward_rate, 1e-30)
  return max(start, backward_end) + (size - before) / max(rate, 1e-30)


def choose_placements(
  times: StageTimes, subgroups: Sequence[Subgroup], device_elements: int, rates: Rates, allow_stream: bool = True,
  host_budget_bytes: int | None = None, host_bytes: HostBytes = HostBytes(), collectives: Collectives | None = None,
  score: Callable[[list[str], dict], float] | None = None,
) -> tuple[list[str], dict]:  # fmt: skip
  """Placements predicted to hide the most update: ``(placements, simulate's result of them)``.

  Resident first, in the order the forward pass needs the subgroups, up to
  ``device_elements``; of the rest, the first ``j`` or the last ``j`` streamed
  and the others on the host, for the choice (``j`` from 0 to all, 0 only
  without ``allow_stream``) with the smallest predicted exposed time (ties:
  fewer streamed, then the first ones). With ``host_budget_bytes`` only
  choices whose pinned host bytes fit are kept, each streaming with the
  speculation the rest of the budget holds (the result's
  ``"stream_speculation"``); where none fits, the one needing the fewest
  bytes, for the caller to refuse. ``times`` and ``collectives`` as in
  :func:`simulate`. ``score``: what is minimised instead of the exposed
  time, of a choice's placements and :func:`simulate`'s result of them
  (``overlap.plan``: the exposed time expected with the clip firing in a
  share of the steps, ``jax_dos.planning.fired``).
  """
  forward_order = sorted(range(len(subgroups)), key=lambda s: (subgroups[s].stage, s))
  placements = stage_ordered_placements(forward_order, [g.size for g in subgroups], device_elements, 0)
  rest = [s for s in forward_order if placements[s] != "device"]
  best: tuple[float, list[str], dict] | None = None
  smallest: tuple[int, list[str]] | None = None
  for j in range(len(rest) + 1 if allow_stream else 1):
    for streamed in (rest[:j], rest[len(rest) - j :]) if j else ([],):
      trial = list(placements)
      for s in streamed:
        trial[s] = "stream"
      cap = host_bytes.speculation_cap(subgroups, trial, host_budget_bytes)
      if cap is not None and cap < 0:
        need = host_bytes.fixed(subgroups, trial)
        smallest = (need, trial) if smallest is None or need < smallest[0] else smallest
        continue
      result = dict(simulate(times, subgroups, trial, rates, cap, collectives), stream_speculation=cap)
      value = result["exposed_s"] if score is None else score(trial, result)
      if best is None or value < best[0] - 1e-9:
        best = (value, trial, result)
  if best is None:
    return smallest[1], dict(simulate(times, subgroups, smallest[1], rates, 0, collectives), stream_speculation=0)
  return best[1], best[2]


def stage_ordered_placements(
  forward_order: Sequence[int], sizes: Sequence[int], device_elements: int, stream_elements: int
) -> list[str]:
  """Placements by stage order: resident for the first subgroups the forward pass needs, host for the last.

  The first stages' gradients are complete last and their weights are needed
  first, so they get the fastest path (resident, up to ``device_elements``);
  the last stages' gradients come first and their weights are needed last, so
  the host has the longest time for them; streamed subgroups (up to
  ``stream_elements``) sit between. ``forward_order`` lists subgroup indices
  in the order the forward pass needs them.
  """
  placements = ["host"] * len(sizes)
  used = 0
  rest = list(forward_order)
  while rest and used + sizes[rest[0]] <= device_elements:
    used += sizes[rest[0]]
    placements[rest.pop(0)] = "device"
  used = 0
  while rest and used + sizes[rest[0]] <= stream_elements:
    used += sizes[rest[0]]
    placements[rest.pop(0)] = "stream"
  return placements
