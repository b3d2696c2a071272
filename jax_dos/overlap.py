"""The overlapped training step: the Adam update runs under the backward pass and the next forward pass.

:class:`OverlappedStep` trains a staged model (``jax_dos.stages``) with an
``interleaved_adam`` optimizer and ``optax.chain(clip_by_global_norm(c),
adamw)``'s exact numbers. One call is one step::

    step = jax_dos.OverlappedStep(tx, stages, groups, tx.init(groups), clip_norm=1.0, micro_batches=2)
    for batch in data:
        loss = step(batch)
    groups, opt_state = step.params, step.opt_state   # settled: for evaluation and checkpoints

The step's ``k`` micro-batches run stage-major by default
(``micro_batch_order="stage"``, ``jax_dos.stages.schedule``): every
micro-batch through a stage before the next stage, forward, then back. Each
group's gradient is therefore complete as soon as the one backward pass has
passed its stage, and the update's window is the whole backward pass and the
next forward pass, not the last micro-batch's alone. How a step runs (the
backward pass, stage ``n-1`` down to 0):

1. **Hand-over.** Once a stage's backward pass is dispatched, the groups it
   completes are handed to the optimizer: gradients of ``host`` subgroups
   leave for pinned host memory at once (the copy overlaps the next stage's
   backward pass) and queue for the host worker; ``stream`` subgroups queue
   for the stream worker; ``device`` (resident) subgroups wait for the norm.
2. **Speculation.** The global norm is known only after the last stage. The
   workers assume the clip does not fire: the step's gradient scale is then
   exactly ``1/k`` (``k`` micro-batches). The host worker runs the fused
   kernel from the state into a spare set of host buffers (master, mu, nu:
   the same 28 bytes of DRAM traffic a parameter as in place) and sends the
   new weights to the parameters; the stream worker copies the state in,
   updates it on the accelerator into new host buffers and keeps the old ones,
   for as many parameters as the host budget holds (``stream_speculation``);
   past that it waits for the decision.
3. **Decision.** After the last stage the accelerator computes
   ``scale = clip_scale(|g| / k, c) / k`` and the resident update runs with it.
   A decider thread reads the scale once it exists; the training thread goes
   on to the next step meanwhile. If ``scale`` equals the speculated ``1/k``
   bit for bit, every speculated weight is optax's; otherwise (the clip
   fired, or a non-finite gradient) each speculated subgroup is computed
   again from its untouched state with the true scale. Subgroups not yet
   reached use the true scale directly.
4. **Commit.** The new host buffers become the state (the old ones are the
   next step's spares), and the stream worker's new state replaces the old
   (at once for a subgroup updated with the true scale).
5. **Early forward.** The next step's forward pass dispatches each stage as
   soon as the parameters of its own groups are final, so the first stages
   run while later ones are still being updated.

The numbers are optax's in every placement: each subgroup's weights and state
come from one AdamW step with the true gradient scale; a speculated result is
used only when its scale was the true one. The ``delay`` modes are separate and
not used here.

Memory: gradients of streamed and resident subgroups stay on the accelerator
until the step ends (a redo needs them), as in the plain step; host subgroups'
leave it during the backward pass. The ``"stage"`` order keeps every
micro-batch's stage inputs at the step's peak. Host subgroups keep a second
set of state buffers (12 B of pinned memory a parameter), and speculated
stream state takes one until the decision. A speculation that writes weights only and the state
in a second pass (``write_behind``'s way) needs no spare buffers but moves 44
bytes a parameter through host DRAM instead of 28, and host DRAM bandwidth is
what bounds the update on the machines measured (``docs/design.md``).

Keeping the accelerator busy (``docs/overlap.md`` has the measured steps):
the training thread stays at most ``RUN_AHEAD_STAGES`` stage programs ahead
of the accelerator, so the workers' programs do not queue behind the whole
backward pass; the workers dispatch a program only once the copies into the
accelerator that it reads have landed, since a program whose input is still
in flight holds the compute queue and every stage program behind it, and
they keep several copies in flight meanwhile (a copy starts only once the
compute queue has reached the point where it was issued): the host worker
goes on to the next kernel, the stream worker copies state in ahead of its
gradients, topping up each slot as soon as it is free; no read of a small result waits on the training thread (the
decider reads the clip decision); and the host kernel leaves
``TRAINING_CORES`` cores to the threads that launch the stage programs.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dos import device_steps, host_kernels, memory, moment_formats, overlap_plan, partition, trace
from jax_dos.adam_math import clip_scale
from jax_dos.engine import host_gradients
from jax_dos.interleaved import decay_flags, leaves_with_paths
from jax_dos.job_thread import JobThread
from jax_dos.overlap_plan import RUN_AHEAD_STAGES, STREAM_SLOTS, StepOptions, overlappable, step_layout
from jax_dos.plan import MEMORY_KIND, RESIDENT_CALL_ELEMENTS, partition_groups
from jax_dos.stages import Stage, StagedModel, micro_batch, schedule
from jax_dos.state import InterleavedAdamState
from jax_dos.timeline import StageTimes

_WAIT_POLL_S = 0.05  # how often a wait on the workers checks them for errors
SPECULATION_MODES = ("silent", "always", "never")
# Several threads launch accelerator work at once here, and XLA's GPU command buffers (CUDA graphs) fail a capture that
# another thread launches into (docs/measurements.md). This flag, set before jax starts, turns them off.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
# How often the stream worker, while it waits (for a copy in to land, or for gradients), tops up its copies in: a slot
# whose copy back has landed takes the next subgroup's state at once (docs/measurements.md).
IDLE_POLL_S = 0.002
# Rebalancing (OverlappedStep(rebalance=True)): a step moves one subgroup across the stream/host boundary when one
# path finished its step this much later than the other; it stops at the first move back, or after this many steps.
REBALANCE_GAP_S = 0.05
REBALANCE_STEPS = 12
# The first steps' ends are not used: they compile the update programs and the host kernel.
REBALANCE_AFTER_STEPS = 2
# Cores the host kernel leaves to the training thread and XLA's runtime on a machine of at least 8: a stage program's
# launches are the training thread's work, and the accelerator idles while they wait for a core.
TRAINING_CORES = 2
# How long the exit handler waits for an open step to settle before it leaves it (a worker stuck after a fault).
EXIT_SETTLE_S = 120.0


def _check_no_command_buffers() -> None:
  flags = os.environ.get("XLA_FLAGS", "").split()
  if jax.default_backend() == "gpu" and NO_COMMAND_BUFFERS not in flags:
    raise RuntimeError(
      f"OverlappedStep on a GPU needs XLA's command buffers off: set XLA_FLAGS='{NO_COMMAND_BUFFERS}' (with any"
      " other flags) before jax starts. Its optimizer threads launch work while the training thread does, which"
      " fails a CUDA-graph capture. Or train on the plain path (jax_dos.update_params after jax.grad)."
    )


def _step_scale(squares: list[jax.Array], clip_norm: float | None, micro_batches: int) -> tuple[jax.Array, jax.Array]:
  """``(clip_scale(|g|, c) / k, |g|)`` from the groups' sums of squares, ``g = sum / k`` the mean gradient.

  With no clip the scale is ``1/k``.
  """
  mean = jnp.float32(1.0 / micro_batches)
  norm = jnp.sqrt(sum(squares, jnp.float32(0))) * mean
  return (mean if clip_norm is None else clip_scale(norm, clip_norm) * mean), norm


_jit_step_scale = jax.jit(_step_scale, static_argnums=(1, 2))


@dataclasses.dataclass
class _Decision:
  host: np.ndarray  # the step scalars with the true gradient scale
  device: jax.Array
  fired: bool  # the true scale differs from the speculated one


@dataclasses.dataclass
class _Streamed:
  """A streamed subgroup updated on a speculated scale, its old state kept until the decision."""

  old: list[list[jax.Array]]  # the state before the step (host buffers), kept until the decision
  new: list[list[jax.Array]]  # the state after it (host buffers)
  grads: list[jax.Array]  # kept for a redo


def _start_copy_to_host(x: jax.Array) -> None:
  """Queues ``x``'s copy to the host now, so that a later read does not queue behind copies issued meanwhile."""
  copy = getattr(x, "copy_to_host_async", None)
  if copy is not None:
    copy()


