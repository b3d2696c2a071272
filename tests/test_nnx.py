"""Flax NNX models with interleaved_adam: the gradient flush of an ``nnx.State``, ``nnx.Optimizer`` eagerly, and the
warning a traced update of offloaded state gives, each against optax.adamw on the same fresh gradients."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import max_rel_diff

import jax_dos

LR, WD, TOL = 1e-2, 0.1, 1e-6
MIXED = ["host", "device", "stream", "host"]  # subgroup_size=1: one subgroup per leaf of MLP below


class MLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(4, 8, rngs=rngs)
    self.l2 = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(jax.nn.gelu(self.l1(x)))


def copy_of(model):
  """A model with copies of ``model``'s arrays (``nnx.clone`` shares them, and an eager update may consume them)."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def loss_fn(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


def make_model(rng: np.random.Generator) -> MLP:
  return MLP(nnx.Rngs(int(rng.integers(2**31))))


def make_batch(rng: np.random.Generator):
  return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((5, 4), (5, 3)))


def make_tx(plan):
  return jax_dos.interleaved_adam(LR, weight_decay=WD, subgroup_size=1, plan=plan)


def no_variables(tree) -> bool:
  return not any(
    isinstance(x, nnx.Variable) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
  )


def kinds(tree):
  return [x.sharding.memory_kind for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("flush", jax_dos.GRADIENT_FLUSHES)
def test_gradient_shardings_of_an_nnx_state_are_plain(flush):
  rng = np.random.default_rng()
  state = nnx.state(make_model(rng), nnx.Param)
  tx = make_tx(MIXED)
  shardings = jax_dos.gradient_shardings(tx, state, flush)
  names = jax_dos.gradient_memory_kinds(tx, state, flush)
  assert isinstance(shardings, nnx.State) and no_variables(shardings) and no_variables(names)
  leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  assert len(leaves) == len(jax.tree.leaves(state))
  assert [s.memory_kind for s in leaves] == jax.tree.leaves(names)
  expected = [p == "host" or flush == "all" for p in jax_dos.get_plan(tx, state).leaf_placements()]
  assert [k == "pinned_host" for k in jax.tree.leaves(names)] == expected
  plain = jax_dos.gradient_shardings(tx, nnx.to_pure_dict(state), flush)  # a plain dict: the same shardings
  assert jax.tree.leaves(plain, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)) == leaves


def nnx_jit_grad_step(tx, model):
  shardings = jax_dos.gradient_shardings(tx, nnx.state(model, nnx.Param))
  return nnx.jit(nnx.value_and_grad(loss_fn), out_shardings=(None, shardings))


def split_jit_grad_step(tx, model):
  graphdef, params = nnx.split(model, nnx.Param)
  pure_loss = lambda p, x, y: loss_fn(nnx.merge(graphdef, p), x, y)  # noqa: E731
  step = jax.jit(jax.value_and_grad(pure_loss), out_shardings=(None, jax_dos.gradient_shardings(tx, params)))
  return lambda model, x, y: step(nnx.state(model, nnx.Param), x, y)


@pytest.mark.parametrize("make_step", [nnx_jit_grad_step, split_jit_grad_step], ids=["nnx.jit", "jax.jit"])
@pytest.mark.parametrize("plan", ["host", "mixed"])
def test_flushed_nnx_gradients_then_the_eager_update_equal_optax(make_step, plan):
  rng = np.random.default_rng()
  model = make_model(rng)
  tx, ref = make_tx(MIXED if plan == "mixed" else plan), optax.adamw(LR, weight_decay=WD)
  grad_step = make_step(tx, model)
  params = nnx.state(model, nnx.Param)
  ref_params = jax.tree.map(jnp.copy, nnx.to_pure_dict(params))
  opt_state, ref_state = tx.init(params), ref.init(ref_params)
  flushed = [k == "pinned_host" for k in jax.tree.leaves(jax_dos.gradient_memory_kinds(tx, params))]
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_dos.TracedUpdateWarning)  # the eager update is not traced
    for _ in range(4):
      x, y = make_batch(rng)
      _, grads = grad_step(model, x, y)
      assert [k == "pinned_host" for k in kinds(grads)] == flushed
      ref_grads = jax.tree.map(lambda g: jnp.asarray(np.asarray(g)), nnx.to_pure_dict(grads))
      params, opt_state = jax_dos.update_params(tx, grads, opt_state, nnx.state(model, nnx.Param))
      nnx.update(model, params)
      ref_updates, ref_state = ref.update(ref_grads, ref_state, ref_params)
      ref_params = optax.apply_updates(ref_params, ref_updates)
  assert isinstance(opt_state, jax_dos.InterleavedAdamState)
  assert max_rel_diff(nnx.to_pure_dict(nnx.state(model, nnx.Param)), ref_params) <= TOL


