"""``update(..., grad_scale=s)``: the gradients times ``s``; with ``clip_scale`` it is optax's global-norm clip."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import jit_traced, max_rel_diff, random_tree

import jax_dos

MIXED = ["host", "stream", "device", "host"]  # the helpers' tree packs into 4 subgroups at subgroup_size=100
TOL = 1e-6


def quadratic_loss(params, targets):
  return sum(jnp.sum((p - t) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(targets)))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("max_norm", [1.0, 1e6], ids=["clipping", "not-clipping"])
def test_clip_scale_matches_optax_clip_by_global_norm(jit, max_norm):
  """Raw gradients (flushed to the host where the plan says) plus ``clip_scale`` equal optax's chain."""
  rng = np.random.default_rng()
  params = ref_params = random_tree(rng)
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=100, plan=MIXED)
  ref = optax.chain(optax.clip_by_global_norm(max_norm), optax.adamw(1e-2, weight_decay=0.1))

  def grads_and_scale(params, targets):
    grads = jax.grad(quadratic_loss)(params, targets)
    return grads, jax_dos.clip_scale(optax.global_norm(grads), max_norm)

  grad_fn = jax.jit(grads_and_scale, out_shardings=(jax_dos.gradient_shardings(tx, params), None))
  update = jit_traced(tx, tx.update) if jit else tx.update
  state, ref_state = tx.init(params), ref.init(params)
  scales = []
  for _ in range(4):
    targets = random_tree(rng)
    grads, scale = grad_fn(params, targets)
    scales.append(float(scale))
    updates, state = update(grads, state, params, grad_scale=scale)
    params = optax.apply_updates(params, updates)
    ref_updates, ref_state = ref.update(jax.grad(quadratic_loss)(ref_params, targets), ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, ref_updates)
  assert (min(scales) < 0.5) if max_norm == 1.0 else (scales == [1.0] * 4)  # the clip really acted (or did not)
  assert max_rel_diff(params, ref_params) < TOL


@pytest.mark.parametrize("plan", ["host", "stream", "device"])
def test_grad_scale_is_a_gradient_multiplier_on_every_path(plan):
  rng = np.random.default_rng()
  params = random_tree(rng)
  grads = random_tree(rng)
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=100, plan=plan)
  ref = optax.adamw(1e-2, weight_decay=0.1)
  updates, _ = tx.update(grads, tx.init(params), params, grad_scale=jnp.float32(0.25))
  ref_updates, _ = ref.update(jax.tree.map(lambda g: g * 0.25, grads), ref.init(params), params)
  assert max_rel_diff(optax.apply_updates(params, updates), optax.apply_updates(params, ref_updates)) < TOL


@pytest.mark.parametrize("bad", [jnp.ones(2), {"a": 1.0}, "0.5", 1j])
def test_bad_grad_scale_is_refused_and_leaves_the_state_usable(bad):
  rng = np.random.default_rng()
  params = random_tree(rng)
  tx = jax_dos.interleaved_adam(1e-2, subgroup_size=100, plan="host")
  state = tx.init(params)
  with pytest.raises(ValueError, match="grad_scale must be a real scalar"):
    tx.update(params, state, params, grad_scale=bad)
  tx.update(params, state, params)  # not consumed


def test_clip_scale_follows_optax_rule():
  assert float(jax_dos.clip_scale(0.5, 1.0)) == 1.0
  assert float(jax_dos.clip_scale(1.0, 1.0)) == 1.0  # norm == max: optax divides (t / 1 * 1)
  assert float(jax_dos.clip_scale(4.0, 1.0)) == 0.25
