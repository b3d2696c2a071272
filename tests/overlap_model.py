"""The overlapped step's test model and its runs: a small staged network, the step on it, and the optax reference.

The model has a head tied to the first stage's weights, every gradient well away from zero (a GPT's key biases have
none mathematically, and Adam turns their rounding noise into whole steps, so two exact implementations part there
after a step). The reference (``reference_run``) gets the gradients of the same stage programs
(``StagedModel.loss_and_grads``) at its own parameters, summed over the micro-batches in the gradients' dtype and in
the step's order, then takes their mean, and runs ``optax.chain(clip_by_global_norm, adamw)`` on float32 masters.
The tests of ``test_overlap_*.py``, ``test_moments.py`` and the subprocesses they start import it from ``tests/``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import max_rel_diff

import jax_dos

D_IN, D_H, BLOCKS, ROWS = 6, 8, 3, 8
LR, WD, B1, B2 = 1e-2, 0.1, 0.9, 0.95
FIRES, NEVER = 1e-3, 1e6  # clip norms: one every step's gradient exceeds, one none does


def _embed(params, x, batch):
  (g,) = params
  return jnp.tanh(batch[0].astype(g["w"].dtype) @ g["w"] + g["b"])


def _block(params, x, batch):
  (g,) = params
  return x + jnp.tanh(x @ g["w"] + g["b"])


def _head(params, x, batch):
  head, embed = params
  out = (x * head["scale"]).astype(jnp.float32) @ embed["w"].astype(jnp.float32).T
  return jnp.mean((out - batch[1]) ** 2)


STAGES = [jax_dos.Stage(_embed, (0,)), *(jax_dos.Stage(_block, (1 + i,)) for i in range(BLOCKS))]
STAGES.append(jax_dos.Stage(_head, (BLOCKS + 1, 0)))


def make_groups(rng: np.random.Generator, dtype=jnp.float32) -> list:
  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0] if shape else 1), dtype)

  blocks = [{"b": normal(D_H), "w": normal(D_H, D_H)} for _ in range(BLOCKS)]
  return [{"b": normal(D_H), "w": normal(D_IN, D_H)}, *blocks, {"scale": 1 + normal(D_H)}]


def make_batch(rng: np.random.Generator) -> tuple[jax.Array, jax.Array]:
  return tuple(jnp.asarray(rng.standard_normal((ROWS, D_IN)), jnp.float32) for _ in range(2))


def reference_run(groups, batches, clip_norm, micro_batches, order="stage"):
  """``optax.chain(clip_by_global_norm, adamw)`` on float32 masters; returns ``(masters, optax state)``."""
  model = jax_dos.StagedModel(STAGES, len(groups))
  ref = optax.chain(
    optax.clip_by_global_norm(clip_norm) if clip_norm else optax.identity(),
    optax.adamw(LR, b1=B1, b2=B2, weight_decay=WD),
  )
  masters = jax.tree.map(lambda p: p.astype(jnp.float32), groups)
  state = ref.init(masters)
  for batch in batches:
    params = jax.tree.map(lambda m, p: m.astype(p.dtype), masters, groups)
    _, total = model.loss_and_grads(params, batch, micro_batches, order)  # the step's programs, in its order
    mean = jax.tree.map(lambda g: g.astype(jnp.float32) * jnp.float32(1 / micro_batches), total)
    updates, state = ref.update(mean, state, masters)
    masters = optax.apply_updates(masters, updates)
  return masters, state


def overlapped_run(groups, batches, clip_norm, micro_batches, plan, tx_kw=None, init=False, **step_kw):
  """The overlapped step on ``batches``: with a fresh state it makes itself (in its own pinned memory, the default),
  or with ``init`` from ``tx.init`` (in XLA's pool, where it then stays)."""
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan=plan, **(tx_kw or {}))
  step = jax_dos.OverlappedStep(
    tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups) if init else None, clip_norm=clip_norm,
    micro_batches=micro_batches, **step_kw,
  )  # fmt: skip
  losses = [float(step(batch)) for batch in batches]
  return step, losses


def adam_state(ref_state):
  return next(s for s in jax.tree.leaves(ref_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
              if isinstance(s, optax.ScaleByAdamState))  # fmt: skip


def check_against_reference(step, groups, batches, clip_norm, micro_batches, tol=1e-5):
  masters, ref_state = reference_run(groups, batches, clip_norm, micro_batches, step.micro_batch_order)
  state = step.opt_state
  assert int(state.count) == len(batches)
  adam = adam_state(ref_state)
  for ours, theirs in ((state.master, masters), (state.mu, adam.mu), (state.nu, adam.nu)):
    assert max_rel_diff(ours, theirs) < tol
  params = step.params
  for p, m, g in zip(jax.tree.leaves(params), jax.tree.leaves(state.master), jax.tree.leaves(groups)):
    assert p.dtype == g.dtype
    np.testing.assert_array_equal(np.asarray(p), np.asarray(m).astype(p.dtype))  # params are the masters, cast


MIXED = ["device", "host", "stream", "host", "device", "stream"] * 3


def _subgroup_count(groups) -> int:
  return len(jax_dos.planning.plan.partition_groups(groups, 40)[0])
