"""Subgroups of the parameter tree and where each one's Adam state is updated.

A *subgroup* is a set of whole leaves, consecutive in tree-flatten order, packed
greedily up to ``subgroup_size`` elements (a larger leaf is a subgroup of its
own; ``subgroup_size=1`` makes every leaf its own subgroup). Each subgroup has a
*placement*:

* ``"device"``: master, mu and nu stay in accelerator memory (fastest, costs
  ``STATE_BYTES``, 12 bytes per parameter of accelerator memory);
* ``"stream"``: state lives in ``pinned_host`` memory, is copied to the
  accelerator for the update and copied back (``STAGING_BYTES``, 16 bytes per
  parameter of accelerator memory while in flight: master, mu and nu in,
  donated to the update, and the float32 update out);
* ``"host"``: state lives in ``pinned_host`` memory and is updated in place by
  the fused host kernel; only gradients and updates cross PCIe.

A :class:`Plan` is a plain, inspectable value: the subgroups, their placements
and, when the performance model chose it, the predicted time of each path and
the calibration it came from. Because subgroups are whole leaves in flatten
order, the optimizer state (and so a checkpoint) never depends on the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, Union

import jax
import numpy as np

from jax_dos.staged.remat import REMAT_POLICIES
from jax_dos.staged.remat import describe as describe_remat

Placement = Literal["device", "stream", "host"]
PLACEMENTS: tuple[str, ...] = ("device", "stream", "host")
MEMORY_KIND: dict[str, str] = {"device": "device", "stream": "pinned_host", "host": "pinned_host"}
RESIDENT_CALL_ELEMENTS = 256 * 2**20  # elements per jitted call of the resident update, at most (whole subgroups)
STATE_BYTES = 12  # accelerator bytes per resident parameter: float32 master, mu, nu
STAGING_BYTES = 16  # accelerator bytes per parameter of a streamed subgroup in flight: its state and the float32 update


@dataclasses.dataclass(frozen=True)
class Plan:
  """Placement of every subgroup of one parameter tree.

  Attributes:
    subgroups: for each subgroup, the flat indices of its leaves (tree-flatten
      order of the parameter tree).
    placements: one of ``"device" | "stream" | "host"`` per subgroup.
    sizes: number of elements per subgroup.
    stream_slots: how many streamed subgroups may be in flight on the
      accelerator at once (their staging memory is ``stream_slots`` times the
      largest streamed subgroup's ``STAGING_BYTES``, 16 bytes per parameter).
    predicted: predicted seconds per path and in total (empty if the plan was
      not chosen by the performance model).
    source: how the plan was made (``"user"``, ``"default"``, ``"model"``).
    calibration: the calibration the model used, as a dict (or ``None``).
    step_room_bytes: accelerator bytes per device beside the training
      step's forward/backward peak (``F - P`` of ``planning.budgets``), for
      what is held through it: resident state, and in the overlapped step the
      streamed subgroups in flight. ``None``: the step's needs were not given.
    step_usable_bytes: accelerator bytes per device the step may take
      beside what was allocated when planning (``(1 - STEP_MARGIN) F`` of
      ``planning.budgets``), where its needs were given and no resident
      budget was: an overlapped step's plan sizes its own room from it
      where its parameters are sharded (``overlap.room``).
    step_room_terms: where the room is not ``F - P`` of the plain program,
      what it was sized from: ``(name, bytes)`` pairs, the usable bytes
      first and then what was taken from them (:meth:`describe` prints them).
    remat: in an overlapped step's plan, the rematerialisation policy of each
      stage (``jax_dos.staged.remat``) that the plan chose beside the placements;
      ``None``: the stages' own.
    ahead_budget_bytes: with ``delay_predict="gradient"``, accelerator bytes
      (per device) for host subgroups' state copies sent ahead: subgroups
      whose copies fit, in plan order, are sent during the forward/backward
      pass, the others in ``update``. ``None``: all are sent ahead.
  """

  subgroups: tuple[tuple[int, ...], ...]
  placements: tuple[str, ...]
  sizes: tuple[int, ...]
  stream_slots: int = 2
  predicted: dict[str, float] = dataclasses.field(default_factory=dict, compare=False)
  source: str = "user"
  calibration: dict[str, Any] | None = dataclasses.field(default=None, compare=False)
  ahead_budget_bytes: int | None = None
  step_room_bytes: int | None = dataclasses.field(default=None, compare=False)
  remat: tuple[str, ...] | None = None
  step_usable_bytes: int | None = dataclasses.field(default=None, compare=False)
  step_room_terms: tuple[tuple[str, int], ...] = dataclasses.field(default=(), compare=False)

  def __post_init__(self):
    if len(self.placements) != len(self.subgroups):
      raise ValueError(
        f"plan has {len(self.placements)} placements for {len(self.subgroups)} subgroups;"
        " give exactly one placement per subgroup (see jax_dos.partition_leaves)."
      )
    for i, p in enumerate(self.placements):
      if p not in PLACEMENTS:
        raise ValueError(f"subgroup {i}: unknown placement {p!r}; use one of {PLACEMENTS}.")
    if self.stream_slots < 1:
      raise ValueError(f"stream_slots must be >= 1, got {self.stream_slots}.")
    if self.ahead_budget_bytes is not None and self.ahead_budget_bytes < 0:
      raise ValueError(f"ahead_budget_bytes must be >= 0 or None, got {self.ahead_budget_bytes}.")

  @property
  def num_leaves(self) -> int:
    return sum(len(s) for s in self.subgroups)

  def leaf_placements(self) -> tuple[str, ...]:
    """The placement of every leaf, in flatten order."""
    out = [""] * self.num_leaves
    for leaves, placement in zip(self.subgroups, self.placements):
      for i in leaves:
        out[i] = placement
    return tuple(out)

  def leaf_memory_kinds(self) -> tuple[str, ...]:
    """The memory kind of every leaf's state, in flatten order (``"device"`` or ``"pinned_host"``)."""
    return tuple(MEMORY_KIND[p] for p in self.leaf_placements())

  def indices(self, placement: str) -> list[int]:
    """Indices of the subgroups with this placement, in plan order."""
    return [i for i, p in enumerate(self.placements) if p == placement]

  def elements(self, placement: str) -> int:
    return sum(self.sizes[i] for i in self.indices(placement))

  def resident_calls(self) -> tuple[tuple[int, ...], ...]:
    """The resident subgroups, in plan order, in jitted calls of at most ``RESIDENT_CALL_ELEMENTS`` elements.

    Bounded calls bound any temporaries XLA makes for them, and flushed
    gradients come back to the accelerator one call at a time instead of all
    at once (a 6.7B model keeps 3.5 B parameters resident: 7 GB of bf16
    gradients). The eager engine and the overlapped step update in these calls.
    """
    calls, size = [[]], 0
    for s in self.indices("device"):
      if calls[-1] and size + self.sizes[s] > RESIDENT_CALL_ELEMENTS:
        calls.append([])
        size = 0
      calls[-1].append(s)
      size += self.sizes[s]
    return tuple(tuple(c) for c in calls if c)

  def resident_call_leaves(self) -> tuple[tuple[int, ...], ...]:
    """The leaves of each of :meth:`resident_calls`: what one ``device_steps.update_on_device`` call updates."""
    return tuple(tuple(i for s in call for i in self.subgroups[s]) for call in self.resident_calls())

  def with_placements(self, placements: Sequence[str], **changes) -> Plan:
    return dataclasses.replace(self, placements=tuple(placements), **changes)

  def describe(self) -> str:
    """A few lines a person can read: what goes where, and the predicted times."""
    total = sum(self.sizes) or 1
    lines = [f"Plan ({self.source}): {len(self.subgroups)} subgroups, {total:,} parameters"]
    for p in (p for p in PLACEMENTS if self.indices(p)):  # the placements in use
      n = self.elements(p)
      lines.append(f"  {p:>6}: {len(self.indices(p)):4d} subgroups, {n:>15,} params ({100 * n / total:5.1f}%)")
    if self.indices("stream"):
      lines.append(f"  stream slots in flight: {self.stream_slots}")
    if self.ahead_budget_bytes is not None and self.indices("host"):
      lines.append(f"  state copies sent ahead: up to {self.ahead_budget_bytes / 2**30:.2f} GiB per device")
    if self.remat is not None:
      lines.append(f"  rematerialisation: {describe_remat(self.remat)}")
    if self.step_room_bytes is not None:
      line = f"  room beside the training step's peak: {self.step_room_bytes / 2**30:.2f} GiB per device"
      if self.step_room_terms:
        (what, usable), *taken = self.step_room_terms
        less = ", ".join(f"{name} {n / 2**30:.2f}" for name, n in taken)
        line += f" ({what} {usable / 2**30:.2f} GiB less {less})"
      lines.append(line)
    if self.predicted:
      shown = {k: v for k, v in self.predicted.items() if k not in PLACEMENTS or self.indices(k)}
      lines.append("  predicted: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in shown.items()))
    return "\n".join(lines)

  __str__ = describe


PlanSpec = Union[str, Sequence[str], Plan]


def agreed_across_processes(plan: Plan) -> Plan:
  """``plan`` as every process of a ``jax.distributed`` job runs it (``plan`` itself in a single process).

  Each process plans alone, from its own calibration and free memory, but all
  of them update the same global arrays, so they must run one plan. Each
  subgroup gets, of the placements the processes chose for it, the one holding
  the least accelerator memory (host, then stream, then device); the plan gets
  the fewest stream slots and the smallest ahead budget (to the KiB below). A
  plan changed so keeps no prediction. Costs one small all-gather, at plan time.
  """
  if jax.process_count() == 1:
    return plan
  from jax.experimental import multihost_utils

  order = ("host", "stream", "device")
  ahead_kib = -1 if plan.ahead_budget_bytes is None else plan.ahead_budget_bytes // 1024
  mine = np.array([order.index(p) for p in plan.placements] + [plan.stream_slots, ahead_kib], np.int32)
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
  if (every == mine).all():
    return plan
  placements = tuple(order[i] for i in every[:, :-2].min(axis=0))
  slots, ahead = int(every[:, -2].min()), every[:, -1]
  ahead_bytes = None if (ahead < 0).all() else int(ahead[ahead >= 0].min()) * 1024
  changed = placements != plan.placements
  return dataclasses.replace(
    plan, placements=placements, stream_slots=slots, ahead_budget_bytes=ahead_bytes,
    predicted={} if changed else plan.predicted, source=plan.source + ("+processes" if changed else ""),
  )  # fmt: skip


# The calibrated rates a plan's fixed split of a fired clip's redo reads (stream_share_of_host).
SHARE_RATES = ("host_rate_concurrent", "stream_rate_concurrent")


def agreed_step_plan(plan: Plan) -> Plan:
  """The overlapped step's ``plan`` as every process of a ``jax.distributed`` job runs it (``plan`` itself in one).

  Each process makes its plan from its own measured stage times and calibration; a data-parallel step runs the same
  stage programs and the same updates of one replicated state everywhere, so they must run one plan:
  :func:`agreed_across_processes`'s placements, stream slots and ahead budget (the leanest; a process whose
  placements changed drops its predictions), the rematerialisation policies where all processes chose the same
  (else ``full`` on every stage, the fewest saved activations, which fits wherever the others do, and no
  predictions), and process 0's rates for the fixed split of a fired clip's redo, so that each subgroup is redone
  by the same path, with the same bits, on every process. A collective: every process calls it at the same point.
  """
  if jax.process_count() == 1:
    return plan
  from jax.experimental import multihost_utils

  agreed = agreed_across_processes(plan)
  remat = [] if plan.remat is None else [REMAT_POLICIES.index(p) for p in plan.remat]
  cal = plan.calibration or {}
  mine = np.array([*remat, *(float(cal.get(k) or 0.0) for k in SHARE_RATES)], np.float64)
  every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), -1)
  if remat and not (every[:, : len(remat)] == every[0, : len(remat)]).all():
    source = agreed.source.split("+processes")[0] + "+processes"
    agreed = dataclasses.replace(agreed, remat=("full",) * len(remat), predicted={}, source=source)
  if cal:
    first = {k: v for k, v in zip(SHARE_RATES, every[0, len(remat) :].tolist()) if v}
    agreed = dataclasses.replace(agreed, calibration={**cal, **first})
  return agreed