class _StepRecord:
  """What one step's workers share: the speculated scalars, the decision, and the speculated subgroups."""

  def __init__(self, spec_device: jax.Array):
    self.spec_device = spec_device
    _start_copy_to_host(spec_device)
    self._spec_host: np.ndarray | None = None
    self.decision: _Decision | None = None
    self.host_grads: dict[int, dict[int, jax.Array]] = {}  # subgroup -> leaf -> gradient in host memory
    self.speculate: bool | None = None  # set by the training thread before the step's first job is queued
    self.host_speculated: list[int] = []
    self.host_deferred: list[int] = []  # host subgroups waiting for the decision (no speculation this step)
    self.host_sent: list[jax.Array] = []
    self.streamed: dict[int, _Streamed] = {}  # streamed subgroups speculated on, until the decision
    self.speculated_elements = 0  # parameters of the streamed subgroups speculated on
    self.resident_grads: dict[int, jax.Array] = {}  # leaf -> gradient
    self.host_done = threading.Event()  # the host worker has run every hand-over of the step (fired clip: its redo)
    self.stream_redone = threading.Event()  # the stream worker has committed the host subgroups it redoes
    self.path_end: dict[str, float] = {}  # "host", "stream" -> when the worker last finished a subgroup of this step

  def spec_host(self) -> np.ndarray:
    if self._spec_host is None:
      self._spec_host = np.asarray(self.spec_device)
    return self._spec_host


_OPEN_STEPS: weakref.WeakSet = weakref.WeakSet()  # steps not yet closed, settled when Python exits


def _close_open_steps() -> None:
  """Settles and closes every open step before the interpreter finalizes.

  Its workers are daemon threads: left mid-update (a step returns before its
  update is done), they were stopped inside XLA's C++ code as Python shut
  down, and the process aborted. Each new step registers this exit handler
  again, so that it runs before the handlers JAX registered when its
  backends started (exit handlers run last registered first). A worker's
  error is not raised here: the program is ending. A step that has not
  settled within ``EXIT_SETTLE_S`` (a worker stuck after an accelerator
  fault) is left, said on stderr, so that the program ends instead of
  hanging.
  """
  for step in list(_OPEN_STEPS):
    closer = threading.Thread(target=_close_quietly, args=(step,), daemon=True)
    closer.start()
    closer.join(EXIT_SETTLE_S)
    if closer.is_alive():
      print(
        f"jax_dos: an OverlappedStep did not settle within {EXIT_SETTLE_S:g} s at exit (a worker is stuck, most"
        " likely after an accelerator fault); its last update is incomplete. Resume from the last checkpoint.",
        file=sys.stderr,
        flush=True,
      )
      return


def _close_quietly(step: OverlappedStep) -> None:
  try:
    step.close()
  except Exception:  # noqa: BLE001
    pass


