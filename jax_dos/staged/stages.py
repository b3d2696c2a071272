"""A model as a sequence of stages, each with its own jitted forward and backward program.

A staged model computes its loss as a chain of stage functions::

    x_1 = f_0(P_0, None, batch)            (the first stage reads the batch: embeddings)
    x_{i+1} = f_i(P_i, x_i, batch)         (blocks)
    loss = f_{n-1}(P_{n-1}, x_{n-1}, batch)  (the last stage returns the scalar loss)

where ``P_i`` is the tuple of the parameter *groups* stage ``i`` uses (a group
may be used by several stages: a head tied to the token embedding uses the
embedding's group). The forward pass keeps each stage's input ``x_i``; the
backward pass of stage ``i`` returns the cotangent of ``x_i`` and the
gradients of ``P_i``, added in place to a running sum where one exists
(micro-batches, groups used by several stages).

What else the forward pass keeps is the stage's rematerialisation policy
(:attr:`Stage.remat`, ``jax_dos.staged.remat``): under ``"full"`` nothing, and the
backward program recomputes ``f_i`` under ``jax.vjp`` (activation
checkpointing per stage, as ``jax.checkpoint`` per block does); under another
policy the forward program runs ``jax.vjp`` of ``jax.checkpoint(f_i,
policy)`` and returns, beside ``x_{i+1}``, the residuals the policy saves
(``remat.Saved``: the vjp function's arrays, less those that are the stage's
own inputs), and the backward program applies that vjp function to them,
recomputing only what the policy did not save. The last stage has no forward
program (its backward program computes the loss), so its policy is unused.

Gradients therefore become ready stage by stage, the last stage first, each
group's complete gradient as soon as the backward pass has passed the first
stage that uses it (:attr:`StagedModel.completion`). That is what lets the
optimizer start on them while the backward pass continues
(``jax_dos.overlap``).

A step of ``k`` micro-batches runs its programs in one of two orders
(:func:`schedule`):

* ``"stage"``: every micro-batch through stage ``i`` before stage ``i + 1``
  (forward), and through stage ``i`` before stage ``i - 1`` (backward). A
  group's gradient is then complete once the one backward pass has passed
  its stage, so the optimizer's window is the whole backward pass. The
  forward pass keeps ``k`` micro-batches' stage inputs at once.
* ``"batch"``: micro-batch after micro-batch, each a whole forward and
  backward pass (the plain accumulated step's order). Gradients are complete
  only in the last micro-batch's backward pass; one micro-batch's stage
  inputs are kept at a time.

Each group's gradients are summed over the micro-batches in micro-batch
order in both; a group used by two stages (a tied head) adds its two stages'
terms in the order the schedule runs them.

The backward program of the stage completing a group also returns the sum of
squares of that group's gradient, in float32, for the global norm.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_dos.core import partition
from jax_dos.memory import kinds as memory
from jax_dos.planning.timeline import RematCosts, StageTimes
from jax_dos.staged import gather_ahead
from jax_dos.staged.micro_batches import micro_batch, schedule
from jax_dos.staged.remat import Saved, check_policy
from jax_dos.staged.stage_programs import Stage, backward_call, forward_call, gradient_layouts


class StagedModel:
  """The stages of a model over ``num_groups`` parameter groups, and their jitted programs.

  On a mesh, with ``partition_gradients`` (the default, as
  ``interleaved_adam``'s state is partitioned by default), each backward
  program puts a replicated parameter's gradients in its partitioned state's
  layout (:func:`gradient_layouts`): XLA reduce-scatters them as the stage's
  backward pass ends, and the running sums hold each device's share only.
  With ``gather_ahead``, where a stage's weights are sharded, the backward
  program before it gathers them whole beside its own compute
  (``jax_dos.staged.gather_ahead``; :meth:`backward`'s ``ahead``) in
  :meth:`loss_and_grads` (the overlapped step runs its programs so where it
  gathers ahead); :meth:`measure_times` times a block both ways and says
  which was faster.

  Attributes:
    stages: the stages, in forward order.
    completion: for each group, the stage whose backward pass completes its
      gradient (the first stage that uses it).
  """

  def __init__(
    self, stages: Sequence[Stage], num_groups: int, *, partition_gradients: bool = True, gather_ahead: bool = False
  ):
    self.stages = tuple(stages)
    self.partition_gradients, self.gather_ahead = partition_gradients, gather_ahead
    self._layouts: dict[tuple, tuple] = {}  # (stage, its parameters' shardings) -> their gradient_layouts
    if len(self.stages) < 2:
      raise ValueError("a staged model needs at least two stages (the first reads the batch, the last the loss).")
    for i, st in enumerate(self.stages):
      if not isinstance(st, Stage):
        raise TypeError(f"stage {i} is a {type(st).__name__}; give jax_dos.Stage(fn, groups) objects.")
      if max(st.groups) >= num_groups:
        raise ValueError(f"stage {i} uses group {max(st.groups)} but the parameters have {num_groups} groups.")
    used = [[i for i, st in enumerate(self.stages) if g in st.groups] for g in range(num_groups)]
    unused = [g for g, u in enumerate(used) if not u]
    if unused:
      raise ValueError(f"parameter groups {unused} are used by no stage; every group must belong to a stage.")
    self.completion = tuple(min(u) for u in used)

  def groups_completing(self, stage: int) -> tuple[int, ...]:
    """The groups whose gradient is complete once ``stage``'s backward pass has run."""
    return tuple(g for g in self.stages[stage].groups if self.completion[g] == stage)

  def inputs(self, stage: int, micro_batch: int = 0) -> Any:
    """Stage ``stage``'s :attr:`Stage.inputs` for micro-batch ``micro_batch`` of the coming step (``None``: none)."""
    st = self.stages[stage]
    return None if st.inputs is None else st.inputs.at(micro_batch)

  def advance(self, micro_batches: int) -> None:
    """A step of ``micro_batches`` was taken: each stage's :attr:`Stage.inputs` moves on (random counters)."""
    for st in self.stages:
      if st.inputs is not None:
        st.inputs.advance(micro_batches)

  def forward(self, stage: int, params: tuple, x: Any, batch: Any, micro_batch: int = 0) -> tuple[Any, Saved | None]:
    """``(y, saved)``: stage ``stage``'s output and what its policy keeps for its backward pass (``None`` under
    ``"full"``), dispatched asynchronously; ``micro_batch`` picks the stage's :meth:`inputs`."""
    return forward_call(self.stages[stage], params, x, batch, self.inputs(stage, micro_batch))

  def backward(
    self, stage: int, params: tuple, x: Any, batch: Any, dy: Any, sums: tuple, last: bool, saved=None, micro_batch=0,
    *, gathered: tuple | None = None, ahead: tuple | None = None,
  ) -> tuple:  # fmt: skip
    """Stage ``stage``'s backward pass; ``sums`` are consumed, and ``dy`` where ``dx`` can take its buffers.

    ``dy`` is ``None`` for the last stage (whose output is the loss), and
    ``sums`` holds, per group of the stage, the running gradient sum or
    ``None``; ``saved`` is what the stage's forward program returned beside
    its output (``None`` under ``"full"``: the backward program recomputes
    the stage). ``dy`` is donated (its buffers become ``dx``'s) where ``x``
    and ``dy`` match in structure, shapes and dtypes; the first stage's (no
    ``dx``) and any other's is kept, for the caller to drop. Returns
    ``(loss, sums, dx, squares)``: the loss for the last stage (else
    ``None``), the new sums, the cotangent of ``x`` (``None`` for the first
    stage) and, with ``last`` (the last micro-batch), the float32 sums of
    squares of the groups this stage completes. ``micro_batch`` picks the
    stage's :meth:`inputs`: its forward program's.

    Weights gathered ahead (``jax_dos.staged.gather_ahead``): ``ahead``, the next
    backward program's stage's parameters (sharded, as ``params`` are), are
    gathered whole by this program and returned as a fifth element (the
    leaves of :func:`gather_ahead.gather_targets`, or ``None`` where every
    leaf is whole already); ``gathered``, what an earlier program returned
    so for this stage, is used in place of those leaves of ``params``, and
    the gradients keep ``params``' sharded layout.
    """
    st = self.stages[stage]
    complete = tuple(last and self.completion[g] == stage for g in st.groups)
    layouts = self.layouts(stage, params)
    if gathered is not None:
      params = gather_ahead.with_gathered(params, gather_ahead.gather_targets(params), gathered)
    targets = () if ahead is None else gather_ahead.gather_targets(ahead)
    leaves = () if ahead is None else jax.tree.leaves(ahead)
    program, args = backward_call(st, complete, params, x, batch, dy, sums, saved, layouts,
                                   self.inputs(stage, micro_batch), tuple(leaves[j] for j, _ in targets),
                                   tuple(s for _, s in targets))  # fmt: skip
    *out, whole = program(*args)
    return tuple(out) if ahead is None else (*out, whole or None)

  def gathers(self, params: tuple) -> bool:
    """Whether the backward program before a stage's gathers its parameters ``params`` (sharded) ahead: with
    :attr:`gather_ahead`, where a device does not hold some leaf whole (``fsdp``)."""
    return self.gather_ahead and bool(gather_ahead.gather_targets(params))

  def layouts(self, stage: int, params: tuple) -> tuple:
    """Stage ``stage``'s :func:`gradient_layouts` for its parameters ``params`` (found once a stage and layout):
    named where the weights are sharded, since any program may take them whole (``jax_dos.staged.gather_ahead``), so
    that every program, gathering ahead or not, leaves a group's sum in the one layout, the sharded weights'."""
    key = (stage, tuple(getattr(x, "sharding", None) for x in jax.tree.leaves(params)))
    if key not in self._layouts:
      sharded = bool(gather_ahead.gather_targets(params))
      self._layouts[key] = gradient_layouts(params, self.partition_gradients, gathered=sharded)
    return self._layouts[key]

  def loss_and_grads(
    self, groups: Sequence[Any], batch: Any, micro_batches: int = 1, order: str = "stage"
  ) -> tuple[jax.Array, list]:
    """``(mean loss, summed grads)`` of one step, with no optimizer: the gradients the overlapped step uses.

    ``batch`` is split into ``micro_batches`` equal parts; each group's
    gradient is the sum over them, added in the order of :func:`schedule`'s
    ``order`` by the very programs the overlapped step runs (the last
    micro-batch's also square the complete gradients). On a GPU, two programs
    computing the same gradient may pick different matmul algorithms and
    round it differently. Stages with :attr:`Stage.inputs` draw the coming
    step's random numbers; :meth:`advance` moves them on (the step does).
    """
    n, k = len(self.stages), micro_batches
    parts = [micro_batch(batch, m, k) for m in range(k)]
    inputs = [[None] * n for _ in range(k)]
    saved = [[None] * n for _ in range(k)]
    sums: list[Any] = [None] * len(groups)
    dys, losses = [None] * k, [None] * k
    programs = schedule(n, k, order)
    stage_params = [tuple(groups[g] for g in st.groups) for st in self.stages]
    held = gather_ahead.HeldWeights(programs, [self.gathers(p) for p in stage_params])
    for j, (kind, i, m) in enumerate(programs):
      st, params = self.stages[i], stage_params[i]
      if kind == "forward":
        inputs[m][i + 1], saved[m][i] = self.forward(i, params, inputs[m][i], parts[m], m)
        continue
      ahead = held.ahead(j)
      out, new, dys[m], _, *whole = self.backward(
        i, params, inputs[m][i], parts[m], dys[m], tuple(sums[g] for g in st.groups), m == k - 1, saved[m][i], m,
        gathered=held.mine(j), ahead=None if ahead is None else stage_params[ahead],
      )  # fmt: skip
      held.ran(j, whole[0] if whole else None)
      inputs[m][i] = saved[m][i] = None
      losses[m] = out if out is not None else losses[m]
      for g, s in zip(st.groups, new):
        sums[g] = s
    return (losses[0] if k == 1 else sum(losses) / k), sums

  def measure_times(self, groups: Sequence[Any], batch: Any, policies: Sequence[str] = ()) -> StageTimes:
    """Each stage's forward and backward time on ``batch`` (one micro-batch), run one stage at a time, the
    bytes (per device) of the stage inputs its forward pass keeps (each stage's: :attr:`StageTimes.input_bytes`)
    and of the largest backward program's temporaries under ``"full"`` (:attr:`StageTimes.temp_bytes`,
    :meth:`full_temp_bytes`).

    A first pass compiles; the second is timed, waiting for each program.
    The parameters are committed first, as the overlapped step commits them:
    the programs compiled here are then the step's. Where a block's weights are sharded, its backward program is
    first timed both ways (:meth:`_gather_ahead_gain`), and the passes
    gather the weights ahead (``jax_dos.staged.gather_ahead``) where that was
    faster by more than ``gather_ahead.AHEAD_MARGIN``:
    :attr:`StageTimes.gather_ahead` (what the gathers cost depends on the
    shapes and the rows: docs/scaling.md, "Gathering the weights ahead"). With
    ``policies`` (``jax_dos.staged.remat`` names) or a stage whose policy is not
    ``"full"``, also what each stage costs under each of those policies and
    its own (:attr:`StageTimes.remat`, :meth:`remat_costs`), for a plan to
    choose among them (``policies``: :attr:`StageTimes.remat_choices`).
    """
    groups = memory.committed(list(groups))
    stage_params = [tuple(groups[g] for g in st.groups) for st in self.stages]
    gain = self._gather_ahead_gain(stage_params, batch)
    ahead = gain is not None and gain[1] < (1 - gather_ahead.AHEAD_MARGIN) * gain[0]
    self._timed_pass(stage_params, batch, ahead)  # compiles
    fwd, bwd, inputs = self._timed_pass(stage_params, batch, ahead)
    times = StageTimes(fwd, bwd, sum(inputs), input_bytes=inputs, gather_ahead=None if gain is None else ahead,
                       gather_ahead_s=gain or ())  # fmt: skip
    if not policies and all(st.remat == "full" for st in self.stages[:-1]):
      return dataclasses.replace(times, temp_bytes=self.full_temp_bytes(groups, batch))
    for name in policies:
      check_policy(name)
    costs = self.remat_costs(groups, batch, times, policies)
    return dataclasses.replace(
      times, remat=costs, remat_choices=tuple(dict.fromkeys(policies)), temp_bytes=max(costs["full"].temp_bytes)
    )

  def _gather_ahead_gain(self, stage_params: list, batch: Any, reps: int = 3) -> tuple[float, float] | None:
    """``(own s, ahead s)``: the backward program of the block with the most sharded weights, gathering them itself,
    and given them whole while it gathers as many ahead (the next block's shapes: its own shards again), the
    fastest of ``reps`` runs each, alternately; ``None`` where no block (a stage between the first and the last)
    has sharded weights. Two programs of one stage, not two passes: the second way's other programs are compiled
    only where it is taken."""
    blocks = [i for i in range(1, len(self.stages) - 1) if gather_ahead.gather_targets(stage_params[i])]
    if not blocks:
      return None
    i = max(blocks, key=lambda i: gather_ahead.gathered_bytes(jax.tree.leaves(stage_params[i])))
    x = None
    for j in range(i):
      x, _ = self.forward(j, stage_params[j], x, batch)
    params = stage_params[i]
    y, saved = self.forward(i, params, x, batch)
    targets = gather_ahead.gather_targets(params)
    leaves = jax.tree.leaves(params)
    likes = [jax.ShapeDtypeStruct(leaves[j].shape, leaves[j].dtype, sharding=w) for j, w in targets]
    whole = tuple(partition.relaid([leaves[j] for j, _ in targets], likes))  # gathered on the devices
    none = (None,) * len(self.stages[i].groups)
    best = {False: float("inf"), True: float("inf")}
    for run in range(reps + 1):  # the first run of each compiles
      for ahead in (False, True):
        dy = jax.block_until_ready(jnp.ones_like(y))  # donated: a new one a run
        t = time.perf_counter()
        jax.block_until_ready(self.backward(i, params, x, batch, dy, none, False, saved,
                                            **(dict(gathered=whole, ahead=params) if ahead else {})))  # fmt: skip
        if run:
          best[ahead] = min(best[ahead], time.perf_counter() - t)
    return best[False], best[True]

  def _timed_pass(self, stage_params: list, batch: Any, ahead: bool) -> tuple[tuple, tuple, tuple]:
    """``(forward s, backward s, input bytes)`` per stage (forward order) of one pass on ``batch``, each program
    waited for; the backward programs gather the next stage's sharded weights ahead where ``ahead``."""
    n, fwd, bwd, xs, saved, x = len(self.stages), [], [], [], [], None
    for i in range(n):
      xs.append(x)
      t = time.perf_counter()
      if i < n - 1:
        x, kept_i = jax.block_until_ready(self.forward(i, stage_params[i], x, batch))
        saved.append(kept_i)
      fwd.append(time.perf_counter() - t)
    inputs = tuple(_device_bytes(a) for a in xs)
    sums: list[Any] = [None] * (1 + max(g for st in self.stages for g in st.groups))
    dy = None
    programs = schedule(n, 1, "stage")[n - 1 :]  # the backward programs, as the step runs them
    held = gather_ahead.HeldWeights(programs, [ahead and bool(gather_ahead.gather_targets(p)) for p in stage_params])
    for j, (_, i, _) in enumerate(programs):
      st, next_stage = self.stages[i], held.ahead(j)
      t = time.perf_counter()
      _, new, dy, _, *whole = jax.block_until_ready(self.backward(
        i, stage_params[i], xs[i], batch, dy, tuple(sums[g] for g in st.groups), True,
        saved[i] if i < n - 1 else None, gathered=held.mine(j),
        ahead=None if next_stage is None else stage_params[next_stage],
      ))  # fmt: skip
      held.ran(j, whole[0] if whole else None)
      bwd.append(time.perf_counter() - t)
      xs[i] = None
      if i < n - 1:
        saved[i] = None
      for g, s in zip(st.groups, new):
        sums[g] = s
    return tuple(fwd), tuple(reversed(bwd)), inputs

  def full_temp_bytes(self, groups: Sequence[Any], batch: Any) -> int:
    """The largest backward program's temporaries (per device) with every stage under ``"full"``, on ``batch``
    (one micro-batch): each distinct stage function's, at the first stage that uses it, and the last stage's
    (``memory_analysis()`` of the compiled programs, none run; 0 where the backend gives none). Under ``"full"`` a
    backward program recomputes its stage's forward pass, so its temporaries hold the forward program's."""
    groups = memory.committed(list(groups))
    n, xs, x = len(self.stages), [], None
    full = [dataclasses.replace(st, remat="full") for st in self.stages]
    for i in range(n - 1):
      xs.append(x)
      x, _ = forward_call(full[i], tuple(groups[g] for g in full[i].groups), x, batch, self.inputs(i))
    xs.append(x)
    first: dict[Any, int] = {}
    for i in range(n - 1):
      first.setdefault(full[i].fn, i)
    most = 0
    for i in (*first.values(), n - 1):
      st, params = full[i], tuple(groups[g] for g in full[i].groups)
      dy = None if i == n - 1 else jax.tree.map(jnp.ones_like, xs[i + 1])
      program, args = backward_call(st, (False,) * len(params), params, xs[i], batch, dy, (None,) * len(params),
                                     None, self.layouts(i, params), self.inputs(i))  # fmt: skip
      most = max(most, _temp_bytes(program, args))
    return most

  def remat_costs(
    self, groups: Sequence[Any], batch: Any, times: StageTimes, policies: Sequence[str]
  ) -> dict[str, RematCosts]:
    """What each stage costs under each of ``policies``, ``"full"`` and the stages' own, on one micro-batch.

    Each distinct stage function is measured once per policy, at the first
    stage that uses it (identical stages run identical programs): the
    forward and backward program's seconds (the second of two runs), the
    accelerator bytes the forward program saves (from its outputs' shapes)
    and the backward program's temporaries (``memory_analysis()`` of its
    compiled program, before it runs; 0 where the backend gives none). A
    stage's times are its own measured ones (``times``) plus the difference
    its function showed between the policy and the stage's own. The last
    stage has no forward program: every policy costs it what it costs now.
    """
    groups = memory.committed(list(groups))
    n, names = len(self.stages), tuple(dict.fromkeys(["full", *policies, *(st.remat for st in self.stages[:-1])]))
    xs, x = [], None
    for i in range(n - 1):
      xs.append(x)
      x, _ = self.forward(i, tuple(groups[g] for g in self.stages[i].groups), x, batch)
    first: dict[Any, int] = {}
    for i in range(n - 1):
      first.setdefault(self.stages[i].fn, i)
    layouts = {i: self.layouts(i, tuple(groups[g] for g in st.groups)) for i, st in enumerate(self.stages)}
    one = {(i, p): _measure_stage(dataclasses.replace(self.stages[i], remat=p), groups, xs[i], batch, layouts[i])
           for i in first.values() for p in names}  # fmt: skip
    last = self.stages[-1]
    last_params = tuple(groups[g] for g in last.groups)
    last_temp = _temp_bytes(*backward_call(last, (False,) * len(last.groups), last_params, x, batch, None,
                                            (None,) * len(last.groups), None, layouts[n - 1],
                                            self.inputs(n - 1)))  # fmt: skip
    costs = {}
    for p in names:
      rows = []
      for i, st in enumerate(self.stages[:-1]):
        mine, own = one[first[st.fn], p], one[first[st.fn], st.remat]
        rows.append((max(0.0, times.forward[i] + mine[0] - own[0]), max(0.0, times.backward[i] + mine[1] - own[1]),
                     mine[2], mine[3]))  # fmt: skip
      rows.append((times.forward[-1], times.backward[-1], 0, last_temp))
      costs[p] = RematCosts(*(tuple(column) for column in zip(*rows)))
    return costs


def _device_bytes(tree: Any) -> int:
  """Bytes one device holds of ``tree``'s arrays (their shards)."""
  return sum(memory.device_elements(a) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _temp_bytes(program: Callable, args: tuple) -> int:
  """The temporaries of ``program`` compiled for ``args`` (``memory_analysis()``; 0 where the backend gives none)."""
  stats = program.lower(*args).compile().memory_analysis()
  return 0 if stats is None else int(stats.temp_size_in_bytes)


def _measure_stage(st: Stage, groups: list, x: Any, batch: Any, layouts: tuple) -> tuple[float, float, int, int]:
  """``(forward s, backward s, saved bytes, backward temporaries)`` of one stage alone (the second of two runs)."""
  params, temp = tuple(groups[g] for g in st.groups), None
  inputs = None if st.inputs is None else st.inputs.at(0)
  for _ in range(2):
    t = time.perf_counter()
    y, saved = jax.block_until_ready(forward_call(st, params, x, batch, inputs))
    forward = time.perf_counter() - t
    program, args = backward_call(st, (False,) * len(params), params, x, batch, jnp.ones_like(y),
                                   (None,) * len(params), saved, layouts, inputs)  # fmt: skip
    temp = _temp_bytes(program, args) if temp is None else temp  # before the run donates dy
    t = time.perf_counter()
    jax.block_until_ready(program(*args))
    backward = time.perf_counter() - t
  return forward, backward, 0 if saved is None else saved.device_bytes(), temp