@pytest.mark.parametrize("plan", ["host", "mixed", "device"])
def test_nnx_optimizer_updates_eagerly_as_optax(plan):
  rng = np.random.default_rng()
  model = make_model(rng)
  ref_model = copy_of(model)
  tx = make_tx(MIXED if plan == "mixed" else plan)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  reference = nnx.Optimizer(ref_model, optax.adamw(LR, weight_decay=WD), wrt=nnx.Param)
  grad_fn = nnx.jit(nnx.grad(loss_fn))
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_dos.TracedUpdateWarning)
    for _ in range(4):
      x, y = make_batch(rng)
      grads = grad_fn(model, x, y)
      optimizer.update(model, grads)  # outside nnx.jit: the engine
      reference.update(ref_model, jax.tree.map(jnp.copy, grads))
  state = nnx.as_pure(optimizer.opt_state)
  assert isinstance(state, jax_dos.InterleavedAdamState) and int(state.count) == 4
  placements = jax_dos.get_plan(tx, nnx.state(model, nnx.Param)).leaf_placements()
  assert kinds(state.master) == ["device" if p == "device" else "pinned_host" for p in placements]
  ours, theirs = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(ref_model, nnx.Param))
  assert max_rel_diff(ours, theirs) <= TOL
  assert max_rel_diff(nnx.to_pure_dict(state.master), theirs) <= TOL


@pytest.mark.parametrize("plan", ["host", "stream", "device"])
def test_a_traced_update_of_offloaded_state_warns_once(plan):
  rng = np.random.default_rng()
  model = make_model(rng)
  ref_model = copy_of(model)
  optimizer = nnx.Optimizer(model, make_tx(plan), wrt=nnx.Param)
  reference = nnx.Optimizer(ref_model, optax.adamw(LR, weight_decay=WD), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    grads = nnx.grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # traced: the slow path
    return grads

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(3):
      x, y = make_batch(rng)
      if i == 2:  # another shape: traced again, said no more
        x, y = x[:3], y[:3]
      grads = train_step(model, optimizer, x, y)
      reference.update(ref_model, grads)
  said = [w for w in caught if issubclass(w.category, jax_dos.TracedUpdateWarning)]
  assert len(said) == (0 if plan == "device" else 1)
  if said:
    text = str(said[0].message)
    assert "outside jit" in text and "nnx.Optimizer.update outside nnx.jit" in text and "jax_dos.update_params" in text
  ours, theirs = nnx.to_pure_dict(nnx.state(model, nnx.Param)), nnx.to_pure_dict(nnx.state(ref_model, nnx.Param))
  assert max_rel_diff(ours, theirs) <= TOL  # slow, not wrong


def test_multi_steps_eager_skipped_calls_do_not_warn():
  rng = np.random.default_rng()
  params = nnx.to_pure_dict(nnx.state(make_model(rng), nnx.Param))
  tx, ref = jax_dos.multi_steps(make_tx("host"), 2), optax.MultiSteps(optax.adamw(LR, weight_decay=WD), 2)
  state, ref_state, ref_params = tx.init(params), ref.init(params), jax.tree.map(jnp.copy, params)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jax_dos.TracedUpdateWarning)
    for _ in range(4):
      grads = jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
      updates, state = tx.update(grads, state, params)
      params = optax.apply_updates(params, updates)
      ref_updates, ref_state = ref.update(grads, ref_state, ref_params)
      ref_params = optax.apply_updates(ref_params, ref_updates)
  assert max_rel_diff(params, ref_params) <= TOL


def test_nnx_optimizer_plans_once():
  """init sees ``nnx.Param`` s, update (through nnx.Optimizer) their plain arrays: one plan serves both."""
  rng = np.random.default_rng()
  model = make_model(rng)
  calls = []

  def planner(params, subgroup_size):
    calls.append(jax.tree.structure(params))
    return jax_dos.resolve_plan(MIXED, params, subgroup_size)

  tx = jax_dos.interleaved_adam(LR, weight_decay=WD, subgroup_size=1, planner=planner)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  for _ in range(2):
    x, y = make_batch(rng)
    optimizer.update(model, nnx.grad(loss_fn)(model, x, y))
  assert len(calls) == 1