def _leaf_size(x) -> int:
  return int(np.prod(np.shape(x), dtype=np.int64))


def check_subgroup_size(subgroup_size: int) -> None:
  if isinstance(subgroup_size, bool) or not isinstance(subgroup_size, (int, np.integer)) or subgroup_size < 1:
    raise ValueError(f"subgroup_size must be an integer >= 1, got {subgroup_size!r}.")


def partition_leaves(params: Any, subgroup_size: int) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
  """Packs the leaves of ``params`` into subgroups, in flatten order.

  Returns ``(subgroups, sizes)``: per subgroup the flat leaf indices and the
  total number of elements. Empty leaves join the current subgroup.
  """
  check_subgroup_size(subgroup_size)
  sizes = [_leaf_size(x) for x in jax.tree.leaves(params)]
  groups: list[list[int]] = []
  group_sizes: list[int] = []
  for i, n in enumerate(sizes):
    if groups and group_sizes[-1] + n <= subgroup_size:
      groups[-1].append(i)
      group_sizes[-1] += n
    else:
      groups.append([i])
      group_sizes.append(n)
  return tuple(tuple(g) for g in groups), tuple(group_sizes)


def partition_groups(groups: Sequence[Any], subgroup_size: int) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
  """Subgroups that never span two parameter groups: ``(subgroups, sizes, group of each subgroup)``.

  Each group's leaves are packed as :func:`partition_leaves` packs a tree;
  leaf indices are those of the whole list of groups, flattened.
  """
  subgroups, sizes, owner = [], [], []
  offset = 0
  for g, tree in enumerate(groups):
    subs, subsizes = partition_leaves(tree, subgroup_size)
    subgroups += [tuple(offset + i for i in s) for s in subs]
    sizes += subsizes
    owner += [g] * len(subs)
    offset += len(jax.tree.leaves(tree))
  return subgroups, sizes, owner