class OverlappedStep:
  """Training steps of a staged model whose AdamW update overlaps the backward and the next forward pass.

  Args:
    tx: a ``jax_dos.interleaved_adam`` (or ``interleaved_adamw``) transformation,
      without ``delay`` or ``write_behind``. Its hyperparameters, mask and
      ``subgroup_size`` are used; its ``plan`` gives the placements (a
      placement name, one per subgroup of ``jax_dos.plan.partition_groups``, a
      ``Plan`` whose subgroups stay within groups, or ``"auto"``).
    stages: the model's :class:`jax_dos.Stage` s in forward order.
    params: the parameter groups, a list of trees (``stages`` refer to them by
      index). Consumed: the step owns and updates them.
    opt_state: ``tx.init(params)`` or a restored state for ``params``
      (consumed), or ``None``: a fresh state (float32 copies of ``params``,
      zero moments), allocated once, straight in the step's own placements.
      A state in other placements is moved into them.
    clip_norm: ``optax.clip_by_global_norm``'s ``max_norm`` before AdamW, or
      ``None`` for no clip.
    micro_batches: a step's batch is split into this many equal consecutive
      parts along its leading axis; their gradients are summed in place and
      the update takes their mean (the whole batch's mean gradient).
    micro_batch_order: ``"stage"`` (every micro-batch through a stage before
      the next stage: the update's window is the whole backward pass, and
      the forward pass keeps every micro-batch's stage inputs) or
      ``"batch"`` (micro-batch after micro-batch: the window is the last
      micro-batch's backward pass, one micro-batch's inputs kept)
      (``jax_dos.stages.schedule``).
    plan: overrides ``tx``'s plan (same forms). ``jax_dos.overlapped_plan``
      makes the step's plan from shapes before any state exists (to compare
      it with the plain step's, and to restore a checkpoint straight into its
      placements with ``jax_dos.abstract_state``); pass it here.
    stage_times: the stages' measured times (``StagedModel.measure_times``).
      With them, ``"auto"`` places subgroups by the step's timeline
      (``jax_dos.timeline``), keeping as many resident as ``tx``'s planner
      would, and records the predicted step in ``plan.predicted``; without
      them it keeps ``tx``'s planner's shares, by stage order.
    run_ahead_stages: how many stage programs the training thread may have
      dispatched beyond the one the accelerator runs (``RUN_AHEAD_STAGES``).
      Fewer: the workers' programs and copies wait less behind the stage
      programs; more: the accelerator is less likely to wait for a dispatch.
    stream_slots: streamed subgroups in flight at most (``STREAM_SLOTS``),
      fewer where the room beside the step's peak cannot hold them (``"auto"``).
    rebalance: measure which of the host and stream paths finishes its step
      later and move one subgroup at a time across their boundary toward the
      other (``REBALANCE_GAP_S``), until the first move back (at most
      ``REBALANCE_STEPS`` steps, after the first ``REBALANCE_AFTER_STEPS``,
      which compile). A step that rebalances first waits for the
      last one's update to end. The numbers do not change.
    host_budget_bytes: pinned host bytes the step may use at most
      (:meth:`host_bytes`); ``None``: ``overlap_plan.HOST_SHARE`` of the machine's RAM,
      and no more than XLA's pinned pool. The stream path speculates on as
      many parameters as the rest of the budget holds
      (:attr:`stream_speculation`), the others waiting for the clip
      decision. Where the state, the host path's buffers and the streamed
      state do not fit, a ``MemoryError`` before any state moves or buffer
      is allocated, so that ``params`` and ``opt_state`` stay usable on the
      plain path.
    speculation: ``"silent"`` (the default): the workers speculate that the
      clip stays silent only where the last step's clip was silent; after a
      fired step they wait for the decision and step every subgroup once,
      with the true scale, in the order the next forward pass needs them (a
      fired clip makes a speculation wasted work that competes for host DRAM
      and the link). ``"always"``: speculate every step. ``"never"``: wait for
      every decision. The numbers are the same in all three.

  A call ``step(batch) -> loss`` takes one step: the mean loss of the batch
  (an accelerator scalar), with the parameters it was computed at being the
  previous step's. It returns once the backward pass is dispatched; reading
  the loss waits behind the state's copies to the host, so read a few steps'
  losses at a time. :attr:`params` and :attr:`opt_state` wait for the pending
  update and return the current trees; the state equals
  ``optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(...))``'s on
  the same gradients, to float32 rounding, in every placement, and the same
  bits in two runs of the same steps.

  Run other accelerator programs (an evaluation) after :meth:`settle`: a
  program's first run loads it, and on a GPU a cuDNN graph loaded while
  another thread launches work fails its stream capture. The step commits
  the parameters and holds its first step's worker jobs until that step's
  programs have run, so that its own programs are loaded with no other
  thread launching.
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
    run_ahead_stages: int = RUN_AHEAD_STAGES,
    stream_slots: int = STREAM_SLOTS,
    host_budget_bytes: int | None = None,
    rebalance: bool = False,
    speculation: str = "silent",
  ):
    if not isinstance(params, (list, tuple)):
      raise TypeError(
        f"params must be a list of parameter groups (one tree per group, the stages name them by index), got"
        f" {type(params).__name__}."
      )
    owner = overlappable(tx, list(params))
    _check_no_command_buffers()
    options = StepOptions(micro_batches, micro_batch_order, run_ahead_stages, stream_slots, host_budget_bytes)
    if speculation not in SPECULATION_MODES:
      raise ValueError(f"speculation must be one of {SPECULATION_MODES}, got {speculation!r}.")
    self.speculation = speculation
    self.micro_batch_order, self.run_ahead_stages = options.micro_batch_order, options.run_ahead_stages
    self.host_budget_bytes = options.host_budget_bytes
    self._rebalance_left = REBALANCE_STEPS if rebalance else 0
    self._last_move: str | None = None
    self._last_record: _StepRecord | None = None
    self._steps_taken = 0
    if clip_norm is not None and not clip_norm > 0:
      raise ValueError(f"clip_norm must be > 0 or None (no clip), got {clip_norm!r}.")
    if opt_state is not None and not isinstance(opt_state, InterleavedAdamState):
      raise TypeError(
        f"opt_state must be the InterleavedAdamState of tx.init(params), or None for a fresh one, got"
        f" {type(opt_state).__name__}."
      )
    self.model = StagedModel(stages, len(params))
    self.hyper, self.clip_norm, self.micro_batches = owner.hyper, clip_norm, options.micro_batches
    leaves, self._treedef = leaves_with_paths(list(params), "params")
    if opt_state is not None:
      for name, tree in (("master", opt_state.master), ("mu", opt_state.mu), ("nu", opt_state.nu)):
        if jax.tree.structure(tree) != self._treedef:
          raise ValueError(
            f"opt_state.{name} does not match params: pass tx.init(params), a state restored for them, or None."
          )
    self.decay = decay_flags(owner.mask, list(params), self.hyper.weight_decay)
    self.stage_times = stage_times
    self._layout = step_layout(self.model, list(params), owner.subgroup_size)
    self.subgroup_group = partition_groups(params, owner.subgroup_size)[2]
    self._forward_order = self._layout.forward_order  # subgroups in the order the forward pass needs them
    self._forward_rank = {s: r for r, s in enumerate(self._forward_order)}
    self.stream_speculation: int | None = None  # streamed parameters a step may speculate on (None: all)
    self.plan = overlap_plan.plan_step(
      tx, stages, list(params), plan=plan, stage_times=stage_times, **dataclasses.asdict(options)
    )
    self.group_subgroups = [[s for s, g in enumerate(self.subgroup_group) if g == gi] for gi in range(len(params))]
    self._params = memory.committed(list(leaves))  # the programs of the first step are then those of every later one
    self._derive_orders()
    self._check_host_memory()  # before any state moves or spare buffer is allocated
    place = lambda xs: [  # noqa: E731
      a if memory.memory_kind(a) == MEMORY_KIND[p] else memory.copy_in(a, MEMORY_KIND[p], a.dtype)
      for a, p in zip(xs, self._leaf_placement)
    ]
    if opt_state is None:  # a fresh state (tx.init's), allocated once in the step's placements
      kinds = [MEMORY_KIND[p] for p in self._leaf_placement]
      self._masters = [memory.copy_in(a, k) for a, k in zip(leaves, kinds)]
      fmt = self.hyper.moments
      self._mus, self._nus = (
        [moment_formats.zeros_like_in(a, k, fmt) for a, k in zip(leaves, kinds)] for _ in range(2)
      )
      self._count = jnp.zeros([], jnp.int32)
    else:
      state = (opt_state.master, opt_state.mu, opt_state.nu)
      # A state tx.init partitioned over the mesh ('auto') is gathered back to the parameters' layout.
      self._masters, self._mus, self._nus = (place(partition.relaid(jax.tree.leaves(t), leaves)) for t in state)
      self._count = opt_state.count
    self._lows: dict[int, jax.Array] = {}
    self._spares: dict[int, tuple] = {}
    self._host_buffers([i for s in self.plan.indices("host") for i in self.plan.subgroups[s]])
    self._group_start = np.cumsum([0] + [len(jax.tree.leaves(t)) for t in params]).tolist()
    self._unfinished = [0] * len(params)  # per group: subgroups whose new weights are not yet final
    self._closed = False
    self._updating = False  # between a step's first hand-over and its decision
    self.grad_norm: jax.Array | None = None  # the last step's global norm of the mean gradient (before the clip)
    self._errors: list[BaseException] = []
    self._wake = threading.Condition()
    self._in_flight: deque = deque()  # streamed subgroups' copies back to the host, oldest first
    self._prefetched: dict[int, list] = {}  # streamed subgroup -> its state on its way in, ahead of its gradients
    self._prefetch_next = 0  # index into _stream_order of the next subgroup to prefetch
    self._stream_step_open = False  # (stream worker) between a step's first prefetch and its commit
    self._sending: deque = deque()  # host subgroups' new weights on their way in: (record, subgroup, arrays, final)
    self._run_ahead: deque = deque()  # markers of the stage programs dispatched and maybe not yet run, oldest first
    # The first step's jobs, held until its programs have run: a program's first run initialises it, and a cuDNN
    # graph loaded then is captured from the launching stream, which a launch from another thread fails
    # (docs/measurements.md, the cuDNN race).
    self._held: list | None = []
    kw = self.hyper
    self._kernel_kw = dict(b1=kw.b1, b2=kw.b2, eps=kw.eps, eps_root=kw.eps_root, weight_decay=kw.weight_decay)
    self._host = JobThread("jax_dos-overlap-host", self._errors, self._wake)
    top_up = weakref.WeakMethod(self._stream_top_up)
    self._streamer = JobThread("jax_dos-overlap-stream", self._errors, self._wake, top_up, IDLE_POLL_S)
    self._decider = JobThread("jax_dos-overlap-decide", self._errors, self._wake)
    self._host.submit(host_kernels.set_num_threads, None, TRAINING_CORES)
    _OPEN_STEPS.add(self)
    atexit.unregister(_close_open_steps)
    atexit.register(_close_open_steps)

  # ----------------------------------------------------------------------------- the plan

  def _derive_orders(self) -> None:
    self.stream_speculation = overlap_plan.speculation_cap(self.plan, self._layout, self.host_budget_bytes)
    self._redo_on_stream = overlap_plan.stream_share_of_host(self.plan, self._layout)
    self._stream_order = [  # streamed subgroups in the order the backward pass hands them over
      s for i in reversed(range(len(self.model.stages))) for g in self.model.groups_completing(i)
      for s in self.group_subgroups[g] if self.plan.placements[s] == "stream"
    ]  # fmt: skip
    self._stream_rank = {s: r for r, s in enumerate(self._stream_order)}
    self._leaf_placement = self.plan.leaf_placements()

  def _host_buffers(self, leaves: list[int]) -> None:
    """The host path's buffers for these leaves: the new weights' staging copy and the spare state."""
    low = lambda i: jnp.bfloat16 if self._params[i].dtype == jnp.bfloat16 else jnp.float32  # noqa: E731
    self._lows.update(zip(leaves, memory.zeros_like_each([(self._masters[i], low(i)) for i in leaves])))
    state = lambda i: (self._masters[i], self._mus[i], self._nus[i])  # noqa: E731
    spares = memory.zeros_like_each([(a, a.dtype) for i in leaves for a in state(i)])
    self._spares.update({i: tuple(spares[3 * j : 3 * j + 3]) for j, i in enumerate(leaves)})

  def _check_host_memory(self) -> None:
    overlap_plan.check_host_memory(
      self.plan, self._layout, self.stream_speculation, self.host_budget_bytes, self.hyper.moments
    )

  def host_bytes(self) -> int:
    """Pinned host bytes the step needs at most (``overlap_plan.host_bytes``): the offloaded state, the host path's
    spare state and copies, and the streamed parameters speculated on (:attr:`stream_speculation` at most)."""
    return overlap_plan.host_bytes(self.plan, self._layout, self.stream_speculation, self.hyper.moments)

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
    record = _StepRecord(device_steps.scalars(self.hyper, self._count, np.float32(1.0 / k)))
    previous, self._last_record = self._last_record, record
    try:
      losses = self._run_programs([micro_batch(batch, m, k) for m in range(k)], record, previous)
    except BaseException as e:
      if self._updating and not self._errors:  # cut short between hand-over and decision: refuse further steps
        self._errors.append(e)
      raise
    return losses[0] if k == 1 else sum(losses) / k

  def _stage_params(self, stage: int) -> tuple:
    return tuple(self._group_tree(g) for g in self.model.stages[stage].groups)

  def _group_tree(self, g: int) -> Any:
    lo, hi = self._group_start[g], self._group_start[g + 1]
    return jax.tree.unflatten(self._treedef.children()[g], self._params[lo:hi])

  def _run_programs(self, parts: list, record: _StepRecord, previous: _StepRecord | None) -> list[jax.Array]:
    """Dispatches the step's stage programs in ``micro_batch_order``; returns each micro-batch's loss.

    A stage's programs wait for its groups' final weights (the previous
    step's update); the last micro-batch's backward program of a stage hands
    the groups it completes over to the optimizer; the last backward program
    decides the clip. Whether the workers speculate is decided at the first
    hand-over, from ``previous`` step's decision (:meth:`_speculates`).
    """
    n, k = len(self.model.stages), len(parts)
    programs = schedule(n, k, self.micro_batch_order)
    window = max(j for j, (kind, _, _) in enumerate(programs) if kind == "forward") + 1  # the final backward pass
    inputs = [[None] * n for _ in range(k)]  # each micro-batch's stage inputs, kept from forward to backward
    sums: list[Any] = [None] * len(self._unfinished)
    dys, losses, squares = [None] * k, [None] * k, []
    reached: set[int] = set()  # stages whose groups' final weights were waited for
    for j, (kind, i, m) in enumerate(programs):
      st = self.model.stages[i]
      if i not in reached:
        self._wait_groups(st.groups)  # at once where they are final
        reached.add(i)
      if j == window and self._stream_order:
        self._submit(self._streamer, self._stream_prefetch)
      if kind == "forward":
        with trace.span("overlap.forward"):
          x = self.model.forward(i, self._stage_params(i), inputs[m][i], parts[m])
        inputs[m][i + 1] = x
        trace.watch(f"forward {i}", x)
        self._pace(x)
        continue
      last = m == k - 1
      with trace.span("overlap.backward"):
        out, new, dys[m], sq = self.model.backward(i, self._stage_params(i), inputs[m][i], parts[m], dys[m],
                                                   tuple(sums[g] for g in st.groups), last)  # fmt: skip
      inputs[m][i] = None
      losses[m] = out if out is not None else losses[m]
      for g, s in zip(st.groups, new):
        sums[g] = s
      trace.watch(f"backward {i}", dys[m] if dys[m] is not None else new)
      self._pace(dys[m] if dys[m] is not None else new)
      if last:
        squares += sq
        if record.speculate is None:  # set before the step's first job is queued: the workers only read it
          record.speculate = self._speculates(previous)
        for g in self.model.groups_completing(i):
          self._hand_over(record, g, sums[g])
          sums[g] = None
    self._decide(record, squares)
    return losses

  def _speculates(self, previous: _StepRecord | None) -> bool:
    """Whether this step's workers speculate that the clip stays silent (:attr:`speculation`).

    ``"silent"``: unless the previous step's clip fired. Its decision is
    known by the time this step's backward pass hands over (the decider reads
    it as that step's backward pass ends); where it is not yet, speculate.
    """
    if self.speculation != "silent":
      return self.speculation == "always"
    if previous is None:
      return True
    with self._wake:
      decision = previous.decision
    return decision is None or not decision.fired

  def _pace(self, x: Any) -> None:
    """Waits until at most ``run_ahead_stages`` dispatched stage programs (the last one producing ``x``) are unrun."""
    if not jax.tree.leaves(x):
      return
    self._run_ahead.append(trace.ready_marker(x))
    while len(self._run_ahead) > self.run_ahead_stages + 1:
      with trace.span("overlap.pace"):
        jax.block_until_ready(self._run_ahead.popleft())

  def _submit(self, worker: JobThread, *job) -> None:
    """Queues ``job`` for ``worker``, or holds it until the first step's programs have run."""
    if self._held is not None:
      self._held.append((worker, job))
    else:
      worker.submit(*job)

  def _hand_over(self, record: _StepRecord, g: int, grads: Any) -> None:
    """Queues group ``g``'s complete gradients for its subgroups' paths (host ones leave the accelerator now)."""
    self._updating = True
    lo = self._group_start[g]
    grads = jax.tree.leaves(grads)
    with self._wake:
      self._unfinished[g] = len(self.group_subgroups[g])
    for s in self.group_subgroups[g]:
      leaves = self.plan.subgroups[s]
      placement = self.plan.placements[s]
      subgroup_grads = [grads[i - lo] for i in leaves]
      if placement == "device":
        record.resident_grads.update(zip(leaves, subgroup_grads))
      elif placement == "host":
        with trace.span("overlap.grads_d2h"):
          full = dict(zip(leaves, subgroup_grads))
          on_host = host_gradients([full.get(i) for i in range(max(leaves) + 1)], self._masters, list(leaves))
        self._submit(self._host, self._host_update, record, s, on_host)
      else:
        self._submit(self._streamer, self._stream_update, record, s, subgroup_grads)

  def _decide(self, record: _StepRecord, squares: list[jax.Array]) -> None:
    """The true gradient scale: runs the resident update with it; the decider tells the workers whether they
    guessed it. The training thread does not wait for the decision: the next forward pass starts on the stages
    whose weights are final (resident ones at once) and waits for the others' workers."""
    scale, self.grad_norm = _jit_step_scale(squares, self.clip_norm, self.micro_batches)
    true = device_steps.scalars(self.hyper, self._count, scale)
    _start_copy_to_host(true)
    self._resident_update(record, true)
    if self._held is not None:  # the first step: every program of the step has run once when this returns
      jax.block_until_ready((true, self._params))
      for worker, job in self._held:
        worker.submit(*job)
      self._held = None
    self._decider.submit(self._announce, record, true)
    self._count = device_steps.increment(self._count)
    self._updating = False

  def _announce(self, record: _StepRecord, true: jax.Array) -> None:
    """(decider thread) Reads the true scalars once the backward pass has ended and hands the workers the verdict."""
    with trace.span("decide.read"):
      host = np.asarray(true)
    decision = _Decision(host, true, not host[3] == record.spec_host()[3])
    with self._wake:  # written under the lock: the training thread reads it there (_speculates)
      record.decision = decision
      self._wake.notify_all()  # a stream worker past its speculation waits for this
    self._host.submit(self._host_finish, record)
    self._streamer.submit(self._stream_finish, record)

  def _resident_update(self, record: _StepRecord, scalars: jax.Array) -> None:
    calls, size = [[]], 0
    for s in self.plan.indices("device"):
      if calls[-1] and size + self.plan.sizes[s] > RESIDENT_CALL_ELEMENTS:
        calls.append([])
        size = 0
      calls[-1].append(s)
      size += self.plan.sizes[s]
    for subs in (c for c in calls if c):
      leaves = [i for s in subs for i in self.plan.subgroups[s]]
      with trace.span("overlap.resident"):
        masters = [self._masters[i] for i in leaves]
        grads = memory.like_states([record.resident_grads.pop(i) for i in leaves], masters)
        outs = device_steps.update_params(
          grads, masters, [self._mus[i] for i in leaves], [self._nus[i] for i in leaves],
          [self._params[i] for i in leaves], scalars, self.hyper, tuple(self.decay[i] for i in leaves),
        )  # fmt: skip
      for j, i in enumerate(leaves):
        self._params[i], self._masters[i], self._mus[i], self._nus[i] = (o[j] for o in outs)
      for s in subs:
        self._finished(s)

  # ----------------------------------------------------------------------------- the host worker

  def _host_update(self, record: _StepRecord, s: int, grads: dict[int, jax.Array]) -> None:
    with trace.span("host.wait_grads"):
      jax.block_until_ready(list(grads.values()))
    record.host_grads[s] = grads
    decision = record.decision
    if decision is not None and decision.fired and s in self._redo_on_stream:
      return  # the stream worker steps it
    if decision is None and not record.speculate:
      record.host_deferred.append(s)  # stepped once the decision is known, in forward order (_host_finish)
      return
    self._host_weights(record, s, decision.host if decision else record.spec_host(), final=decision is not None)
    if decision is None:
      record.host_speculated.append(s)

  def _host_weights(self, record: _StepRecord, s: int, scalars: np.ndarray, final: bool) -> None:
    """The kernel's step into the spare buffers (the state stays as it was), the new weights sent to the parameters.

    The copy to the accelerator is issued and left in flight (it starts only once the compute queue has reached
    the point where it was issued, a few stage programs later); the program that writes the weights in place
    is dispatched once the copy has landed (:meth:`_assign_sent`), while the kernel steps later subgroups.
    """
    leaves = self.plan.subgroups[s]
    buffers, decay = [], []
    for i in leaves:
      arrays = (record.host_grads[s][i], self._masters[i], self._mus[i], self._nus[i], *self._spares[i], self._lows[i])
      for shards in zip(*(memory.shards(a) for a in arrays)):
        buffers.append(shards)
        decay.append(self.decay[i])
    with trace.span("host.kernel"):
      host_kernels.adam_many_into(buffers, decay, **self._kernel_kw, scalars=scalars)
    with trace.span("host.send"):
      sent = memory.put([self._lows[i] for i in leaves], "device", likes=[self._params[i] for i in leaves])
    self._sending.append((record, s, sent, final))
    self._assign_sent(wait=False)

  def _assign_sent(self, wait: bool) -> None:
    """Writes the new weights of the subgroups whose copies have landed (all of them with ``wait``), in order."""
    while self._sending and (wait or all(x.is_ready() for x in self._sending[0][2])):
      record, s, sent, final = self._sending.popleft()
      with trace.span("host.assign"):
        leaves = self.plan.subgroups[s]
        jax.block_until_ready(sent)  # never dispatch a program whose input is in flight: it would hold the queue
        new = device_steps.assign([self._params[i] for i in leaves], sent)
      for i, x in zip(leaves, new):
        self._params[i] = x
      record.host_sent += new
      record.path_end["host"] = time.perf_counter()
      if final:
        self._finished(s)

  def _host_finish(self, record: _StepRecord) -> None:
    """The decision's consequences for the host subgroups; a fired clip's redo in the order the next forward pass
    needs them, shared with the stream worker (which takes the last ones), then the spare buffers become the state."""
    decision = record.decision
    self._assign_sent(wait=True)
    on_stream = self._redo_on_stream if decision.fired else set()
    by_forward_rank = lambda subgroups: sorted(subgroups, key=self._forward_rank.__getitem__)  # noqa: E731
    if decision.fired:
      with trace.span("host.wait_sent"):
        jax.block_until_ready(record.host_sent)  # the copies read the buffers the redo writes
      record.host_sent.clear()  # the redo writes into (donates) these
      record.host_done.set()  # the stream worker may step its share now
      for s in by_forward_rank(set(record.host_speculated + record.host_deferred) - on_stream):
        with trace.span("host.redo" if s in record.host_speculated else "host.kernel_after_decision"):
          self._host_weights(record, s, decision.host, final=True)
      self._assign_sent(wait=True)
      if on_stream:  # committed by the stream worker before the swap below
        with trace.span("host.wait_stream_redo"):
          while not record.stream_redone.wait(_WAIT_POLL_S):
            if self._errors:
              raise RuntimeError("the stream worker failed during a redo") from self._errors[0]
    else:
      for s in record.host_speculated:
        self._finished(s)
      for s in by_forward_rank(record.host_deferred):
        with trace.span("host.kernel_after_decision"):
          self._host_weights(record, s, decision.host, final=True)
      self._assign_sent(wait=True)
    with trace.span("host.wait_sent"):
      jax.block_until_ready(record.host_sent)
    for s in record.host_grads:  # the new state becomes the state; the old one is the next step's spare
      if s in on_stream:
        continue
      for i in self.plan.subgroups[s]:
        current = (self._masters[i], self._mus[i], self._nus[i])
        (self._masters[i], self._mus[i], self._nus[i]), self._spares[i] = self._spares[i], current
    record.host_grads.clear()

  # ----------------------------------------------------------------------------- the stream worker

  def _stream_update(self, record: _StepRecord, s: int, grads: list[jax.Array]) -> None:
    decision = record.decision
    if decision is None and not self._may_speculate(record, s):
      self._wait_decision(record)
      decision = record.decision
    self._stream_dispatch(record, s, grads, decision.device if decision else record.spec_device, decision is not None)

  def _may_speculate(self, record: _StepRecord, s: int) -> bool:
    """Whether subgroup ``s`` fits the step's streamed speculation (:attr:`stream_speculation`); counts it if so."""
    if not record.speculate:
      return False
    size = self.plan.sizes[s]
    if self.stream_speculation is not None and record.speculated_elements + size > self.stream_speculation:
      return False
    record.speculated_elements += size
    return True

  def _wait_decision(self, record: _StepRecord) -> None:
    """(stream worker) Waits for the clip decision, topping up the copies in meanwhile."""
    with trace.span("stream.wait_decision"):
      while record.decision is None:
        if self._errors:
          raise RuntimeError("the step failed before its clip decision") from self._errors[0]
        self._stream_top_up()
        with self._wake:
          if record.decision is None:
            self._wake.wait(IDLE_POLL_S)

  def _stream_state(self, s: int) -> list[list[jax.Array]]:
    leaves = self.plan.subgroups[s]
    return [[lst[i] for i in leaves] for lst in (self._masters, self._mus, self._nus)]

  def _slots_used(self) -> int:
    return len(self._prefetched) + len(self._in_flight)

  def _free_slot(self) -> None:
    back = jax.tree.leaves(self._in_flight.popleft())
    with trace.span("stream.wait_slot"):
      jax.block_until_ready([a for a in back if not a.is_deleted()])  # see _slot_free

  def _wait_for_slot(self) -> None:
    """Frees the oldest slots, waiting for their copies back, until one is free."""
    while self._slots_used() >= self.plan.stream_slots and self._in_flight:
      self._free_slot()

  def _slot_free(self) -> bool:
    """Whether the oldest copy back has landed. A copy back may be deleted while still listed: a redo deletes the
    speculated copies, and a later step deletes its old state, which was an earlier step's copy back."""
    return all(a.is_deleted() or a.is_ready() for a in jax.tree.leaves(self._in_flight[0]))

  def _stream_prefetch(self, more: int | None = None) -> None:
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
      self._stream_step_open = True
    issued = 0
    while self._prefetch_next < len(self._stream_order) and (more is None or issued < more):
      while self._slots_used() >= self.plan.stream_slots and self._in_flight:
        if more is not None and not self._slot_free():
          return
        self._free_slot()
      if self._slots_used() >= self.plan.stream_slots:
        return
      s = self._stream_order[self._prefetch_next]
      with trace.span("stream.prefetch"):
        self._prefetched[s] = memory.put_groups(self._stream_state(s), "device")
      self._prefetch_next += 1
      issued += 1

  def _stream_top_up(self) -> None:
    """(stream worker, idle or waiting) Copies in the next subgroups' state into every slot already free."""
    if self._stream_step_open:
      self._stream_prefetch(more=self.plan.stream_slots)

  def _wait_landed(self, state: list[list[jax.Array]]) -> None:
    """Waits until ``state`` is on the accelerator, topping up the copies in meanwhile."""
    arrays = jax.tree.leaves(state)
    with trace.span("stream.wait_state"):
      while not all(a.is_ready() for a in arrays):
        self._stream_top_up()
        time.sleep(IDLE_POLL_S)

  def _stream_dispatch(self, record: _StepRecord, s: int, grads: list[jax.Array], scalars: jax.Array, final: bool):
    leaves = list(self.plan.subgroups[s])
    earlier = record.streamed.get(s)
    state = None if earlier else self._prefetched.pop(s, None)
    if not earlier:  # updates come in hand-over order: never prefetch this one or an earlier one again this step
      self._prefetch_next = max(self._prefetch_next, self._stream_rank[s] + 1)
    if state is None:
      self._wait_for_slot()
    with trace.span("stream.dispatch"):
      old = earlier.old if earlier else self._stream_state(s)
      if state is None:
        state = memory.put_groups(old, "device")
      self._wait_landed(state)  # the update waits here, not on the accelerator's compute queue
      g = memory.like_states(grads, old[0])
      outs = device_steps.update_params(g, *state, [self._params[i] for i in leaves], scalars, self.hyper,
                                        tuple(self.decay[i] for i in leaves))  # fmt: skip
      back = memory.put_groups(list(outs[1:]), "pinned_host")
    for i, x in zip(leaves, outs[0]):
      self._params[i] = x
    if earlier:
      jax.block_until_ready(earlier.new)  # their copies out must land before the host buffers are freed
      for a in (a for group in earlier.new for a in group):
        a.delete()
    record.path_end["stream"] = time.perf_counter()
    self._in_flight.append(back)
    if final:
      record.streamed.pop(s, None)
      self._stream_commit(s, old, back)
      self._finished(s)
    else:
      record.streamed[s] = _Streamed(old, back, grads)
    if not earlier:
      self._stream_top_up()

  def _stream_commit(self, s: int, old: list[list[jax.Array]], new: list[list[jax.Array]]) -> None:
    """The new state becomes subgroup ``s``'s; the old host buffers are freed once their copies are done (like a
    donated buffer: the update that read them has waited for them to land)."""
    for i, m, mu, nu in zip(self.plan.subgroups[s], *new):
      self._masters[i], self._mus[i], self._nus[i] = m, mu, nu
    for a in (a for group in old for a in group):
      a.delete()

  def _stream_finish(self, record: _StepRecord) -> None:
    decision = record.decision
    self._stream_step_open = False
    for s in sorted(record.streamed, key=self._forward_rank.__getitem__):  # the speculated ones
      streamed = record.streamed[s]
      if decision.fired:
        self._stream_dispatch(record, s, streamed.grads, decision.device, True)  # commits
      else:
        del record.streamed[s]
        self._stream_commit(s, streamed.old, streamed.new)
        self._finished(s)
    record.streamed.clear()
    if decision.fired and self._redo_on_stream:
      self._stream_host_share(record)

  def _stream_host_share(self, record: _StepRecord) -> None:
    """(stream worker, clip fired) Steps its share of the host subgroups (``_redo_on_stream``) on the accelerator,
    while the host worker redoes the others: the work after the backward pass takes both paths. A fixed share, so
    that a subgroup's numbers never depend on which thread came first."""
    try:
      with trace.span("stream.wait_host"):
        while not record.host_done.wait(_WAIT_POLL_S):  # the host worker is done with these subgroups' buffers
          if self._errors:
            raise RuntimeError("the host worker failed before its redo") from self._errors[0]
      for s in sorted(self._redo_on_stream, key=self._forward_rank.__getitem__):
        self._stream_redo_host(record, s)
    finally:
      record.stream_redone.set()

  def _stream_redo_host(self, record: _StepRecord, s: int) -> None:
    """Host subgroup ``s`` stepped on the accelerator with the true scale from its untouched state; the new state
    comes back into new host buffers and becomes the state, the old one the spare (the speculated spare is freed)."""
    leaves = list(self.plan.subgroups[s])
    self._wait_for_slot()
    with trace.span("stream.redo_host"):
      old = self._stream_state(s)
      state = memory.put_groups(old, "device")
      grads = memory.put([record.host_grads[s][i] for i in leaves], "device")
      self._wait_landed([state, grads])
      g = memory.like_states(grads, old[0])
      outs = device_steps.update_params(g, *state, [self._params[i] for i in leaves], record.decision.device,
                                        self.hyper, tuple(self.decay[i] for i in leaves))  # fmt: skip
      back = memory.put_groups(list(outs[1:]), "pinned_host")
    self._in_flight.append(back)
    for j, i in enumerate(leaves):
      self._params[i] = outs[0][j]
      speculated = self._spares[i]
      self._spares[i] = (old[0][j], old[1][j], old[2][j])
      self._masters[i], self._mus[i], self._nus[i] = back[0][j], back[1][j], back[2][j]
      for a in speculated:
        a.delete()
    self._finished(s)

  # ----------------------------------------------------------------------------- rebalancing

  def _rebalance(self, last: _StepRecord) -> None:
    """Moves one subgroup across the stream/host boundary toward the path that finished the last step first."""
    self._rebalance_left -= 1
    self.settle()  # the last step's ends are final, and no worker touches the buffers moved below
    self._move_boundary(dict(last.path_end))

  def _move_boundary(self, ends: dict[str, float]) -> None:
    """One subgroup across the boundary, toward the path whose end (``ends``: seconds) came first."""
    host, stream = ends.get("host"), ends.get("stream")
    if host is None or stream is None or abs(host - stream) < REBALANCE_GAP_S:
      return
    to = "host" if stream > host else "stream"
    if self._last_move not in (None, to):  # the boundary has crossed the balance: keep it
      self._rebalance_left = 0
      return
    placements = list(self.plan.placements)
    frm = "stream" if to == "host" else "host"
    side = [s for s in self._forward_order if placements[s] == frm]
    if len(side) < 2:  # keep each path in use
      self._rebalance_left = 0
      return
    s = side[-1] if to == "host" else side[0]  # the one next to the boundary (streamed: earlier stages)
    placements[s] = to
    previous = self.plan
    self.plan = self.plan.with_placements(placements, predicted={}, source=previous.source.split("+rebalanced")[0]
                                          + "+rebalanced")  # fmt: skip
    leaves = list(self.plan.subgroups[s])
    if to == "host":
      try:
        self._derive_orders()
        self._check_host_memory()
      except MemoryError:
        self.plan, self._rebalance_left = previous, 0
        self._derive_orders()
        return
      self._host_buffers(leaves)
    else:
      for i in leaves:
        for a in (self._lows.pop(i), *self._spares.pop(i)):
          a.delete()
    self._derive_orders()
    self._last_move = to

  # ----------------------------------------------------------------------------- waiting

  def _finished(self, s: int) -> None:
    with self._wake:
      self._unfinished[self.subgroup_group[s]] -= 1
      self._wake.notify_all()

  def _wait_groups(self, groups: Sequence[int]) -> None:
    with trace.span("overlap.wait_params"), self._wake:
      while any(self._unfinished[g] for g in groups):
        self._raise_errors()
        self._wake.wait(_WAIT_POLL_S)
    self._raise_errors()

  def _raise_errors(self) -> None:
    if self._errors:
      raise RuntimeError(
        "the overlapped step's optimizer worker failed; the parameters and state are no longer usable."
      ) from self._errors[0]

  def settle(self) -> None:
    """Waits until every pending update has written the parameters and the whole state."""
    self._decider.join()  # the verdict queues the workers' last jobs
    self._wait_groups(range(len(self._unfinished)))
    self._host.join()
    self._streamer.join()
    self._raise_errors()

  def close(self) -> None:
    """Settles the pending update and ends the worker threads; the step cannot be called again."""
    try:
      self.settle()
    finally:
      for worker in (self._decider, self._host, self._streamer):
        worker.stop()
      for worker in (self._decider, self._host, self._streamer):
        worker.wait_stopped()  # no thread of a closed step is left to be stopped as Python exits
      self._closed = True
      _OPEN_STEPS.discard(self)

  def __enter__(self) -> OverlappedStep:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    for worker in (getattr(self, "_decider", None), getattr(self, "_host", None), getattr(self, "_streamer", None)):
      if worker is not None:
        worker.stop()

  @property
  def params(self) -> list[Any]:
    """The current parameter groups (waits for the pending update). The next step consumes them."""
    self._wait_groups(range(len(self._unfinished)))
    return jax.tree.unflatten(self._treedef, list(self._params))

  @property
  def opt_state(self) -> InterleavedAdamState:
    """The current optimizer state (waits for every pending write). The next step consumes it."""
    self.settle()
    unflat = lambda xs: jax.tree.unflatten(self._treedef, list(xs))  # noqa: E731
    return InterleavedAdamState(self._count, unflat(self._masters), unflat(self._mus), unflat(self._nus))
