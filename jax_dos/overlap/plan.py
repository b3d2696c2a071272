"""The overlapped step's plan: where each subgroup goes, what fits beside the step's peak, the host memory it takes.

Functions of the staged model's parameters (:class:`StepLayout`), the
optimizer's own plan and the measured stage times, for ``jax_dos.overlap.step``:

* :func:`plan_step`: the step's plan from shapes alone, before any optimizer
  state exists (``jax_dos.overlapped_plan``): what ``OverlappedStep`` uses,
  and what a training script compares with the plain step's plan before it
  allocates either's state; :func:`abstract_state`: the state's shapes in the
  plan's memory kinds (a template to restore a checkpoint into);
* :func:`make_step_plan`: the placements, from a user's plan or ``"auto"``: the
  resident share that fits beside the step's peak with the streamed subgroups
  in flight (:func:`room_beside_step`; where the parameters are sharded, the
  peak is the stage programs', ``overlap.room``), and with stage times the split of the
  rest between the host and stream paths that the timeline model predicts
  fastest within the host budget (``jax_dos.planning.timeline``);
* the pinned host bytes a plan needs in this process, how many streamed
  parameters the budget lets a step speculate on, and the refusal where they
  do not fit are ``jax_dos.overlap.memory``'s;

What the step's threads read of a plan, and a rebalanced plan, are
``jax_dos.overlap.routes``'. The plan flows one way: this module makes plans
and the step takes them; the step never edits a plan, it asks for a new one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jax_dos.core import moment_formats, partition
from jax_dos.core.state import InterleavedAdamState
from jax_dos.memory import kinds as memory
from jax_dos.optimizer.interleaved import InterleavedAdam, find_interleaved
from jax_dos.overlap.layout import StepLayout, step_layout
from jax_dos.overlap.memory import (
  default_host_budget,
  host_bytes_per,
)
from jax_dos.overlap.room import device_bytes, room_beside_step, stage_room
from jax_dos.planning.collectives import Collectives
from jax_dos.planning.fired import fired_bound, simulate_fired
from jax_dos.planning.plan import (
  PLACEMENTS,
  Plan,
  agreed_step_plan,
)
from jax_dos.planning.rates import Rates
from jax_dos.planning.timeline import (
  MICRO_BATCH_ORDERS,
  PREDICTION_ERROR,
  StageTimes,
  choose_placements,
  remat_candidates,
  stage_ordered_placements,
  stream_rate_during_backward,
)
from jax_dos.staged.stages import Stage, StagedModel

# How many stage programs the training thread may have dispatched beyond the one the accelerator is running. The
# workers' programs (streamed updates, the host path's copies) queue behind whatever the training thread dispatched
# before them, and a launch into a full CUDA queue blocks the launching thread (docs/overlap.md, "Pacing"). With one
# micro-batch a step's stage programs are short and its update's window small: one stage ahead (6.7B, 1 x 8 on an
# H100: 4.9 % of the step exposed with one, 13.8 % with two).
RUN_AHEAD_STAGES = 2
RUN_AHEAD_STAGES_ONE_MICRO_BATCH = 1


def default_run_ahead(micro_batches: int) -> int:
  """Stage programs dispatched ahead of the accelerator by default: ``RUN_AHEAD_STAGES``, one with one micro-batch."""
  return RUN_AHEAD_STAGES_ONE_MICRO_BATCH if micro_batches == 1 else RUN_AHEAD_STAGES


# Streamed subgroups the overlapped step keeps in flight at most (copies in ahead of their gradients, updates whose
# state is on its way back). Each copy starts only once the compute queue has reached it, so more are needed than the
# plain update phase's 2 to keep the link busy (docs/measurements.md).
STREAM_SLOTS = 4
# Rebalancing (OverlappedStep(rebalance=True)): a step moves one subgroup across the stream/host boundary when one
# path finished its step this much later than the other; it stops at the first move back, or after this many steps.
REBALANCE_GAP_S = 0.05
REBALANCE_STEPS = 12
# The first steps' ends are not used: they compile the update programs and the host kernel.
REBALANCE_AFTER_STEPS = 2


@dataclasses.dataclass(frozen=True)
class StepOptions:
  """The overlapped step's options that shape its plan (``OverlappedStep``'s arguments of the same names)."""

  micro_batches: int = 1
  micro_batch_order: str = "stage"
  run_ahead_stages: int | None = None
  stream_slots: int = STREAM_SLOTS
  host_budget_bytes: int | None = None
  gather_ahead: bool | str = "auto"

  def __post_init__(self):
    if self.run_ahead_stages is None and isinstance(self.micro_batches, int):
      object.__setattr__(self, "run_ahead_stages", default_run_ahead(self.micro_batches))
    for name in ("micro_batches", "run_ahead_stages", "stream_slots"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if self.micro_batch_order not in MICRO_BATCH_ORDERS:
      raise ValueError(f"micro_batch_order must be one of {MICRO_BATCH_ORDERS}, got {self.micro_batch_order!r}.")
    if self.host_budget_bytes is None:
      object.__setattr__(self, "host_budget_bytes", default_host_budget())
    if not isinstance(self.gather_ahead, bool) and self.gather_ahead != "auto":
      raise ValueError(f"gather_ahead must be 'auto', True or False, got {self.gather_ahead!r}.")

  def gathers_ahead(self, stage_times: StageTimes | None) -> bool:
    """:attr:`gather_ahead` resolved: ``"auto"`` gathers ahead where the stage times were measured faster so
    (``StageTimes.gather_ahead``), else not."""
    if self.gather_ahead == "auto":
      return bool(stage_times is not None and stage_times.gather_ahead)
    return self.gather_ahead


def overlappable(tx: Any, params: Any) -> InterleavedAdam:
  """The ``InterleavedAdam`` behind ``tx``, refused with what to do where the overlapped step cannot run it."""
  try:
    owner, alone = find_interleaved(tx, params, "OverlappedStep")
  except TypeError:
    alone = False
  if not alone:
    raise TypeError(
      "OverlappedStep takes the transformation returned by jax_dos.interleaved_adam (or interleaved_adamw), alone:"
      " it clips (clip_norm=) and steps AdamW itself. For another optimizer or a chain use the plain path:"
      " loss, grads = jax.value_and_grad(loss_fn)(params, batch), then"
      " tx.update(grads, opt_state, params)."
    )
  if owner.delay or owner.write_behind:
    raise ValueError(
      "OverlappedStep keeps optax's numbers with no delay and does its own write-behind; build the optimizer"
      " without delay/write_behind, or keep those modes on the plain path (jax_dos.update_params after jax.grad)."
    )
  return owner


def plan_step(
  tx: Any,
  stages: list[Stage],
  groups: list,
  *,
  plan: Any = None,
  stage_times: StageTimes | None = None,
  micro_batches: int = 1,
  micro_batch_order: str = "stage",
  run_ahead_stages: int | None = None,
  stream_slots: int = STREAM_SLOTS,
  host_budget_bytes: int | None = None,
  gather_ahead: bool | str = "auto",
  collectives: Collectives | None = None,
  fired_share: float = 0.0,
) -> Plan:
  """The overlapped step's plan, from the groups' shapes: no optimizer state exists or is allocated.

  The arguments are ``OverlappedStep``'s, and so is the plan: pass it as
  ``OverlappedStep(tx, stages, groups, plan=<it>, ...)``. With
  ``stage_times`` it holds the timeline model's predicted step
  (``plan.predicted["step"]`` and ``["exposed"]`` with the clip silent,
  ``["step_clip_fired"]`` after a fired clip and ``["step_clip_fired_bound"]``
  the shortest such step its placements allow (``jax_dos.planning.fired.fired_bound``),
  ``["compute_plain"]`` the forward and backward passes as the plain step
  runs them: every stage ``"full"`` where the plan chose the
  rematerialisation), to compare with the plain step's plan
  (``jax_dos.get_plan``) before either's state is allocated. ``fired_share``:
  the share of steps whose clip is expected to fire (0 to 1): the placements
  and the rematerialisation minimise the expected step
  ``(1 - p) step + p step_clip_fired`` (0: the silent step alone).
  ``collectives``: on a data-parallel mesh, its reductions and gathers
  (``jax_dos.Collectives``), which the timeline then prices; without it the
  prediction holds one device's programs alone.
  """
  options = StepOptions(micro_batches, micro_batch_order, run_ahead_stages, stream_slots, host_budget_bytes,
                        gather_ahead)  # fmt: skip
  if not 0 <= fired_share <= 1:
    raise ValueError(f"fired_share is a share of steps, from 0 to 1; got {fired_share!r}.")
  groups = list(groups)
  owner = overlappable(tx, groups)
  model = StagedModel(stages, len(groups), gather_ahead=options.gathers_ahead(stage_times))
  if stage_times is not None and len(stage_times.forward) != len(model.stages):
    raise ValueError(f"stage_times has {len(stage_times.forward)} stages, the model {len(model.stages)}.")
  layout = step_layout(model, groups, owner.subgroup_size, owner.partitions)
  spec = plan if plan is not None else owner.plan_spec
  made = make_step_plan(
    spec, owner, groups, layout, stage_times=stage_times,
    micro_batches=options.micro_batches, micro_batch_order=options.micro_batch_order,
    run_ahead_stages=options.run_ahead_stages, max_stream_slots=options.stream_slots,
    host_budget_bytes=options.host_budget_bytes, stage_policies=tuple(st.remat for st in model.stages),
    collectives=collectives, fired_share=fired_share,
  )  # fmt: skip
  return agreed_step_plan(made) if isinstance(spec, str) and spec == "auto" else made


HOST_KINDS = ("pinned_host", "unpinned_host", "auto")  # abstract_state(host_kind=...)


def abstract_state(
  plan: Plan, params: Any, moments: str = "float32", partition_replicated: bool | str = "auto",
  host_kind: str = "pinned_host",
) -> InterleavedAdamState:  # fmt: skip
  """``tx.init(params)``'s shapes, dtypes, shardings and memory kinds under ``plan``, with nothing allocated.

  ``moments`` and ``partition_replicated``: the optimizer's (``interleaved_adam``'s arguments of those names), which
  set mu's and nu's format and the state's layout: a parameter replicated over mesh axes has its state partitioned
  over them (``partition.state_layout``), as ``tx.init`` and ``OverlappedStep`` keep it, unless
  ``partition_replicated=False``.

  A template to restore a checkpoint straight into the plan's placements and the state's layout
  (``jax_dos.CheckpointManager.restore(params=..., opt_state=<this>)``): each device reads only its shards.

  ``host_kind``: where the offloaded leaves are read. ``"pinned_host"``: in their layout, in XLA's pinned pool, where
  ``OverlappedStep`` runs on them as they are (and the pool keeps that memory). ``"unpinned_host"``: each leaf whole
  on this process's CPU device, in ordinary memory; ``OverlappedStep`` given that state moves each leaf into its own
  pinned memory and deletes it, which gives the memory back, so a resumed process holds the state once, as a fresh
  one does (``docs/checkpoints.md``, "A resume's host memory"). Every process reads whole leaves that way: for a
  process of its own. ``"auto"``: ``"unpinned_host"`` in a process of its own that has a CPU backend, else
  ``"pinned_host"``.
  """
  if host_kind not in HOST_KINDS:
    raise ValueError(f"host_kind must be one of {HOST_KINDS}, got {host_kind!r}.")
  if host_kind == "auto":
    alone = jax.process_count() == 1 and memory.cpu_device() is not None
    host_kind = "unpinned_host" if alone else "pinned_host"
  leaves, treedef = jax.tree.flatten(partition.state_layout(params) if partition_replicated is not False else params)
  kinds = plan.leaf_memory_kinds()
  if len(kinds) != len(leaves):
    raise ValueError(f"the plan covers {len(kinds)} leaves, params have {len(leaves)}.")
  cpu = memory.cpu_device() if host_kind == "unpinned_host" else None
  if host_kind == "unpinned_host" and cpu is None:
    raise ValueError(
      "host_kind='unpinned_host' reads the offloaded leaves onto this process's CPU device, and this process has no"
      " CPU backend (JAX_PLATFORMS leaves it out): add cpu to JAX_PLATFORMS, or pass host_kind='pinned_host'."
    )

  def like(x, kind, fmt="float32"):
    sharding = getattr(x, "sharding", None)
    sharding = None if sharding is None else sharding.with_memory_kind(kind)
    if cpu is not None and kind != "device":  # whole, in this process's ordinary memory
      sharding = jax.sharding.SingleDeviceSharding(cpu, memory_kind="unpinned_host")
    elif fmt == "int8" and sharding is not None:
      sharding = jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)), memory_kind=kind)
    shape = moment_formats.stored_shape(x.shape, fmt)
    return jax.ShapeDtypeStruct(shape, moment_formats.stored_dtype(fmt), sharding=sharding)

  tree = lambda fmt="float32": jax.tree.unflatten(treedef, [like(x, k, fmt) for x, k in zip(leaves, kinds)])  # noqa: E731
  first = getattr(leaves[0], "sharding", None) if leaves else None
  if isinstance(first, jax.sharding.NamedSharding):
    scalar = jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
  else:
    scalar = jax.sharding.SingleDeviceSharding(next(iter(first.device_set)) if first else jax.devices()[0])
  moment_formats.check(moments)
  count = jax.ShapeDtypeStruct((), jnp.int32, sharding=scalar)
  return InterleavedAdamState(count, tree(), tree(moments), tree(moments))


def make_step_plan(
  spec: Any, owner: Any, groups: list, layout: StepLayout, *, stage_times: StageTimes | None, micro_batches: int,
  micro_batch_order: str, run_ahead_stages: int, max_stream_slots: int, host_budget_bytes: int,
  stage_policies: tuple[str, ...] | None = None, collectives: Collectives | None = None, fired_share: float = 0.0,
) -> Plan:  # fmt: skip
  """The step's plan from ``spec`` (``"auto"``, a placement, a list of them, or a ``Plan`` within groups).

  ``"auto"`` sizes its shares from ``owner``'s own plan (made by ``tx.init``
  before any state took accelerator memory): the resident share and the
  streaming slots that fit beside the step's peak, then by the timeline model
  with ``stage_times`` (``source="model+timeline"``, ``predicted`` holding the
  step, :func:`_timeline_plan`: with the stages' measured policies, the
  rematerialisation too), else the plain plan's shares by stage order
  (``"model+stages"``). ``stage_policies``: the stages' own policies;
  ``collectives``: the mesh's, for the timeline; ``fired_share``: :func:`plan_step`'s.
  """
  subgroups, sizes, forward_order = layout.subgroups, layout.sizes, layout.forward_order
  if isinstance(spec, Plan):
    where = {i: g for g, tree_range in enumerate(_group_ranges(groups)) for i in tree_range}
    for s, leaves in enumerate(spec.subgroups):
      if len({where[i] for i in leaves}) > 1:
        raise ValueError(
          f"plan subgroup {s} spans two parameter groups; the overlapped step needs subgroups within groups"
          " (jax_dos.planning.plan.partition_groups), or use the plain path (tx.update after jax.grad)."
        )
    return spec
  if isinstance(spec, str) and spec == "auto":
    whole = owner.plan_for(groups)
    boundaries = 0  # the "stage" order keeps every micro-batch's stage inputs at the step's peak, not one's
    if micro_batch_order == "stage" and stage_times is not None:
      boundaries = (micro_batches - 1) * stage_times.boundary_bytes
    most = None  # resident elements at most: the plain plan's, unless the room is the stage programs'
    own = stage_room(whole.step_usable_bytes, stage_times, layout.gradient_bytes, layout.last_stages or layout.stages,
                     layout.params_sharded, micro_batches, micro_batch_order, layout.ahead_bytes)  # fmt: skip
    if own is not None:  # its peak holds every micro-batch's stage inputs
      whole = dataclasses.replace(whole, step_room_bytes=own.room, step_room_terms=own.terms())
      boundaries, most = 0, sum(sizes)
    if stage_times is None or whole.calibration is None:
      resident, slots = room_beside_step(whole, layout.device_share, sizes, forward_order, max_stream_slots,
                                         boundaries, owner.hyper.moments, most)  # fmt: skip
      stream = max(0, whole.elements("stream") + whole.elements("device") - resident)  # displaced: needed early
      placements = stage_ordered_placements(forward_order, sizes, resident, stream)
      return Plan(subgroups, tuple(placements), sizes, slots, source="model+stages", calibration=whole.calibration,
                  step_room_bytes=whole.step_room_bytes, step_room_terms=whole.step_room_terms)  # fmt: skip
    return _timeline_plan(whole, layout, stage_times, boundaries, stage_policies, micro_batches,
                          micro_batch_order, run_ahead_stages, max_stream_slots, host_budget_bytes,
                          owner.hyper.moments, collectives, most, fired_share)  # fmt: skip
  if isinstance(spec, str):
    if spec not in PLACEMENTS:
      raise ValueError(f"unknown plan {spec!r}; use 'auto', one of {PLACEMENTS}, a list of them, or a jax_dos.Plan.")
    return Plan(subgroups, (spec,) * len(subgroups), sizes, max_stream_slots, source="user")
  placements = tuple(spec)
  if len(placements) != len(subgroups):
    raise ValueError(
      f"plan lists {len(placements)} placements but the groups pack into {len(subgroups)} subgroups"
      " (jax_dos.planning.plan.partition_groups); pass one placement per subgroup."
    )
  return Plan(subgroups, placements, sizes, max_stream_slots, source="user")


def _timeline_plan(
  whole: Plan, layout: StepLayout, stage_times: StageTimes, boundaries: int,
  stage_policies: tuple[str, ...] | None, micro_batches: int, micro_batch_order: str, run_ahead_stages: int,
  max_stream_slots: int, host_budget_bytes: int, moments: str = "float32", collectives: Collectives | None = None,
  most: int | None = None, fired_share: float = 0.0,
) -> Plan:  # fmt: skip
  """Placements and rematerialisation chosen together: the predicted fastest step that fits.

  Each candidate policy assignment (``timeline.remat_candidates``; the
  stages' own policies where no choice was measured) holds
  ``extra_activation_bytes`` more than all ``"full"`` (the saved residuals of every
  micro-batch the order keeps, and any growth of the largest backward
  program's temporaries), taken out of the room beside the step's peak
  before the resident share and the streaming slots are sized
  (:func:`room_beside_step`); the timeline then places the subgroups under
  that assignment's stage times. An assignment other than all ``"full"``
  is tried only where the room is known and still holds a streaming slot
  of the largest subgroup beside its activations: where memory is short, or
  unknown, the plan keeps full rematerialisation. Ties keep the fewer
  activations, and an assignment other than all ``"full"`` is taken only
  where it is predicted faster than all ``"full"`` by more than the model's
  error (``timeline.PREDICTION_ERROR``): a smaller gain is within what the
  model cannot tell apart, and the saved activations cost room and time the
  model does not see. ``most``: resident elements at most (:func:`room_beside_step`).

  The step compared is the one expected with the clip firing in a share
  ``p = fired_share`` of the steps, ``(1 - p) silent + p fired``
  (``jax_dos.planning.fired.simulate_fired``): a fired step can hide its offloaded
  update only under the next forward pass, so where the clip fires the
  resident share the room holds (all ``"full"``: the most room) is worth
  more than activations that shorten a silent step.
  """
  subgroups, sizes, forward_order = layout.subgroups, layout.sizes, layout.forward_order
  subs = layout.timeline()
  n, k = len(stage_times.forward), micro_batches
  full = ("full",) * n
  if stage_times.remat_choices:
    candidates = remat_candidates(stage_times)
  else:
    candidates = [stage_policies if stage_times.remat and stage_policies else None]
  per_device = layout.device_share
  state, staging = device_bytes(moments)
  least = staging * max(sizes, default=0) * per_device  # one streaming slot of the largest subgroup
  cal = whole.calibration
  best = with_full = None
  for policies in candidates:
    times, extra = stage_times, 0
    if policies is not None:
      times = stage_times.assigned(policies)
      extra = stage_times.extra_activation_bytes(policies, k, micro_batch_order)
      room = None if whole.step_room_bytes is None else whole.step_room_bytes - boundaries - extra
      if policies != full and stage_times.remat_choices and (room is None or room < least):
        continue
    resident, slots = room_beside_step(whole, per_device, sizes, forward_order, max_stream_slots, boundaries + extra,
                                       moments, most)  # fmt: skip
    backward = stream_rate_during_backward(times, sum(sizes) / len(sizes), run_ahead_stages)
    rates = Rates.of(cal, backward)
    window = times.per_window(k, micro_batch_order)

    def expected(trial, silent, window=window, rates=rates):  # (1 - p) silent + p fired, exposed
      if not fired_share:
        return silent["exposed_s"]
      fired = simulate_fired(window, subs, trial, rates, collectives)["exposed_s"]
      return (1 - fired_share) * silent["exposed_s"] + fired_share * fired

    placements, predicted = choose_placements(window, subs, resident, rates, host_budget_bytes=host_budget_bytes,
                                              host_bytes=host_bytes_per(moments, layout.held_share),
                                              collectives=collectives, score=expected)  # fmt: skip
    step = times.compute_s(k) + expected(placements, predicted)
    if policies == full:
      with_full = (step, policies, times, window, placements, predicted, rates, slots)
    if best is None or step < best[0] * (1 - 1e-9):
      best = (step, policies, times, window, placements, predicted, rates, slots)
  if with_full is not None and best[0] > with_full[0] * (1 - PREDICTION_ERROR):  # no gain the model can tell
    best = with_full
  step, policies, times, window, placements, predicted, rates, slots = best
  fired = simulate_fired(window, subs, placements, rates, collectives)
  bound = fired_bound(window, subs, placements, rates, collectives)
  compute = times.compute_s(k)
  exposed = min(predicted["exposed_s"], fired["exposed_s"])  # waiting for the decision may be shorter (clip.py)
  predicted = {
    "exposed": exposed,
    "step": compute + exposed,
    "step_speculating": compute + predicted["exposed_s"],
    "step_clip_fired": compute + fired["exposed_s"],
    "step_clip_fired_bound": compute + bound["exposed_s"],
    "compute_plain": (stage_times.assigned(full) if stage_times.remat_choices else stage_times).compute_s(k),
  }
  return Plan(subgroups, tuple(placements), sizes, slots, predicted, "model+timeline", whole.calibration,
              step_room_bytes=whole.step_room_bytes, remat=policies if stage_times.remat_choices else None,
              step_room_terms=whole.step_room_terms)  # fmt: skip


def _group_ranges(groups: list) -> list[range]:
  out, start = [], 0
  for tree in groups:
    n = len(jax.tree.leaves(tree))
    out.append(range(start, start + n))
    start += n
  return out
