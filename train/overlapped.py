"""The training script's overlapped step: the GPT as stages under ``jax_dos.OverlappedStep``, and when to use it.

``--overlap on`` trains with :class:`OverlappedTraining`: each ``step(batch)``
runs the forward and backward passes stage by stage and the AdamW update of
each stage's parameters as soon as the backward pass has produced their
gradients, under the rest of the backward pass and the next forward pass
(``jax_dos/overlap.py``). The numbers are the plain path's (optax's AdamW
after ``clip_by_global_norm``). ``--overlap auto``, the default, uses it on a
GPU when the timeline model predicts a shorter step than the plain path's
(:func:`predicted_faster`): measured at 6.7B on an H100, the overlapped step
beat the plain one with the clip silent and with it firing every step
(``docs/overlap.md``). ``--overlap off`` never uses it.

Parameters and optimizer state stay in the model's own layout for evaluation
and checkpoints (:attr:`OverlappedTraining.params`, ``opt_state``): a
checkpoint does not depend on the path that wrote it.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import jax

import jax_dos
from models import gpt as gpt_model

OVERLAP_MODES = ("auto", "on", "off")


def refusal(args: argparse.Namespace) -> str | None:
  """Why ``args`` cannot train with the overlapped step (``None`` if they can)."""
  if args.offload == "none":
    return "--offload none trains with optax.adamw on the accelerator: there is no offloaded update to overlap"
  if args.delay:
    return "--delay 1 is a mode of the plain path (its update runs a step late by design)"
  if args.write_behind:
    return "--write-behind is a mode of the plain path (the overlapped step already writes behind)"
  if getattr(args, "mesh", None) is not None:
    return "--mesh lays the model over several devices, and the overlapped step runs on one"
  return None


def allow_overlap_on_gpu(args: argparse.Namespace) -> None:
  """Turns off XLA's GPU command buffers (before jax starts) where the overlapped step may run."""
  if args.overlap != "off" and refusal(args) is None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    if jax_dos.NO_COMMAND_BUFFERS not in flags:
      os.environ["XLA_FLAGS"] = " ".join([*flags, jax_dos.NO_COMMAND_BUFFERS])


def _groups_state(state: jax_dos.InterleavedAdamState) -> jax_dos.InterleavedAdamState:
  return jax_dos.InterleavedAdamState(state.count, *(gpt_model.stage_groups(t) for t in state[1:]))


class OverlappedTraining:
  """``jax_dos.OverlappedStep`` over the GPT's stages, with parameters and state in the model's layout.

  ``stage_times`` (``jax_dos.StagedModel.measure_times``) lets ``--offload
  auto`` place subgroups by the step's timeline. The step's pinned host
  memory stays within its default budget, a share of RAM: where the state and
  the host path's buffers do not fit there, a ``MemoryError`` before anything
  moves.
  """

  def __init__(
    self, args: argparse.Namespace, tx, cfg: gpt_model.GPTConfig, params: dict, opt_state, stage_times=None,
  ):  # fmt: skip
    self.stages = gpt_model.make_stages(cfg)
    self.step = jax_dos.OverlappedStep(
      tx, self.stages, gpt_model.stage_groups(params), _groups_state(opt_state), clip_norm=args.clip or None,
      micro_batches=args.grad_accum, stage_times=stage_times,
    )  # fmt: skip

  def __call__(self, batch: Any) -> jax.Array:
    return self.step(batch)

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
    return gpt_model.from_stage_groups(self.step.params)

  @property
  def opt_state(self) -> jax_dos.InterleavedAdamState:
    """The current optimizer state (waits for every pending write; the next step consumes it)."""
    state = self.step.opt_state
    return jax_dos.InterleavedAdamState(state.count, *(gpt_model.from_stage_groups(t) for t in state[1:]))


def stage_times(cfg: gpt_model.GPTConfig, params: dict, batch: tuple, micro_batches: int) -> jax_dos.StageTimes:
  """Each stage's measured forward and backward time on one micro-batch of ``batch``."""
  rows = batch[0].shape[0] // micro_batches
  model = jax_dos.StagedModel(gpt_model.make_stages(cfg), cfg.n_layer + 2)
  return model.measure_times(gpt_model.stage_groups(params), tuple(x[:rows] for x in batch))


def predicted_faster(overlapped: jax_dos.Plan, plain: jax_dos.Plan | None) -> bool:
  """Whether the overlapped plan's predicted step beats the plain one's (forward/backward plus its update phase)."""
  if plain is None or "total" not in plain.predicted or "step" not in overlapped.predicted:
    return False
  compute = overlapped.predicted["step"] - overlapped.predicted["exposed"]
  return overlapped.predicted["step"] < compute + plain.predicted["total"]
