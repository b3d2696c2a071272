"""What the overlapped step's threads read of a plan, and the plan with one subgroup moved.

* :func:`routes`: a plan's :class:`Routes`, one value per plan, never changed:
  each subgroup's place in the forward order, the streamed ones' order, the
  host subgroups the stream path steps when the clip fires
  (:func:`stream_share_of_host`, so that both paths follow the next
  forward pass's order together), the streamed parameters a step may speculate on, and the
  resident update's jitted calls;
* :func:`rebalanced`: the plan with one subgroup moved across the host/stream
  boundary, a new value handed forward to the step.
"""

from __future__ import annotations

import dataclasses
import os

from jax_dos.overlap.layout import StepLayout
from jax_dos.overlap.memory import check_host_memory, speculation_cap
from jax_dos.overlap.plan import REBALANCE_GAP_S
from jax_dos.planning.fired import fired_share
from jax_dos.planning.plan import Plan
from jax_dos.planning.rates import Rates


def stream_share_of_host(plan: Plan, layout: StepLayout) -> set[int]:
  """The host subgroups the stream path steps when the clip fires, spread through the forward order.

  ``jax_dos.planning.fired.fired_share`` at the plan's calibrated rates (equal rates
  without a calibration): after the decision the gradients are in host
  memory and the host worker runs the kernel alone, at the host path's
  slowdown beside the stream path where the calibration measured the kernel
  (``Rates.host_after_decision``), the stream path at its concurrent rate;
  both follow the forward order together. A fixed share, so that a
  subgroup's numbers never depend on which thread came first. A plan of the
  model's (``"auto"``) shares even where nothing streams:
  :func:`room_beside_step` budgets its stream slots beside the step's peak
  whatever the timeline then places, and after the decision the host path
  alone would take the whole update. A user's plan shares only where it
  streams (only then did the user give the slots room). ``JAX_DOS_FIRED_REDO_ON_STREAM=0`` in the environment: no
  share, the host kernel alone steps every host subgroup after the decision (a measurement's switch: the host's DRAM
  serves both paths, docs/overlap.md).
  """
  if os.environ.get("JAX_DOS_FIRED_REDO_ON_STREAM", "1") == "0":
    return set()
  if not plan.indices("stream") and not (plan.source.startswith("model") and plan.indices("host")):
    return set()
  cal = plan.calibration or {}
  host, stream = cal.get("host_rate_concurrent") or 1.0, cal.get("stream_rate_concurrent") or 1.0
  rates = Rates(cal.get("host_rate") or host, stream, 1.0, host, stream, None, cal.get("host_kernel_rate") or 0.0)
  timeline = [dataclasses.replace(g, size=n) for g, n in zip(layout.timeline(), plan.sizes)]
  return fired_share(timeline, plan.placements, rates)


@dataclasses.dataclass(frozen=True, eq=False)
class Routes:
  """What the overlapped step's threads read of one plan: made once per plan (:func:`routes`), never changed.

  ``forward_rank``: each subgroup's place in the order the forward pass needs
  them; ``stream_order``: the streamed subgroups in hand-over order, and
  ``stream_rank`` their places in it; ``redo_on_stream``: the host subgroups
  the stream path steps when the clip fires (:func:`stream_share_of_host`);
  ``stream_speculation``: streamed elements (of those this process holds) a
  step may speculate on (:func:`speculation_cap`), ``held_sizes`` each
  subgroup's (``StepLayout.held_sizes``).
  """

  plan: Plan
  forward_rank: dict[int, int]
  stream_order: tuple[int, ...]
  stream_rank: dict[int, int]
  redo_on_stream: frozenset[int]
  stream_speculation: int
  resident_calls: tuple[tuple[int, ...], ...]  # resident leaves, per jitted update (Plan.resident_call_leaves)
  held_sizes: tuple[int, ...] = ()


def routes(plan: Plan, layout: StepLayout, host_budget_bytes: int, moments: str = "float32") -> Routes:
  """The :class:`Routes` of ``plan`` (``moments``: the optimizer's format, which sizes its host bytes)."""
  stream_order = tuple(s for s in layout.hand_over if plan.placements[s] == "stream")
  return Routes(
    plan, {s: r for r, s in enumerate(layout.forward_order)}, stream_order,
    {s: r for r, s in enumerate(stream_order)}, frozenset(stream_share_of_host(plan, layout)),
    speculation_cap(plan, layout, host_budget_bytes, moments), plan.resident_call_leaves(), layout.held_sizes,
  )  # fmt: skip


def rebalanced(
  plan: Plan,
  layout: StepLayout,
  ends: dict[str, float],
  last_move: str | None,
  host_budget_bytes: int,
  moments: str = "float32",
) -> tuple[Plan | None, str | None, bool]:
  """``(new plan, the path it moved a subgroup to, stop)``: one subgroup across the stream/host boundary.

  ``ends``: when the host and stream paths (``"host"``, ``"stream"``)
  finished their last subgroup of a step, in seconds. Where they are more
  than ``REBALANCE_GAP_S`` apart, the subgroup next to the boundary moves to
  the path that finished first (streamed ones are the earlier stages). No
  move (``None``) where they are close; no move and ``stop`` where the move
  would go back (``last_move`` the other way: the boundary has crossed the
  balance), would leave a path empty, or would not fit the host budget.
  """
  host, stream = ends.get("host"), ends.get("stream")
  if host is None or stream is None or abs(host - stream) < REBALANCE_GAP_S:
    return None, None, False
  to = "host" if stream > host else "stream"
  if last_move not in (None, to):
    return None, None, True
  placements = list(plan.placements)
  side = [s for s in layout.forward_order if placements[s] == ("stream" if to == "host" else "host")]
  if len(side) < 2:  # keep each path in use
    return None, None, True
  placements[side[-1] if to == "host" else side[0]] = to
  new = plan.with_placements(placements, predicted={}, source=plan.source.split("+rebalanced")[0] + "+rebalanced")
  if to == "host":
    try:
      cap = speculation_cap(new, layout, host_budget_bytes, moments)
      check_host_memory(new, layout, cap, host_budget_bytes, moments)
    except MemoryError:
      return None, None, True
  return new, to, False
