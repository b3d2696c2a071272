"""The overlapped training step: the Adam update runs under the backward pass and the next forward pass.

:class:`OverlappedStep` trains a staged model (``jax_dos.staged.stages``) with an
``interleaved_adam`` optimizer and ``optax.chain(clip_by_global_norm(c),
adamw)``'s exact numbers. One call is one step::

    step = jax_dos.OverlappedStep(tx, stages, groups, clip_norm=1.0, micro_batches=2)  # its state: made once
    for batch in data:
        loss = step(batch)
    groups, opt_state = step.params, step.opt_state   # settled: for evaluation and checkpoints

A step, the backward pass running stage ``n-1`` down to 0 (``docs/overlap.md``, "Micro-batches stage-major" and
"Exact numbers although the norm comes last"): the groups a stage's backward pass completes are **handed over**,
``host`` subgroups' gradients to pinned host memory and the host worker (``overlap.host_path``), ``stream`` ones to
the stream worker (``overlap.stream_path``), each with its parameters and a future of the new ones; the workers
**speculate** that the clip stays silent (``overlap.clip``: scale ``1/k``, the old state kept); after the last stage
the accelerator computes ``clip_scale(|g| / k, c) / k``, the **decision**: the resident update runs with it here,
and where it is not the speculated scale bit for bit every speculated subgroup is stepped again from its untouched
state; the **next forward pass** runs each stage once its groups' futures have resolved.

Threads and owners: ``docs/overlap.md``, "Threads and owners". The training thread alone writes the parameters,
the resident state and the step count; each worker owns its path's buffers; every buffer crossing threads goes in a
``hand_off.HandOff``, every result through a future. The plan (``overlap.plan``) is never edited here. The numbers
are optax's in every placement, the same bits in two runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dos import trace
from jax_dos.core import partition
from jax_dos.core.state import InterleavedAdamState
from jax_dos.core.trees import decay_flags, leaves_with_paths
from jax_dos.hand_off import HandOff, Slots, receive
from jax_dos.job_thread import Failure, result_of
from jax_dos.memory import kinds as memory
from jax_dos.memory import pinned_pool
from jax_dos.optimizer import device_steps
from jax_dos.optimizer.paths import host
from jax_dos.overlap import memory as overlap_memory
from jax_dos.overlap import plan as overlap_plan
from jax_dos.overlap import process as overlap_process
from jax_dos.overlap import routes as overlap_routes
from jax_dos.overlap import state as overlap_state
from jax_dos.overlap.clip import StepRecord, resolved_speculation, speculates, start_copy_to_host, step_scale
from jax_dos.overlap.dispatch import Dispatch
from jax_dos.overlap.plan import (
  REBALANCE_AFTER_STEPS,
  REBALANCE_STEPS,
  STREAM_SLOTS,
  StepOptions,
  overlappable,
  step_layout,
)
from jax_dos.overlap.workers import Workers
from jax_dos.planning import host_plan
from jax_dos.planning.plan import partition_groups
from jax_dos.planning.timeline import StageTimes
from jax_dos.staged.gather_ahead import HeldWeights
from jax_dos.staged.micro_batches import micro_batch, schedule
from jax_dos.staged.stages import Stage, StagedModel

WEIGHT_PLACEMENTS = ("device", "host")
# Programs ahead of its first use that a host group's weights are copied to the accelerator: the copy runs under
# the programs before it, and the accelerator holds the weights of the stages in flight.
WEIGHTS_AHEAD = 2


class OverlappedStep:
  """Training steps of a staged model whose AdamW update overlaps the backward and the next forward pass.

  Args:
    tx: a ``jax_dos.interleaved_adam`` (or ``interleaved_adamw``) transformation, without ``delay`` or ``write_behind``.
      Its hyperparameters, mask and ``subgroup_size`` are used; its ``plan`` gives the placements (a placement name, one
      per subgroup of ``jax_dos.planning.plan.partition_groups``, a ``Plan`` whose subgroups stay within groups, or
      ``"auto"``).
    stages: the model's :class:`jax_dos.Stage` s in forward order.
    params: the parameter groups, a list of trees (``stages`` refer to them by index). Consumed: the step owns and
      updates them.
    opt_state: ``tx.init(params)`` or a restored state for ``params`` (consumed), or ``None``: a fresh state (float32
      copies of ``params``, zero moments), allocated once, straight in the step's own placements. A state in other
      placements is moved into them; a leaf in ``unpinned_host`` memory (``jax_dos.abstract_state``'s
      ``host_kind="unpinned_host"``) is moved and deleted, one at a time.
    clip_norm: ``optax.clip_by_global_norm``'s ``max_norm`` before AdamW, or ``None`` for no clip.
    micro_batches: equal consecutive parts of a step's batch (its leading axis), their gradients summed in place: the
      update takes their mean.
    micro_batch_order: ``"stage"`` (every micro-batch through a stage before the next: the update's window is the whole
      backward pass, every micro-batch's stage inputs kept) or ``"batch"`` (micro-batch after micro-batch: the window is
      the last one's backward pass) (``jax_dos.staged.micro_batches.schedule``).
    plan: overrides ``tx``'s plan (same forms): ``jax_dos.overlapped_plan``'s, made from shapes before any state exists
      (to compare with the plain step's, and to restore a checkpoint into: ``jax_dos.abstract_state``).
    stage_times: the stages' measured times (``StagedModel.measure_times``). With them, ``"auto"`` places subgroups by
      the step's timeline (``jax_dos.planning.timeline``; the predicted step in ``plan.predicted``), and chooses each
      stage's rematerialisation where they were measured with ``policies`` (``plan.remat``); without, by stage order.
    run_ahead_stages: stage programs the training thread may have dispatched beyond the one the accelerator runs
      (``RUN_AHEAD_STAGES``, one with one micro-batch): fewer, the workers wait less; more, the accelerator does.
    stream_slots: streamed subgroups in flight at most (``STREAM_SLOTS``; ``"auto"``: fewer where the room needs).
    rebalance: move one subgroup a step across the host/stream boundary, away from the path that finished later
      (``overlap.routes.rebalanced``), after ``REBALANCE_AFTER_STEPS`` steps, each such step settled first.
    host_budget_bytes: pinned host bytes this process's step may use at most (:meth:`host_bytes`); ``None``:
      ``overlap.memory.HOST_SHARE`` of RAM, within XLA's pinned pool and the process's share of its host's
      (``host_plan.pool_share``). Where the step does not fit, a ``MemoryError`` with the numbers before anything
      moves, on every process of the job: ``params`` and ``opt_state`` stay usable on the plain path.
    speculation: ``"silent"``: the workers speculate that the clip stays silent only after a silent step; after a
      fired one they wait for the decision and step every subgroup once, in the order the next forward pass needs
      them. ``"always"``, ``"never"``: every step, none. ``"auto"`` (the default): ``"never"`` where the plan predicts
      that shorter, else ``"silent"`` (``overlap.clip.resolved_speculation``). The numbers are the same in all.
    pinned_memory: ``"arena"``: the offloaded state, spares and copies in pinned memory the step maps itself (CUDA and
      the CPU; docs/overlap.md, "Pinned memory of our own"); ``"pool"``: XLA's pool; ``"auto"``: as
      ``overlap.state.PinnedMemory`` says. The numbers are the same.
    gather_ahead: ``True``: where a stage's parameters are sharded (``fsdp``), each backward program gathers the next
      one's weights whole beside its compute, for all of that stage's programs (``jax_dos.staged.gather_ahead``; the
      room counts one more stage's gathered weights). ``False``: each program gathers its own. ``"auto"`` (the default):
      as ``stage_times`` were measured faster (``StageTimes.gather_ahead``), else ``False``. The numbers are the same.

    weights: where each group's weights live between the programs that use them: ``"device"`` (all of them, the
      default), ``"host"``, or one of those a group. A group whose weights are ``"host"`` keeps them in pinned host
      memory; each of its stages' programs gets a copy on the accelerator made :data:`WEIGHTS_AHEAD` programs ahead
      (an asynchronous copy, under the programs before it) and dropped once no program within that distance uses it,
      so the accelerator holds only the weights of the stages in flight; the host kernel writes its new weights
      straight into their host buffers, which the training thread gives up at the hand-over (one holder a buffer),
      and nothing copies them back from the accelerator. Such a group's subgroups must be ``"host"`` in the plan,
      and its state laid out as its parameters (no ``fsdp`` gathering ahead, no state partitioned over ``data``);
      their numbers are the same.

  A call ``step(batch) -> loss`` takes one step: the mean loss of the batch (an accelerator scalar), with the parameters
  it was computed at being the previous step's. It returns once the backward pass is dispatched; reading the loss waits
  behind the state's copies to the host, so read a few steps' losses at a time. :attr:`params` and :attr:`opt_state`
  wait for the pending update and return the current trees; the state equals
  ``optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(...))``'s on the same gradients, to float32 rounding,
  in every placement, and the same bits in two runs of the same steps.

  Run other accelerator programs (an evaluation) after :meth:`settle`: a program's first run loads it, and on a GPU a
  cuDNN graph loaded while another thread launches work fails its stream capture. The step commits the parameters and
  holds its first step's worker jobs until that step's programs have run, so that its own programs are loaded with no
  other thread launching.
  """

  def __init__(
    self,
    tx: Any,
    stages: Sequence[Stage],
    params: Sequence[Any],
    opt_state: InterleavedAdamState | None = None,
    *,
    clip_norm: float | None = None,
    micro_batches: int = 1,
    micro_batch_order: str = "stage",
    plan: Any = None,
    stage_times: StageTimes | None = None,
    run_ahead_stages: int | None = None,
    stream_slots: int = STREAM_SLOTS,
    host_budget_bytes: int | None = None,
    rebalance: bool = False,
    speculation: str = "auto",
    pinned_memory: str = "auto",
    gather_ahead: bool | str = "auto",
    weights: str | Sequence[str] = "device",
  ):
    if not isinstance(params, (list, tuple)):
      raise TypeError(
        f"params must be a list of parameter groups (one tree per group, the stages name them by index), got"
        f" {type(params).__name__}."
      )
    owner = overlappable(tx, list(params))
    overlap_process.check_no_command_buffers()
    options = StepOptions(micro_batches, micro_batch_order, run_ahead_stages, stream_slots, host_budget_bytes,
                          gather_ahead)  # fmt: skip
    if pinned_memory not in overlap_state.PINNED_MEMORY:
      raise ValueError(f"pinned_memory must be one of {overlap_state.PINNED_MEMORY}, got {pinned_memory!r}.")
    self.micro_batch_order, self.run_ahead_stages = options.micro_batch_order, options.run_ahead_stages
    self.host_budget_bytes = options.host_budget_bytes
    spans = host_plan.spans_processes(jax.tree.leaves(list(params)))  # a job's tree: its checks are collectives
    # The host's RAM and the job's processes on it, whose share of the pinned pool the step plans into.
    here = owner.host_memory is None
    self.host_memory = host_plan.HostMemory.here(count_processes=spans) if here else owner.host_memory
    self._host_room = min(self.host_budget_bytes, host_plan.pool_share(self.host_memory))
    if rebalance and jax.process_count() > 1:
      raise ValueError(
        "rebalance=True moves subgroups by this process's own timing, and the processes of a job must run one plan;"
        " pass rebalance=False in a job of several processes."
      )
    self._rebalance_left = REBALANCE_STEPS if rebalance else 0
    self._last_move: str | None = None
    self._last_record: StepRecord | None = None
    self._steps_taken = 0
    if clip_norm is not None and not clip_norm > 0:
      raise ValueError(f"clip_norm must be > 0 or None (no clip), got {clip_norm!r}.")
    self.gather_ahead = options.gathers_ahead(stage_times)  # resolved: whether the step gathers ahead
    model = lambda stages: StagedModel(stages, len(params), partition_gradients=owner.partitions,  # noqa: E731
                                       gather_ahead=self.gather_ahead)  # fmt: skip
    self.model = model(stages)
    self.hyper, self.clip_norm, self.micro_batches = owner.hyper, clip_norm, options.micro_batches
    self._scalars = device_steps.scalars_for(self.hyper)  # (count, grad_scale) -> the step scalars
    leaves, self._treedef = leaves_with_paths(list(params), "params")
    overlap_state.check_given(opt_state, self._treedef)
    self.decay = decay_flags(owner.mask, list(params), self.hyper.weight_decay)
    self.stage_times = stage_times
    self._layout = step_layout(self.model, list(params), owner.subgroup_size, owner.partitions)
    self.subgroup_group = partition_groups(params, owner.subgroup_size)[2]
    self._forward_order = self._layout.forward_order  # subgroups in the order the forward pass needs them
    self.plan = overlap_plan.plan_step(
      tx, stages, list(params), plan=plan, stage_times=stage_times, **dataclasses.asdict(options)
    )
    self.speculation = resolved_speculation(speculation, self.plan.predicted)
    if self.plan.remat is not None:  # the plan's rematerialisation policies, chosen beside its placements
      if len(self.plan.remat) != len(self.model.stages):
        raise ValueError(f"the plan's remat names {len(self.plan.remat)} policies for {len(self.model.stages)} stages.")
      self.model = model([dataclasses.replace(st, remat=p) for st, p in zip(self.model.stages, self.plan.remat)])
    self.routes = overlap_routes.routes(self.plan, self._layout, self._host_room, self.hyper.moments)
    self.group_subgroups = [[s for s, g in enumerate(self.subgroup_group) if g == gi] for gi in range(len(params))]
    # (training thread) The parameters: the programs of the first step are then those of every later one.
    # A parameter handed to a worker leaves a hand_off.Given in its place until the new one comes back.
    self._params = Slots(memory.committed(list(leaves)), "parameter leaf")
    # (training thread) The state partitioned over the axes a parameter is replicated over, as tx.init's (the
    # default, partition_replicated="auto": each device holds and updates 1/N of it), else in its parameter's layout.
    self._relayout = partition.ParamStateLayouts(list(self._params), owner.partition_replicated is not False)
    # The host memory the step needs, checked (on every process of the job) before any state moves or is made.
    overlap_memory.check_agreed(self.plan, self._layout, self.stream_speculation, self.host_budget_bytes,
                                self.hyper.moments, self.host_memory, spans,
                                overlap_state.unpinned_bytes(opt_state))  # fmt: skip
    # The offloaded state outside XLA's pinned pool (docs/overlap.md, "Pinned memory of our own"), or in it.
    self._pinned = overlap_state.PinnedMemory.for_step(pinned_memory, list(self._params), opt_state)
    self.arena = self._pinned.arena
    masters, mus, nus, self._count = overlap_state.initial_state(
      self.plan, self._relayout, self.hyper.moments, leaves, opt_state, self.arena, self._pinned.state_out
    )
    placement = self.plan.leaf_placements()
    by = lambda where: {i: (masters[i], mus[i], nus[i]) for i, p in enumerate(placement) if p == where}  # noqa: E731
    self._resident: dict[int, tuple] = by("device")  # (training thread) the resident state: leaf -> (master, mu, nu)
    self._group_start = np.cumsum([0] + [len(jax.tree.leaves(t)) for t in params]).tolist()
    self._host_groups: frozenset[int] = frozenset()  # the groups whose weights live in pinned host memory
    self._gathers = [self.model.gathers(self._stage_params(i)) for i in range(len(self.model.stages))]  # per stage
    self._host_groups = self._weights_on_host(weights, len(params), rebalance)
    self._on_device: dict[int, list[jax.Array]] = {}  # (training thread) host groups' weights copied in, by group
    host_subgroups = frozenset(s for g in self._host_groups for s in self.group_subgroups[g])
    self.routes = dataclasses.replace(self.routes, redo_on_stream=self.routes.redo_on_stream - host_subgroups)
    host_leaves = [i for g in sorted(self._host_groups) for i in range(self._group_start[g], self._group_start[g + 1])]
    if host_leaves:  # the weights move to pinned host memory once; the accelerator's copies are freed
      moved = memory.put([self._params[i] for i in host_leaves], "pinned_host")
      jax.block_until_ready(moved)
      for i, x in zip(host_leaves, moved):
        self._params[i].delete()
        self._params[i] = x
    self._pending: dict[int, Future] = {}  # (training thread) subgroup -> the future of its new parameters
    self._closed = False
    self._updating = False  # between a step's first hand-over and its decision
    self.grad_norm: jax.Array | None = None  # the last step's global norm of the mean gradient (before the clip)
    # The first error of any of the step's threads (the training thread's: a step cut short between hand-over and
    # decision); it holds no reference to the step, so a dropped step ends.
    self._failure = Failure()
    self._dispatch = Dispatch(self.run_ahead_stages)  # run-ahead pacing; the first step's jobs held (dispatch.py)
    lows = [jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32 for x in self._params]
    self._workers = Workers(self.routes, self.hyper, self.decay, by("host"), by("stream"), lows, self._failure,
                            self.arena, self._pinned.state_out, frozenset(host_leaves))  # fmt: skip
    overlap_process.register(self)

  # ----------------------------------------------------------------------------- the plan and the state

  @property
  def stream_speculation(self) -> int:
    """Streamed parameters a step may speculate on (``overlap.memory.speculation_cap``), the others waiting for the
    clip decision."""
    return self.routes.stream_speculation

  def host_bytes(self) -> int:
    """Pinned host bytes this process's step needs at most (``overlap.memory.host_bytes``), counted in the elements of
    the state it holds (its devices' shards: ``1/N`` of a state partitioned over ``N`` processes): the offloaded
    state, the host path's spare state and copies, and the streamed parameters speculated on
    (:attr:`stream_speculation` at most)."""
    return overlap_memory.host_bytes(self.plan, self._layout, self.stream_speculation, self.hyper.moments)

  def resident_estimate(self) -> int:
    """The resident set this process reaches with the step's pinned bytes (:meth:`host_bytes`), those in the arena
    outside XLA's pool (``jax_dos.resident_estimate``)."""
    need = self.host_bytes()
    return pinned_pool.resident_estimate(need, outside_pool=need if self.arena is not None else 0)

  # ----------------------------------------------------------------------------- one step

  def __call__(self, batch: Any) -> jax.Array:
    if self._closed:
      raise RuntimeError("this OverlappedStep was closed; make a new one from its params and opt_state.")
    self._raise_errors()
    k = self.micro_batches
    rows = {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(batch)}
    if len(rows) != 1 or None in rows or next(iter(rows)) % k:
      raise ValueError(
        f"every leaf of the batch needs one leading (batch) axis divisible by micro_batches={k}; got leading sizes"
        f" {sorted(map(str, rows))}."
      )
    if self._rebalance_left and self._last_record is not None and self._steps_taken > REBALANCE_AFTER_STEPS:
      self._rebalance(self._last_record)
    self._steps_taken += 1
    # The scalars if the clip does not fire, on their way to the host before any gradient is (one queue carries
    # every copy to the host, and the host worker needs them with its first subgroup).
    spec = self._scalars(self._count, np.float32(1.0 / k))
    record = StepRecord(spec)
    previous, self._last_record = self._last_record, record
    try:
      losses = self._run_programs([micro_batch(batch, m, k) for m in range(k)], record, previous)
    except BaseException as e:
      if self._updating:  # cut short between hand-over and decision: refuse further steps
        self._failure.report(e)
      raise
    return losses[0] if k == 1 else sum(losses) / k

  def _weights_on_host(self, weights: str | Sequence[str], groups: int, rebalance: bool) -> frozenset[int]:
    """The groups whose weights live in pinned host memory (``weights``: one placement, or one a group), checked
    against what this step can do with them (the class docstring)."""
    given = [weights] * groups if isinstance(weights, str) else list(weights)
    if len(given) != groups or any(w not in WEIGHT_PLACEMENTS for w in given):
      raise ValueError(f"weights must be one of {WEIGHT_PLACEMENTS} or one of them for each of the {groups} groups,"
                       f" got {weights!r}.")  # fmt: skip
    host = frozenset(g for g, w in enumerate(given) if w == "host")
    if not host:
      return host
    if self.gather_ahead or self._relayout.partitioned or rebalance:
      why = ("gather_ahead=False" if self.gather_ahead else "rebalance=False" if rebalance else
             "the optimizer's partition_replicated=False (each device holds its parameters' state)")  # fmt: skip
      raise ValueError(f"weights on the host need each state laid out as its parameters and a fixed plan: pass {why}.")
    for g in sorted(host):
      placed = {self.plan.placements[s] for s in self.group_subgroups[g]}
      if placed != {"host"}:
        raise ValueError(
          f"group {g}'s weights are on the host, but the plan places its subgroups {sorted(placed)}: the host kernel"
          " writes a host group's new weights, so each of its subgroups must be 'host' (plan='host', or a Plan that"
          " places them there)."
        )
    return host

  def _stage_params(self, stage: int) -> tuple:
    return tuple(self._group_tree(g) for g in self.model.stages[stage].groups)

  def _group_tree(self, g: int) -> Any:
    lo, hi = self._group_start[g], self._group_start[g + 1]
    leaves = self._on_device[g] if g in self._host_groups else self._params[lo:hi]
    return jax.tree.unflatten(self._treedef.children()[g], leaves)

  def _copy_in(self, stage: int) -> None:
    """(training thread) Copies the host weights of ``stage``'s groups to the accelerator where they are not there
    yet: one batched, asynchronous copy from the host buffers, which stay the training thread's."""
    for g in self.model.stages[stage].groups:
      if g in self._host_groups and g not in self._on_device:
        lo, hi = self._group_start[g], self._group_start[g + 1]
        self._on_device[g] = memory.put(self._params[lo:hi], "device")

  def _drop_copies(self, uses: dict[int, list[int]], j: int) -> None:
    """(training thread) Drops the accelerator's copy of each host group that no program within
    :data:`WEIGHTS_AHEAD` of program ``j`` uses (``uses``: each host group's programs, in order); the programs
    dispatched with it keep their buffers until they have run."""
    for g in list(self._on_device):
      if not any(j < k <= j + WEIGHTS_AHEAD for k in uses[g]):
        del self._on_device[g]

  def _run_programs(self, parts: list, record: StepRecord, previous: StepRecord | None) -> list[jax.Array]:
    """Dispatches the step's stage programs in ``micro_batch_order``; returns each micro-batch's loss.

    A stage's programs wait for its groups' final weights (the previous
    step's update); the last micro-batch's backward program of a stage hands
    the groups it completes over to the optimizer; the last backward program
    decides the clip. Whether the workers speculate is decided at the first
    hand-over, from ``previous`` step's decision (``overlap.clip.speculates``).
    """
    n, k = len(self.model.stages), len(parts)
    programs = schedule(n, k, self.micro_batch_order)
    window = max(j for j, (kind, _, _) in enumerate(programs) if kind == "forward") + 1  # the final backward pass
    inputs = [[None] * n for _ in range(k)]  # each micro-batch's stage inputs, kept from forward to backward
    saved = [[None] * n for _ in range(k)]  # and what each stage's policy saves beside them
    sums: list[Any] = [None] * len(self.group_subgroups)
    dys, losses, squares = [None] * k, [None] * k, []
    reached: set[int] = set()  # stages whose groups' final weights were waited for
    held = HeldWeights(programs, self._gathers)  # sharded weights gathered by the program before
    uses = {g: [j for j, (_, i, _) in enumerate(programs) if g in self.model.stages[i].groups]
            for g in self._host_groups}  # fmt: skip
    for j, (kind, i, m) in enumerate(programs):
      st, ahead = self.model.stages[i], held.ahead(j)
      coming = {programs[k][1] for k in range(j + 1, min(len(programs), j + 1 + WEIGHTS_AHEAD))} if uses else set()
      for stage in (i, ahead, *sorted(coming - {i, ahead})):
        if stage is not None and stage not in reached:
          self._wait_groups(self.model.stages[stage].groups)  # at once where they are final
          reached.add(stage)
      for stage in (i, *sorted(coming)) if uses else ():
        self._copy_in(stage)  # host weights copied in ahead of the programs that use them
      if j == window and self.routes.stream_order:
        self._dispatch.submit(self._workers.stream, self._workers.stream_path.prefetch)
      if kind == "forward":
        with trace.span("overlap.forward"):
          x, saved[m][i] = self.model.forward(i, self._stage_params(i), inputs[m][i], parts[m], m)
        inputs[m][i + 1] = x
        trace.watch(f"forward {i}", x)
        self._dispatch.pace(x)
        self._drop_copies(uses, j)
        continue
      last = m == k - 1
      with trace.span("overlap.backward"):
        out, new, dys[m], sq, *whole = self.model.backward(
          i, self._stage_params(i), inputs[m][i], parts[m], dys[m], tuple(sums[g] for g in st.groups), last,
          saved[m][i], m, gathered=held.mine(j), ahead=None if ahead is None else self._stage_params(ahead),
        )  # fmt: skip
      held.ran(j, whole[0] if whole else None)
      self._drop_copies(uses, j)  # before the hand-over gives the host buffers up
      inputs[m][i] = saved[m][i] = None
      losses[m] = out if out is not None else losses[m]
      for g, s in zip(st.groups, new):
        sums[g] = s
      trace.watch(f"backward {i}", dys[m] if dys[m] is not None else new)
      self._dispatch.pace(dys[m] if dys[m] is not None else new)
      if last:
        squares += sq
        if record.speculate is None:  # set before the step's first job is queued: the workers only read it
          if previous is not None and jax.process_count() > 1:  # every process speculates alike: waits for the
            result_of(previous.decision, self._failure, "the previous step's clip decision")  # long known by now
          record.speculate = speculates(self.speculation, previous)
        for g in self.model.groups_completing(i):
          self._hand_over(record, g, sums[g])
          sums[g] = None
    self.model.advance(k)  # the stages' random counters: the next step's forward calls draw anew
    self._decide(record, squares)
    return losses

  def _hand_over(self, record: StepRecord, g: int, grads: Any) -> None:
    """Hands group ``g``'s complete gradients to its subgroups' paths (host ones leave the accelerator now), with
    the parameters of its offloaded subgroups: the training thread gets them back, new, through a future each."""
    self._updating = True
    lo = self._group_start[g]
    grads = jax.tree.leaves(grads)
    for s in self.group_subgroups[g]:
      leaves = self.plan.subgroups[s]
      placement = self.plan.placements[s]
      subgroup_grads = self._relayout.to_state([grads[i - lo] for i in leaves], leaves)  # a slice: no collective
      if placement == "device":
        record.resident_grads.update(zip(leaves, subgroup_grads))
        continue
      future = self._pending[s] = Future()
      if placement == "host":
        with trace.span("overlap.grads_d2h"):
          subgroup_grads = host.gradients_to_host(subgroup_grads, list(leaves), self.arena, self._pinned.grads_out)
        worker, path = self._workers.host, self._workers.host_path
      else:
        worker, path = self._workers.stream, self._workers.stream_path
      # The worker holds them until it hands the new ones back through the future.
      params = self._relayout.to_state(self._params.give(leaves, f"the {placement} worker"), leaves)
      given = HandOff((subgroup_grads, params), f"subgroup {s}'s gradients and parameters")
      self._dispatch.submit(worker, path.update, record, s, given, future)

  def _decide(self, record: StepRecord, squares: list[jax.Array]) -> None:
    """The true gradient scale: runs the resident update with it; the decider tells the workers whether they
    guessed it. The training thread does not wait for the decision: the next forward pass starts on the stages
    whose weights are final (resident ones at once) and waits for the others' workers."""
    scale, self.grad_norm = step_scale(squares, self.clip_norm, self.micro_batches)
    true = self._scalars(self._count, scale)
    start_copy_to_host(true)
    self._resident_update(record, true)
    self._dispatch.submit(self._workers.host, self._workers.host_path.finish, record)
    if self.routes.stream_order or self.routes.redo_on_stream:  # else the stream path has nothing of this step
      self._dispatch.submit(self._workers.stream, self._workers.stream_path.finish, record)
    if self._dispatch.holding:  # the first step: every program of the step has run once when this returns
      self._dispatch.release((true, self._params.held()))
    self._workers.decider.submit(record.announce, true)
    self._count = device_steps.increment(self._count)
    self._updating = False

  def _resident_update(self, record: StepRecord, scalars: jax.Array) -> None:
    for leaves in self.routes.resident_calls:
      with trace.span("overlap.resident"):
        masters, mus, nus = ([self._resident[i][j] for i in leaves] for j in range(3))
        params = self._relayout.to_state([self._params[i] for i in leaves], leaves)
        grads = [record.resident_grads.pop(i) for i in leaves]
        outs = device_steps.update_on_device(grads, masters, mus, nus, params, scalars, self.hyper,
                                             tuple(self.decay[i] for i in leaves))  # fmt: skip
      new = self._relayout.to_params(outs[0], leaves)  # the all-gather of a partitioned state's new weights
      for j, i in enumerate(leaves):
        self._params[i] = new[j]
        self._resident[i] = (outs[1][j], outs[2][j], outs[3][j])

  # ----------------------------------------------------------------------------- rebalancing: a new plan

  def _rebalance(self, last: StepRecord) -> None:
    """Moves one subgroup across the stream/host boundary toward the path that finished the last step first."""
    self._rebalance_left -= 1
    self.settle()  # the last step's ends are final, and no worker touches the buffers moved below
    ends = {"host": getattr(last.host, "end", None), "stream": getattr(last.stream, "end", None)}
    self._move_boundary({k: v for k, v in ends.items() if v is not None})

  def _move_boundary(self, ends: dict[str, float]) -> None:
    """One subgroup across the boundary, toward the path whose end (``ends``: seconds) came first: the plan
    ``overlap.routes.rebalanced`` makes, handed to both paths with the moved state (the step is settled)."""
    plan, to, stop = overlap_routes.rebalanced(
      self.plan, self._layout, ends, self._last_move, self._host_room, self.hyper.moments
    )
    if stop:
      self._rebalance_left = 0
    if plan is None:
      return
    moved = [i for s, (a, b) in enumerate(zip(self.plan.placements, plan.placements)) if a != b
             for i in plan.subgroups[s]]  # fmt: skip
    self.plan, self.routes = plan, overlap_routes.routes(plan, self._layout, self._host_room, self.hyper.moments)
    self._workers.move(to, moved, self.routes)
    self._last_move = to

  # ----------------------------------------------------------------------------- waiting

  def _wait_groups(self, groups: Sequence[int]) -> None:
    """Waits for the new parameters of these groups' offloaded subgroups and writes them (the training thread is
    the parameters' one writer)."""
    with trace.span("overlap.wait_params"):
      for g in groups:
        for s in self.group_subgroups[g]:
          future = self._pending.pop(s, None)
          if future is not None:
            leaves = self.plan.subgroups[s]  # gathered here: collectives from this thread, in stage order
            new = self._relayout.to_params(receive(future, self._failure, "new parameters"), leaves)
            for i, x in zip(leaves, new):
              self._params[i] = x
    self._raise_errors()

  def _raise_errors(self) -> None:
    error = self._failure.error()
    if error is not None:
      raise RuntimeError(
        "the overlapped step's optimizer worker failed; the parameters and state are no longer usable."
      ) from error

  def settle(self) -> None:
    """Waits until every pending update has written the parameters and the whole state."""
    self._workers.decider.join()
    self._wait_groups(range(len(self.group_subgroups)))
    self._workers.host.join()
    self._workers.stream.join()
    self._raise_errors()

  def close(self) -> None:
    """Settles the pending update and ends the worker threads; the step cannot be called again."""
    try:
      self.settle()
    finally:
      self._workers.stop()
      self._pinned.close()
      self._closed = True
      overlap_process.unregister(self)

  def __enter__(self) -> OverlappedStep:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    workers = getattr(self, "_workers", None)
    if workers is not None:
      workers.stop(wait=False)

  @property
  def params(self) -> list[Any]:
    """The current parameter groups (waits for the pending update). The next step consumes them."""
    self._wait_groups(range(len(self.group_subgroups)))
    return jax.tree.unflatten(self._treedef, list(self._params))

  @property
  def opt_state(self) -> InterleavedAdamState:
    """The current optimizer state (waits for every pending write; each path hands its part over through a
    future). The next step consumes it."""
    self.settle()
    state = {**self._resident, **self._workers.state()}
    unflat = lambda j: jax.tree.unflatten(self._treedef, [state[i][j] for i in range(len(state))])  # noqa: E731
    return InterleavedAdamState(self._count, unflat(0), unflat(1), unflat(2))
