"""``delay=1, delay_predict="gradient"``: the host update hidden one step late, undelayed AdamW's trajectory kept.

Resuming from a checkpoint is tested with the other predictions in ``test_flush_and_delay.py``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import jit_traced, max_rel_diff, random_tree
from test_flush_and_delay import MIXED, make_grad_fn, quadratic_grads, reference

import jax_dos

TOL = 1e-6


def make_tx(plan=MIXED, warmup=2, **kwargs):
  return jax_dos.interleaved_adam(
    1e-2, weight_decay=0.1, subgroup_size=100, plan=plan, delay=1, delay_warmup=warmup, delay_predict="gradient",
    **kwargs,
  )  # fmt: skip


@pytest.mark.parametrize("call", ["update", "update_params", "jit"])
def test_the_trajectory_is_undelayed_adamw(call):
  """Gradients that depend on the parameters: every step's parameters are optax.adamw's, not the delayed recursion's."""
  rng = np.random.default_rng()
  params0 = random_tree(rng)
  warmup, steps = 2, 8
  tx = make_tx(warmup=warmup)
  targets = [random_tree(rng) for _ in range(steps)]
  expected, _, ref_state = reference(params0, quadratic_grads(targets), steps)  # undelayed optax.adamw
  placements = jax_dos.get_plan(tx, params0).leaf_placements()
  plain, _, _ = reference(params0, quadratic_grads(targets), steps, placements, warmup)

  params, state, grad_fn = params0, tx.init(params0), make_grad_fn(tx, params0)
  update = jit_traced(tx, tx.update) if call == "jit" else tx.update
  for t in range(steps):
    grads = grad_fn(params, targets[t])
    if call == "update_params":
      params, state = jax_dos.update_params(tx, grads, state, params)
    else:
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
    assert max_rel_diff(params, expected[t]) < TOL, f"step {t}"
  jax_dos.wait_for_host_updates()
  assert max_rel_diff(state.master, expected[-1]) < TOL
  assert max_rel_diff(state.mu, ref_state[0].mu) < TOL and max_rel_diff(state.nu, ref_state[0].nu) < TOL
  # The plain delay's trajectory is another one (the test can fail).
  assert max_rel_diff(params, plain[-1]) > 1e-3


def test_bfloat16_parameters_are_the_masters_up_to_the_copies_rounding():
  """bf16 copies of master, mu and nu: the weights handed on are cast(master) up to those copies' rounding.

  The accelerator steps from the old master rounded to bf16 (half a bf16 step of the old weight) with moments
  rounded to bf16, then rounds once more (a bf16 step of the new weight). The old first moment's rounding,
  2**-9 |b1 mu|, is a fraction of the update only where b1 mu and (1 - b1) g do not cancel; where they do, it
  moves the weight by up to lr 2**-9 b1 |mu| / (1 - b1**t) / (sqrt(nu_hat) + eps), which the bound adds.
  """
  rng = np.random.default_rng()
  params = random_tree(rng, dtype=jnp.bfloat16)
  grads = [random_tree(rng, dtype=jnp.bfloat16) for _ in range(6)]
  tx = make_tx(warmup=1)
  lr, b1, b2, eps = 1e-2, 0.9, 0.999, 1e-8
  ref = optax.adamw(lr, b1, b2, eps, weight_decay=0.1)
  masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state, ref_state = tx.init(params), ref.init(masters)
  flush = jax.jit(lambda g: g, out_shardings=jax_dos.gradient_shardings(tx, params))
  equal = total = 0
  for t, g in enumerate(grads, start=1):
    params, state = jax_dos.update_params(tx, flush(g), state, params)
    mu_old = ref_state[0].mu
    updates, ref_state = ref.update(jax.tree.map(lambda x: x.astype(jnp.float32), g), ref_state, masters)
    old, masters = masters, optax.apply_updates(masters, updates)
    trees = (params, old, masters, mu_old, ref_state[0].nu)
    for p, m0, m, mu, nu in zip(*(jax.tree.leaves(tree) for tree in trees)):
      got, want = np.asarray(p, np.float32), np.asarray(m.astype(jnp.bfloat16), np.float32)
      m0, m, mu, nu = (np.asarray(x, np.float64) for x in (m0, m, mu, nu))
      cancelled = lr * 2**-8 * b1 * np.abs(mu) / (1 - b1**t) / (np.sqrt(nu / (1 - b2**t)) + eps)
      bound = 2**-9 * np.abs(m0) + 2**-7 * np.abs(want) + 2**-7 * np.abs(m - m0) + cancelled
      assert np.all(np.abs(got - want) <= bound)
      equal, total = equal + int(np.sum(got == want)), total + got.size
  assert equal >= 0.9 * total, f"only {equal} of {total} weights equal cast(master)"
  jax_dos.wait_for_host_updates()
  assert max_rel_diff(state.master, masters) < TOL  # the host state is exact


def test_later_steps_use_the_copies_sent_ahead():
  """After the first delayed step the worker has sent the state ahead: update sends nothing itself."""
  rng = np.random.default_rng()
  params = random_tree(rng)
  tx = make_tx(warmup=0)
  state = tx.init(params)
  names = []
  for _ in range(3):
    with jax_dos.trace.recording() as spans:
      params, state = jax_dos.update_params(tx, random_tree(rng), state, params)
      jax_dos.wait_for_host_updates()
    names.append({s.name for s in spans})
  assert "device.send_ahead" in names[0]
  assert all("device.send_ahead" not in n and "host.send_ahead" in n and "device.step_ahead" in n for n in names[1:])


@pytest.mark.parametrize("room", ["first subgroup", "none"])
def test_copies_that_do_not_fit_ahead_cross_in_update(room):
  """A plan's ahead budget holds some host subgroups' copies (or none): the others are sent by update, same numbers."""
  rng = np.random.default_rng()
  params0 = random_tree(rng)
  plan = jax_dos.resolve_plan(MIXED, params0, 100)
  first = plan.subgroups[plan.indices("host")[0]]
  leaves = jax.tree.leaves(params0)
  budget = sum(3 * leaves[i].nbytes for i in first) if room == "first subgroup" else 0
  tx = make_tx(plan=dataclasses.replace(plan, ahead_budget_bytes=budget), warmup=0)
  targets = [random_tree(rng) for _ in range(4)]
  expected, _, _ = reference(params0, quadratic_grads(targets), len(targets))  # undelayed optax.adamw
  params, state, grad_fn = params0, tx.init(params0), make_grad_fn(tx, params0)
  for t in range(4):
    with jax_dos.trace.recording() as spans:
      params, state = jax_dos.update_params(tx, grad_fn(params, targets[t]), state, params)
      jax_dos.wait_for_host_updates()
    assert max_rel_diff(params, expected[t]) < TOL, f"step {t}"
    names = [s.name for s in spans]
    if t:  # the worker sent what fits ahead; update sent the rest
      assert names.count("host.send_ahead") == (room == "first subgroup")
      assert names.count("device.step_ahead") == (room == "first subgroup") and "device.send_ahead" in names


@pytest.mark.parametrize("value", ["gradients", 2, "Moments"])
def test_an_unknown_prediction_is_refused(value):
  with pytest.raises(ValueError, match="delay_predict must be"):
    jax_dos.interleaved_adam(1e-3, delay=1, delay_predict=value)
