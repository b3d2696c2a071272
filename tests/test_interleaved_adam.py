"""interleaved_adam matches optax.adamw for every placement, traced and eager."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SHAPES, jitted, max_rel_diff, random_tree, run_pair

import jax_dos

PLANS = {
  "device": "device",
  "stream": "stream",
  "host": "host",
  "mixed": ["host", "stream", "device", "host"],  # 4 subgroups at subgroup_size=100
}
TOL = 1e-6
STEPS = 20


def decay_mask(params):
  return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


SCENARIOS = {
  "constant_lr_masked_decay": (
    lambda tx_kw: jax_dos.interleaved_adam(1e-2, weight_decay=0.1, mask=decay_mask, **tx_kw),
    lambda: optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask),
  ),
  "schedule": (
    lambda tx_kw: jax_dos.interleaved_adam(
      optax.warmup_cosine_decay_schedule(0.0, 3e-2, 5, 20), b1=0.8, eps=1e-6, eps_root=1e-9, weight_decay=0.01, **tx_kw
    ),
    lambda: optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, 3e-2, 5, 20), b1=0.8, eps=1e-6, eps_root=1e-9, weight_decay=0.01
    ),
  ),
  "after_clip_in_chain": (
    lambda tx_kw: optax.chain(optax.clip_by_global_norm(1.0), jax_dos.interleaved_adamw(1e-2, **tx_kw)),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
  ),
  "multi_steps": (
    lambda tx_kw: jax_dos.multi_steps(jax_dos.interleaved_adam(1e-2, weight_decay=0.1, **tx_kw), 3),
    lambda: jitted(optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), 3)),
  ),
}


# Every placement with the main scenario; the mixed plan (all three placements at once) with the others.
CASES = [("constant_lr_masked_decay", plan) for plan in PLANS] + [(s, "mixed") for s in list(SCENARIOS)[1:]]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("scenario,plan", CASES)
def test_matches_optax(scenario, plan, jit):
  rng = np.random.default_rng()
  make_tx, make_ref = SCENARIOS[scenario]
  params = random_tree(rng)
  tx = make_tx(dict(subgroup_size=100, plan=PLANS[plan]))
  p, _, ref_p, _ = run_pair(tx, make_ref(), params, STEPS, rng, jit=jit)
  assert max_rel_diff(p, ref_p) <= TOL


def test_mixed_plan_really_mixes_memory_kinds():
  params = random_tree(np.random.default_rng())
  tx = jax_dos.interleaved_adam(1e-3, subgroup_size=100, plan=PLANS["mixed"])
  plan = jax_dos.get_plan(tx, params)
  assert set(plan.placements) == {"device", "stream", "host"}
  state = tx.init(params)
  kinds = [x.sharding.memory_kind for x in jax.tree.leaves(state.mu)]
  want = [{"device": "device"}.get(p, "pinned_host") for p in plan.leaf_placements()]
  assert kinds == want


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("plan", ["device", "stream", "host"])
def test_low_precision_params_follow_the_fp32_master(plan, jit):
  rng = np.random.default_rng()
  params32 = random_tree(rng)
  params16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params32)
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan=plan)
  ref = optax.adamw(1e-2, weight_decay=0.1)
  # The reference runs in fp32 from the same (bf16-rounded) start as the master.
  start = jax.tree.map(lambda x: x.astype(jnp.float32), params16)
  p, state, ref_p, _ = run_pair(tx, ref, params16, STEPS, rng, jit=jit, grad_dtype=jnp.bfloat16, ref_params=start)
  assert max_rel_diff(state.master, ref_p) <= TOL
  for leaf, master in zip(jax.tree.leaves(p), jax.tree.leaves(state.master)):
    assert leaf.dtype == jnp.bfloat16
    # Cast in numpy: arithmetic on pinned_host arrays is refused on GPUs.
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(master).astype(jnp.bfloat16))


@pytest.mark.parametrize("plan", ["device", "stream", "host"])
def test_state_lives_in_the_planned_memory_and_mirrors_params(plan):
  params = random_tree(np.random.default_rng())
  state = jax_dos.interleaved_adam(1e-3, plan=plan).init(params)
  kind = "device" if plan == "device" else "pinned_host"
  for tree in (state.master, state.mu, state.nu):
    assert jax.tree.structure(tree) == jax.tree.structure(params)
    assert all(x.sharding.memory_kind == kind and x.dtype == jnp.float32 for x in jax.tree.leaves(tree))
  assert state.count.dtype == jnp.int32 and int(state.count) == 0


def test_master_never_aliases_params():
  params = random_tree(np.random.default_rng())
  state = jax_dos.interleaved_adam(1e-3, plan="host").init(params)
  for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(state.master)):
    if p.size:
      assert p.unsafe_buffer_pointer() != m.unsafe_buffer_pointer()


def test_optax_multisteps_works_with_resident_state():
  rng = np.random.default_rng()
  params = random_tree(rng)
  tx = optax.MultiSteps(jax_dos.interleaved_adam(1e-2, plan="device"), 2)
  ref = jitted(optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.0), 2))
  p, _, ref_p, _ = run_pair(tx, ref, params, 6, rng, jit=False)
  assert max_rel_diff(p, ref_p) <= TOL


@pytest.mark.parametrize("plan", ["stream", "host"])
def test_non_finite_gradients_propagate_as_in_optax(plan):
  rng = np.random.default_rng()
  params = {"w": jnp.asarray(rng.standard_normal(6), jnp.float32)}
  grads = {"w": jnp.asarray([1.0, np.nan, np.inf, -np.inf, 0.5, 0.0], jnp.float32)}
  tx, ref = jax_dos.interleaved_adam(1e-2, plan=plan), optax.adamw(1e-2, weight_decay=0.0)
  u, _ = tx.update(grads, tx.init(params), params)
  ref_u, _ = ref.update(grads, ref.init(params), params)
  new, want = (np.asarray(optax.apply_updates(params, x)["w"]) for x in (u, ref_u))
  np.testing.assert_array_equal(np.isnan(new), np.isnan(want))
  finite = np.isfinite(want)
  np.testing.assert_allclose(new[finite], want[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("plan", ["host", "stream"])
def test_eager_update_consumes_offloaded_state_and_reuse_is_an_error(plan):
  rng = np.random.default_rng()
  params = random_tree(rng)
  tx = jax_dos.interleaved_adam(1e-2, plan=plan)
  state = tx.init(params)
  grads = random_tree(rng)
  _, new_state = tx.update(grads, state, params)
  if plan == "host":  # updated in place: the new state holds the same buffers
    assert all(a is b for a, b in zip(jax.tree.leaves(state.mu), jax.tree.leaves(new_state.mu)))
  else:  # the old buffers are released once copied (host memory holds one copy of the state), as donated ones are
    assert all(a.is_deleted() for a in jax.tree.leaves(state.master) if a.size)
    assert not any(a.is_deleted() for a in jax.tree.leaves(new_state.master))
  with pytest.raises(ValueError, match="already consumed"):
    tx.update(grads, state, params)
  tx.update(grads, new_state, params)  # the latest state is fine


def test_extra_args_are_accepted():
  params = random_tree(np.random.default_rng())
  tx = jax_dos.interleaved_adam(1e-3, plan="host")
  tx.update(params, tx.init(params), params, value=jnp.ones(()))


def test_plan_can_change_between_steps():
  """A state made for one plan is moved into the memory kinds of another (as after a restore)."""
  rng = np.random.default_rng()
  params = random_tree(rng)
  ref = optax.adamw(1e-2, weight_decay=0.0)
  host_tx = jax_dos.interleaved_adam(1e-2, plan="host")
  dev_tx = jax_dos.interleaved_adam(1e-2, plan="device")
  state, ref_state, p, ref_p = host_tx.init(params), ref.init(params), params, params
  for tx in (host_tx, dev_tx, host_tx):
    grads = random_tree(rng)
    u, state = tx.update(grads, state, p)
    p = optax.apply_updates(p, u)
    ref_u, ref_state = ref.update(grads, ref_state, ref_p)
    ref_p = optax.apply_updates(ref_p, ref_u)
  assert max_rel_diff(p, ref_p) <= TOL
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.mu)} == {"pinned_host"}


def test_shapes_fixture_has_scalars_and_empty_leaves():
  leaves = jax.tree.leaves(random_tree(np.random.default_rng(), SHAPES))
  assert any(x.ndim == 0 for x in leaves) and any(x.size == 0 for x in leaves)


@pytest.mark.parametrize("combine", ["chain", "multi_steps"])
def test_plan_and_gradient_shardings_are_found_inside_a_combination(combine):
  """get_plan and gradient_shardings find the interleaved_adam inside optax.chain or jax_dos.multi_steps."""
  params = random_tree(np.random.default_rng())
  adam = jax_dos.interleaved_adam(1e-2, subgroup_size=100, plan=PLANS["mixed"])
  if combine == "chain":
    tx = optax.chain(optax.clip_by_global_norm(1.0), adam)
  else:
    tx = jax_dos.multi_steps(adam, 2)
  assert isinstance(adam, optax.GradientTransformationExtraArgs) and adam.interleaved.plan_spec == PLANS["mixed"]
  for _ in range(2):  # twice: jax caches traces, the search must still find it
    assert jax_dos.get_plan(tx, params) == jax_dos.get_plan(adam, params)
  for flush in jax_dos.GRADIENT_FLUSHES:
    assert jax_dos.gradient_memory_kinds(tx, params, flush) == jax_dos.gradient_memory_kinds(adam, params, flush)
    assert jax_dos.gradient_shardings(tx, params, flush) == jax_dos.gradient_shardings(adam, params, flush)
  assert {s.memory_kind for s in jax.tree.leaves(jax_dos.gradient_shardings(tx, params))} == {"pinned_host", "device"}


def test_a_transformation_without_interleaved_adam_is_refused_clearly():
  params = random_tree(np.random.default_rng())
  with pytest.raises(TypeError, match="exactly one jax_dos.interleaved_adam"):
    jax_dos.get_plan(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), params)
