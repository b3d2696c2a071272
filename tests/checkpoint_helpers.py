"""Helpers of the checkpoint tests (``test_checkpoint.py``, ``test_checkpoint_integrity.py``): a small parameter
tree, its gradients, a few optimizer steps, and tree comparisons."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_dos

LR, WD = 1e-2, 0.1


def make_params(seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  return {
    "w": jax.random.normal(k[0], (8, 16), jnp.float32),
    "b": jax.random.normal(k[1], (16,), jnp.float32),
    "h": [jax.random.normal(k[2], (4, 4), jnp.float32)],
  }


def grads_for(params, step):
  keys = jax.random.split(jax.random.key(1000 + step), len(jax.tree.leaves(params)))
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(
    treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
  )


def train(tx, params, state, steps, start=0):
  for i in range(start, start + steps):
    updates, state = tx.update(grads_for(params, i), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def snapshot(tree):
  return jax.tree.map(lambda x: np.array(x), tree)


def assert_equal_trees(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_close_trees(a, b, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def kinds(tree):
  return [x.sharding.memory_kind for x in jax.tree.leaves(tree)]


def fresh(tx, seed=99):
  p = make_params(seed)  # different values: restore must overwrite everything
  return p, tx.init(p)


def fresh_tree(tx, like):
  p = jax.tree.map(lambda x: x + 1.0, like)  # different values: restore must overwrite everything
  return p, tx.init(p)


def interleaved(plan):
  return jax_dos.interleaved_adam(LR, weight_decay=WD, subgroup_size=1, plan=plan)
