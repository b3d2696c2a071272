"""Shared test helpers: random parameter trees and comparison against optax."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

SHAPES = {
  "embed": (13, 8),
  "blocks": [{"w": (8, 8), "b": (8,)}, {"w": (8, 16), "b": (16,)}],
  "scale": (),
  "empty": (0, 3),
}


def random_tree(rng: np.random.Generator, shapes=SHAPES, dtype=jnp.float32, scale: float = 1.0):
  """A tree of ``shapes`` filled with fresh normal samples."""
  return jax.tree.map(
    lambda s: jnp.asarray(scale * rng.standard_normal(s), dtype), shapes, is_leaf=lambda s: isinstance(s, tuple)
  )


def max_rel_diff(a, b) -> float:
  """Max |a - b| over all leaves, relative to the largest |b| (at least 1)."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if np.size(x) == 0:
      continue
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    worst = max(worst, float(np.max(np.abs(x - y)) / max(1.0, float(np.max(np.abs(y))))))
  return worst


def run_pair(tx, ref, params, steps: int, rng: np.random.Generator, *, jit: bool, grad_dtype=None, ref_params=None):
  """Runs ``tx`` and the optax reference side by side on the same fresh gradients.

  Returns ``(params, state, ref_params, ref_state)``.
  """
  ref_params = params if ref_params is None else ref_params
  state, ref_state = tx.init(params), ref.init(ref_params)
  update = jax.jit(tx.update) if jit else tx.update
  for _ in range(steps):
    grads = random_tree(rng, jax.tree.map(jnp.shape, ref_params), dtype=grad_dtype or jnp.float32)
    grads = jax.tree.map(lambda g, p: jax.device_put(g, p.sharding), grads, ref_params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ref_updates, ref_state = ref.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, ref_updates)
  return params, state, ref_params, ref_state
