"""The training script's optimizer: AdamW from ``optax`` (``--offload none``) or ``jax_dos`` (the offload modes).

Both take ``update(grads, state, params, grad_scale=s)``, AdamW on ``s *
grads`` (the clip's factor); the training loop steps the ``jax_dos`` one with
``jax_dos.update_params`` (:func:`optimizer_step`).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

import jax_dos
from train.flags import TrainConfig
from train.schedule import Schedule


def decay_mask(params: Any) -> Any:
  """Weight decay on matrices and embeddings only (``ndim >= 2``), not on norms or biases."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


apply_updates = jax.jit(optax.apply_updates, donate_argnums=0)  # --offload none: the old parameters donated


def make_optimizer(
  args: TrainConfig, step_memory: jax_dos.StepMemory | None = None
) -> tuple[optax.GradientTransformation, Schedule]:
  """Returns ``(tx, schedule)``: AdamW (``optax.adamw`` for ``--offload none``, else ``jax_dos``).

  Both take ``update(grads, state, params, grad_scale=s)``: AdamW on ``s * grads`` (the clip's factor); the
  training loop calls ``jax_dos.update_params`` on the ``jax_dos`` one (see :func:`optimizer_step`).
  ``step_memory`` (the gradient step's needs) lets ``--offload auto`` size its
  budgets exactly where ``--resident-gb``/``--staging-gb`` are not given.
  """
  schedule = Schedule(args)
  kw = dict(b1=args.beta1, b2=args.beta2, eps=1e-8, weight_decay=args.weight_decay, mask=decay_mask)
  if args.offload == "none":  # pure: jit the whole update, donating the state.
    tx = optax.adamw(schedule, **kw)

    def update(grads, state, params, grad_scale):
      return tx.update(jax.tree.map(lambda g: g * grad_scale, grads), state, params)

    return optax.GradientTransformationExtraArgs(tx.init, jax.jit(update, donate_argnums=1)), schedule
  budgets = {"resident_budget_bytes": args.resident_gb, "staging_budget_bytes": args.staging_gb}
  if budgets["staging_budget_bytes"] is None and jax.default_backend() == "cpu":
    budgets["staging_budget_bytes"] = 0  # no accelerator to stream through: --offload auto streams nothing
  planner = jax_dos.auto_planner(
    **{k: int(v * 2**30) for k, v in budgets.items() if v is not None},
    step_memory=step_memory,
    params_in_place=True,
    ahead_copies=args.delay == 1 and args.delay_predict == "gradient",
    moments=args.moments,
  )
  offload = dict(subgroup_size=args.subgroup_size, plan=args.offload, delay=args.delay, delay_warmup=args.delay_warmup)
  if args.delay:
    offload["delay_predict"] = args.delay_predict or False
  if args.write_behind:
    offload["write_behind"] = True
  if args.moments != "float32":
    offload["moments"] = args.moments
  tx = jax_dos.interleaved_adam(schedule, **kw, **offload, planner=planner)
  return tx, schedule


def optimizer_step(args: TrainConfig, tx, grads, opt_state, params, scale) -> tuple[Any, Any]:
  """``(params, opt_state)`` after one AdamW step: ``jax_dos.update_params``, or optax's update and apply."""
  if args.offload == "none":
    updates, opt_state = tx.update(grads, opt_state, params, grad_scale=scale)
    return apply_updates(params, updates), opt_state
  return jax_dos.update_params(tx, grads, opt_state, params, grad_scale=scale)
