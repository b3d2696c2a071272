"""The training script's overlapped step: the model's stages under ``jax_dos.OverlappedStep``, and when to use it.

The stages are the model's own modules (``jax_dos.nnx_stages``, built by the
model's ``staged(cfg)``): the embedding, one stage per block, the head.

``--overlap on`` trains with :class:`OverlappedTraining`: each ``step(batch)``
runs the forward and backward passes stage by stage and the AdamW update of
each stage's parameters as soon as the backward pass has produced their
gradients, under the rest of the backward pass and the next forward pass
(``jax_dos/overlap/step.py``). The numbers are the plain path's (optax's AdamW
after ``clip_by_global_norm``). Its :func:`plan` is made from the
parameters' shapes before any optimizer state exists; ``--overlap auto``, the
default, takes it where the timeline model predicts a shorter step than the
plain step's plan (``train.steps.choose``), and only then is its state
allocated, once, in its own placements. ``--overlap off`` never uses it.

Parameters and optimizer state stay in the model's own layout for evaluation
and checkpoints (:attr:`OverlappedTraining.params`, ``opt_state``): a
checkpoint does not depend on the path that wrote it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import optax

import jax_dos

if TYPE_CHECKING:  # train.flags imports this module
  from train.flags import Flags, TrainConfig

OVERLAP_MODES = ("auto", "on", "off")
REMAT_MODES = ("auto", *jax_dos.REMAT_POLICIES)


def refusal(args: Flags) -> str | None:
  """Why ``args`` cannot train with the overlapped step (``None`` if they can)."""
  if args.offload == "none":
    return "--offload none trains with optax.adamw on the accelerator: there is no offloaded update to overlap"
  if args.delay:
    return "--delay 1 is a mode of the plain path (its update runs a step late by design)"
  if args.write_behind:
    return "--write-behind is a mode of the plain path (the overlapped step already writes behind)"
  return None


def allow_overlap_on_gpu(args: Flags) -> None:
  """Turns off XLA's GPU command buffers (before jax starts) where the overlapped step may run."""
  if args.overlap != "off" and refusal(args) is None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    if jax_dos.NO_COMMAND_BUFFERS not in flags:
      os.environ["XLA_FLAGS"] = " ".join([*flags, jax_dos.NO_COMMAND_BUFFERS])


def _in_model_layout(staged: jax_dos.NNXStages, state: jax_dos.InterleavedAdamState) -> jax_dos.InterleavedAdamState:
  return jax_dos.InterleavedAdamState(state.count, *(staged.merge(t) for t in state[1:]))


def _in_groups(staged: jax_dos.NNXStages, state: jax_dos.InterleavedAdamState) -> jax_dos.InterleavedAdamState:
  return jax_dos.InterleavedAdamState(state.count, *(staged.split(t) for t in state[1:]))


def stages(staged: jax_dos.NNXStages, remat: str) -> list[jax_dos.Stage]:
  """The model's stages under ``--remat``: a policy on every stage but the last (the head, which has no forward
  program); ``auto`` leaves them ``full``, for the plan to choose (:func:`stage_times` measures the choices)."""
  made = list(staged.stages)
  if remat in ("auto", "full"):
    return made
  return [dataclasses.replace(st, remat=remat) for st in made[:-1]] + made[-1:]


def plan(
  args: TrainConfig, tx, staged: jax_dos.NNXStages, params: dict, times=None,
  collectives: jax_dos.Collectives | None = None, fired_share: float = 0.0,
) -> jax_dos.Plan:  # fmt: skip
  """The overlapped step's plan for the model's stages, from the parameters' shapes (no optimizer state exists);
  ``collectives``: the mesh's, which the timeline prices (``jax_dos.mesh_collectives``); ``fired_share``: the share
  of steps whose clip is expected to fire (``train.steps.fired_share``), for which the plan is made."""
  return jax_dos.overlapped_plan(
    tx, stages(staged, args.remat), staged.split(params), stage_times=times, micro_batches=args.grad_accum,
    collectives=collectives, fired_share=fired_share,
  )  # fmt: skip