def resolve_plan(spec: PlanSpec, params: Any, subgroup_size: int, *, default: str = "host") -> Plan:
  """Turns a user's ``plan=`` argument into a :class:`Plan` for ``params``.

  ``spec`` is a placement name (for every subgroup), a sequence of placement
  names (one per subgroup), or a :class:`Plan` (checked against the tree).
  ``"auto"`` is handled by the caller (the performance model); here it falls
  back to ``default``.
  """
  subgroups, sizes = partition_leaves(params, subgroup_size)
  if isinstance(spec, Plan):
    # A plan may group leaves differently from subgroup_size; leaves are what count.
    n_leaves = sum(len(s) for s in subgroups)
    if spec.num_leaves != n_leaves:
      raise ValueError(
        f"the given Plan covers {spec.num_leaves} leaves but the parameter tree has {n_leaves}; make the plan for"
        " this tree."
      )
    return spec
  if isinstance(spec, str):
    if spec == "auto":
      spec = default
    if spec not in PLACEMENTS:
      raise ValueError(f"unknown plan {spec!r}; use 'auto', one of {PLACEMENTS}, a list of them, or a jax_dos.Plan.")
    return Plan(subgroups, (spec,) * len(subgroups), sizes, source="default" if spec == default else "user")
  placements = tuple(spec)
  if len(placements) != len(subgroups):
    raise ValueError(
      f"plan lists {len(placements)} placements but the tree packs into {len(subgroups)} subgroups"
      f" with subgroup_size={subgroup_size}; pass one placement per subgroup."
    )
  return Plan(subgroups, placements, sizes, source="user")
