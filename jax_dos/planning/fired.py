"""A step after a fired clip: its timeline, the split of the redo between the paths, and the bound on its length.

With the clip fired (``OverlappedStep(speculation="silent")`` after a fired
step), no offloaded update can start before the decision ``D``, the end of
the backward pass: every host and streamed parameter is updated after it,
and the next forward pass can hide that work only stage by stage. Notation
(one step, seconds, parameters): ``W_<=j`` the offloaded parameters of the
stages ``<= j`` (a subgroup's stage: the one completing its gradient, the
first to use it), ``F_<j`` the next forward pass's stages before ``j`` (as
the window sees them, ``StageTimes.per_window``), ``r = N_D / d`` the
resident update, ``R = k h_c / h + s_c`` what both offloaded paths move a
second after the decision (``Rates.host_after_decision`` and the stream
path's concurrent rate).

* :func:`fired_bound`: stage ``j`` starts no earlier than ``D + r + F_<j``
  (the accelerator's own work) and no earlier than ``D + W_<=j / R`` (its
  weights: both paths, full speed, all on the parameters the forward pass
  needs first), so the exposed update of a fired step is at least
  ``max(r, max_j (W_<=j / R - F_<j))``: what ``timeline.next_forward``
  gives with stage ``j``'s weights final at ``D + W_<=j / R``. No split or order of the paths does
  better at these rates; only a larger resident share (the accelerator's
  room) or faster paths do.
* :func:`fired_share` splits the host subgroups so that both paths follow the
  forward order together, which reaches the bound up to a subgroup where the
  stream path has no subgroups of its own (those it steps first, in
  hand-over order).
* :func:`simulate_fired` is the step as the overlapped step runs it.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax_dos.planning.collectives import Collectives
from jax_dos.planning.rates import Rates
from jax_dos.planning.timeline import StageTimes, Subgroup, next_forward, per_rank


def _forward_order(subgroups: Sequence[Subgroup]) -> list[int]:
  return sorted(range(len(subgroups)), key=lambda s: (subgroups[s].stage, s))


def fired_share(subgroups: Sequence[Subgroup], placements: Sequence[str], rates: Rates) -> set[int]:
  """The host subgroups the stream path steps after a fired clip, spread through the forward order.

  After the decision the host kernel runs at ``r_h = Rates.host_after_decision``
  and the stream path at ``r_s`` (its concurrent rate), first its own
  streamed subgroups (``S`` parameters, ``S / r_s``). Each host subgroup, in
  forward order, goes to the path that would finish it first (ties: the
  host): list scheduling of one forward-ordered queue on two workers. Both
  paths then advance through the forward order together, stage ``j``'s
  weights final at about ``D + W_<=j / (r_h + r_s)`` once the stream path
  has done its own, and they end within a subgroup of each other. (Sharing
  the last host subgroups instead, sized to end together, left the host
  kernel alone on every stage before them: the next forward pass waited for
  it there and then ran the stream path's stages unhindered.) A fixed share
  per plan and rates, so that a subgroup's numbers never depend on which
  thread came first.
  """
  host_rate, stream_rate = max(rates.host_after_decision, 1e-30), max(rates.stream_concurrent, 1e-30)
  t_host = 0.0
  t_stream = sum(g.size for g, p in zip(subgroups, placements) if p == "stream") / stream_rate
  out = set()
  for s in _forward_order(subgroups):
    if placements[s] != "host":
      continue
    on_stream, on_host = t_stream + subgroups[s].size / stream_rate, t_host + subgroups[s].size / host_rate
    if on_stream < on_host:
      out.add(s)
      t_stream = on_stream
    else:
      t_host = on_host
  return out


def simulate_fired(
  times: StageTimes, subgroups: Sequence[Subgroup], placements: Sequence[str], rates: Rates,
  collectives: Collectives | None = None,
) -> dict:  # fmt: skip
  """``timeline.simulate``'s result for a step after a fired clip (``OverlappedStep(speculation="silent")``).

  Nothing offloaded runs before the decision, at the backward pass's end
  ``D`` (with ``collectives``, the last stage's reduction's end): then the
  host kernel steps its host subgroups in forward order at
  ``Rates.host_after_decision``, and the stream path its own subgroups in
  hand-over order, then its share of the host ones (:func:`fired_share`) in
  forward order, at its concurrent rate; resident subgroups are updated at
  ``D`` as in ``simulate``, and the next forward pass follows stage by
  stage, each stage after its all-gather.
  """
  subgroups, rates, ends, gathers = per_rank(times, subgroups, rates, collectives)
  backward_end = ends[0]
  forward_order = _forward_order(subgroups)
  hand_over = sorted(range(len(subgroups)), key=lambda s: (-subgroups[s].stage, s))
  share = fired_share(subgroups, placements, rates)
  queues = {
    "host": [s for s in forward_order if placements[s] == "host" and s not in share],
    "stream": [s for s in hand_over if placements[s] == "stream"] + [s for s in forward_order if s in share],
  }
  rate = {"host": rates.host_after_decision, "stream": rates.stream_concurrent}
  done = [0.0] * len(subgroups)
  path_ends = {}
  for path, queue in queues.items():
    t = backward_end
    for s in queue:
      t += subgroups[s].size / max(rate[path], 1e-30)
      done[s] = t
    path_ends[path] = t
  return next_forward(times, subgroups, placements, rates, done, backward_end, path_ends, gathers)


def fired_bound(
  times: StageTimes, subgroups: Sequence[Subgroup], placements: Sequence[str], rates: Rates,
  collectives: Collectives | None = None,
) -> dict:  # fmt: skip
  """The shortest step after a fired clip that these placements allow at these rates: :func:`simulate_fired`'s
  result with each stage's weights final at ``D + W_<=j / R`` (the module docstring), ``R = host_after_decision +
  stream_concurrent``: both paths busy from the decision to the end, on the parameters the next forward pass needs
  first. Its ``"exposed_s"`` is ``max(r, max_j (W_<=j / R - F_<j))``; ``"host_end_s"`` and
  ``"stream_end_s"`` are both ``D + W / R``."""
  subgroups, rates, ends, gathers = per_rank(times, subgroups, rates, collectives)
  backward_end = ends[0]
  both = max(rates.host_after_decision + rates.stream_concurrent, 1e-30)
  offloaded = [0] * len(times.forward)
  for g, p in zip(subgroups, placements):
    if p != "device":
      offloaded[g.stage] += g.size
  upto, total = [], 0
  for w in offloaded:
    total += w
    upto.append(total)
  done = [backward_end + upto[g.stage] / both for g in subgroups]
  end = backward_end + total / both
  return next_forward(times, subgroups, placements, rates, done, backward_end, {"host": end, "stream": end}, gathers)