def abstract_state(
  staged: jax_dos.NNXStages, step_plan: jax_dos.Plan, params: dict, moments: str = "float32"
) -> jax_dos.InterleavedAdamState:
  """The optimizer state's shapes in the plan's placements, in the model's layout: a template to restore into. A
  process of its own reads the offloaded leaves into ordinary host memory, which the step moves into its own pinned
  memory and gives back, leaf by leaf (``jax_dos.abstract_state``'s ``host_kind="auto"``): the resumed run holds the
  state once, as a fresh one does. Processes of a job read their shards into XLA's pinned pool."""
  return _in_model_layout(staged, jax_dos.abstract_state(step_plan, staged.split(params), moments, host_kind="auto"))


class OverlappedTraining:
  """``jax_dos.OverlappedStep`` over the model's stages, with parameters and state in the model's layout.

  ``staged`` is the model's stages (its ``staged(cfg)``), ``plan``
  :func:`plan`'s. ``opt_state``: a restored state (in the model's layout,
  best in the plan's placements: ``abstract_state``), or ``None`` for a
  fresh one, allocated once in the plan's placements. The step's pinned host
  memory stays within its default budget, a share of RAM: where it does not
  fit, a ``MemoryError`` before anything is allocated.
  """

  def __init__(
    self, args: TrainConfig, tx, staged: jax_dos.NNXStages, params: dict, step_plan: jax_dos.Plan,
    opt_state: jax_dos.InterleavedAdamState | None = None, stage_times=None,
  ):  # fmt: skip
    self.staged = staged
    self.step = jax_dos.OverlappedStep(
      tx,
      stages(staged, args.remat),
      staged.split(params),
      None if opt_state is None else _in_groups(staged, opt_state),
      clip_norm=args.clip or None,
      micro_batches=args.grad_accum,
      plan=step_plan,
      stage_times=stage_times,
      pinned_memory=args.pinned_memory,
    )

  def __call__(self, batch: Any) -> jax.Array:
    return self.step(batch)

  @property
  def grad_norm(self) -> jax.Array | None:
    """The last step's global norm of the mean gradient, before the clip."""
    return self.step.grad_norm

  def host_bytes(self) -> int:
    """Pinned host bytes the step needs at most (``jax_dos.OverlappedStep.host_bytes``)."""
    return self.step.host_bytes()

  def resident_estimate(self) -> int:
    """The process's resident set with the step's pinned memory (``jax_dos.OverlappedStep.resident_estimate``)."""
    return self.step.resident_estimate()

  def close(self) -> None:
    self.step.close()

  def settle(self) -> None:
    """Waits until the pending update has written the parameters and the whole state."""
    self.step.settle()

  @property
  def plan(self) -> jax_dos.Plan:
    return self.step.plan

  @property
  def params(self) -> dict:
    """The current parameters (waits for the pending update; the next step consumes them)."""
    return self.staged.merge(self.step.params)

  @property
  def opt_state(self) -> jax_dos.InterleavedAdamState:
    """The current optimizer state (waits for every pending write; the next step consumes it)."""
    return _in_model_layout(self.staged, self.step.opt_state)


def first_norm(
  staged: jax_dos.NNXStages, params: dict, micro: tuple, remat: str = "full", report: Callable[[str], None] = print
) -> float | None:  # fmt: skip
  """The global norm of one micro-batch's gradients at ``params``, computed by the stages' own programs (those
  :func:`stage_times` compiled): what the clip is first compared with (``train.steps.fired_share``). Where it cannot
  be computed, ``None`` and one line through ``report`` saying why: a run does not end for want of a prior."""
  try:
    model = jax_dos.StagedModel(stages(staged, remat), staged.num_groups)
    return float(optax.global_norm(model.loss_and_grads(staged.split(params), micro)[1]))  # as the plain step's
  except Exception as e:  # the choice falls back to the stated prior, and says so
    report(f"note: the first batch's gradient norm was not measured ({type(e).__name__}: {e}); the prior stands")
    return None


def stage_times(staged: jax_dos.NNXStages, params: dict, micro: tuple, remat: str = "full") -> jax_dos.StageTimes:
  """Each stage's measured forward and backward time on ``micro``, one micro-batch laid out as the step lays it out;
  with ``remat="auto"`` also each stage's costs under the policies the plan chooses among
  (``jax_dos.staged.remat.PLANNED_POLICIES``)."""
  model = jax_dos.StagedModel(stages(staged, remat), staged.num_groups)
  policies = jax_dos.PLANNED_REMAT_POLICIES if remat == "auto" else ()
  return model.measure_times(staged.split(params), micro, policies)
