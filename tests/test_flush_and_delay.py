"""Gradient flush (host subgroups' gradients straight to pinned_host) and the one-step delayed update."""

import gc
import weakref
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import SHAPES, jit_traced, max_rel_diff, random_tree
from reference import adamw_prediction, adamw_trajectory

import jax_dos

MIXED = ["host", "stream", "device", "host"]  # the helpers' tree packs into 4 subgroups at subgroup_size=100
TOL = 1e-6
LR, WD = 1e-2, 0.1  # the references' optax.adamw


def quadratic_loss(params, targets):
  """A loss whose gradient depends on the parameters, so that a delay changes the trajectory."""
  return sum(
    jnp.sum((p.astype(jnp.float32) - t) ** 2) for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(targets))
  )


def reference(params, grads_at, steps, placements=(), warmup=0, predict=None):
  """``reference.py``'s recursion with ``optax.adamw(LR, weight_decay=WD)``: host leaves delayed from ``warmup``."""
  delayed = [p == "host" for p in placements] or False
  tx = optax.adamw(LR, weight_decay=WD)
  return adamw_trajectory(params, grads_at, steps, tx=tx, delayed=delayed, warmup=warmup, predict=predict)


def quadratic_grads(targets_per_step):
  """Step ``t``'s gradients of :func:`quadratic_loss` at the parameters handed on."""
  return lambda t, params: jax.grad(quadratic_loss)(params, targets_per_step[t])


def given_grads(grads_per_step):
  """Step ``t``'s gradients, given in advance."""
  return lambda t, params: grads_per_step[t]


def make_grad_fn(tx, params, flush="host"):
  """A jitted gradient function whose out_shardings flush gradients to pinned_host (host subgroups', or all)."""
  return jax.jit(jax.grad(quadratic_loss), out_shardings=jax_dos.gradient_shardings(tx, params, flush))


@pytest.mark.parametrize("flush, jit", [("host", False), ("all", False), ("all", True)])
def test_flushed_gradients_land_in_pinned_host_and_match_optax(flush, jit):
  rng = np.random.default_rng()
  params = random_tree(rng)
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=100, plan=MIXED)
  ref = optax.adamw(1e-2, weight_decay=0.1)
  state, ref_state, ref_params = tx.init(params), ref.init(params), params
  grad_fn = make_grad_fn(tx, params, flush)
  update = jit_traced(tx, tx.update) if jit else tx.update
  kinds = jax.tree.leaves(jax_dos.gradient_memory_kinds(tx, params, flush))
  placements = jax_dos.get_plan(tx, params).leaf_placements()
  sizes = [np.size(x) for x in jax.tree.leaves(params)]
  flushed = ("host", "stream", "device") if flush == "all" else ("host",)
  assert kinds == ["pinned_host" if p in flushed and n else "device" for p, n in zip(placements, sizes)]
  assert {k for k, n in zip(kinds, sizes) if n} == ({"pinned_host"} if flush == "all" else {"pinned_host", "device"})
  for _ in range(5):
    targets = random_tree(rng)
    grads = grad_fn(params, targets)
    assert [g.sharding.memory_kind for g in jax.tree.leaves(grads)] == kinds
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    ref_updates, ref_state = ref.update(jax.grad(quadratic_loss)(ref_params, targets), ref_state, ref_params)
    ref_params = optax.apply_updates(ref_params, ref_updates)
  assert max_rel_diff(params, ref_params) < TOL


def test_an_unknown_flush_is_refused():
  params = random_tree(np.random.default_rng())
  tx = jax_dos.interleaved_adam(1e-2, subgroup_size=100, plan=MIXED)
  with pytest.raises(ValueError, match="flush must be one of"):
    jax_dos.gradient_shardings(tx, params, flush="device")


def test_bfloat16_gradients_on_the_host_match_optax_on_their_float32_values():
  rng = np.random.default_rng()
  params = random_tree(rng, dtype=jnp.bfloat16)
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=100, plan=MIXED)
  ref = optax.adamw(1e-2, weight_decay=0.1)
  masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state, ref_state = tx.init(params), ref.init(masters)
  flush = jax.jit(lambda g: g, out_shardings=jax_dos.gradient_shardings(tx, params))
  for _ in range(5):
    grads = flush(random_tree(rng, dtype=jnp.bfloat16))
    host = [g for g in jax.tree.leaves(grads) if g.sharding.memory_kind == "pinned_host"]
    assert host and {g.dtype for g in host} == {np.dtype(jnp.bfloat16)}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    wide = jax.tree.map(lambda g: jax.device_put(g, g.sharding.with_memory_kind("device")).astype(jnp.float32), grads)
    ref_updates, ref_state = ref.update(wide, ref_state, masters)
    masters = optax.apply_updates(masters, ref_updates)
  assert max_rel_diff(state.master, masters) < TOL


def test_gradients_the_host_kernel_cannot_read_are_refused():
  rng = np.random.default_rng()
  params = random_tree(rng, dtype=jnp.float16)
  tx = jax_dos.interleaved_adam(1e-2, subgroup_size=100, plan="host")
  state = tx.init(params)
  grads = jax.tree.map(lambda g: jax.device_put(g, g.sharding.with_memory_kind("pinned_host")), params)
  with pytest.raises(TypeError, match="float32 or bfloat16"):
    tx.update(grads, state, params)
  updates, _ = tx.update(params, state, params)  # the refused call left the state usable
  assert jax.tree.structure(updates) == jax.tree.structure(params)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_delay_one_semantics(jit):
  """Host subgroups' parameters at step t+1 are those of step t-1; the first ``delay_warmup`` steps are normal."""
  rng = np.random.default_rng()
  params0 = random_tree(rng)
  warmup, steps = 3, 8
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=100, plan=MIXED, delay=1, delay_warmup=warmup)
  placements = jax_dos.get_plan(tx, params0).leaf_placements()
  targets = [random_tree(rng) for _ in range(steps)]
  expected, expected_masters, _ = reference(params0, quadratic_grads(targets), steps, placements, warmup)
  normal, _, _ = reference(params0, quadratic_grads(targets), steps, placements, warmup=steps)

  params, state = params0, tx.init(params0)
  grad_fn = make_grad_fn(tx, params0)
  update = jit_traced(tx, tx.update) if jit else tx.update
  for t in range(steps):
    updates, state = update(grad_fn(params, targets[t]), state, params)
    params = optax.apply_updates(params, updates)
    assert max_rel_diff(params, expected[t]) < TOL, f"step {t}"
    if t < warmup:
      assert max_rel_diff(params, normal[t]) < TOL, f"warm-up step {t} was delayed"
  jax_dos.wait_for_host_updates()
  assert max_rel_diff(state.master, expected_masters) < TOL
  # From the warm-up on, the delay really changes host leaves (the test can fail).
  host = [i for i, p in enumerate(placements) if p == "host" and np.size(jax.tree.leaves(params)[i])]
  assert max(max_rel_diff(jax.tree.leaves(params)[i], jax.tree.leaves(normal[-1])[i]) for i in host) > 1e-4


def test_delayed_state_is_complete_when_checkpointed(tmp_path):
  """Saving right after a delayed update checkpoints the finished host state, not a half-written one."""
  rng = np.random.default_rng()
  params = random_tree(rng, {k: v for k, v in SHAPES.items() if k != "empty"})  # Orbax refuses zero-size arrays
  targets = [random_tree(rng, jax.tree.map(jnp.shape, params)) for _ in range(3)]
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=100, plan="host", delay=1, delay_warmup=0)
  host = ("host",) * len(jax.tree.leaves(params))
  _, expected_masters, _ = reference(params, quadratic_grads(targets), len(targets), host, warmup=0)
  state = tx.init(params)
  for t in targets:
    updates, state = tx.update(jax.grad(quadratic_loss)(params, t), state, params)
    params = optax.apply_updates(params, updates)
  with jax_dos.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(3, params=params, opt_state=state)  # must wait for the delayed host update
    mgr.wait_until_finished()
    _, restored, _ = mgr.restore(3, params=params, opt_state=tx.init(params))
  assert max_rel_diff(restored.master, expected_masters) < TOL
  assert int(restored.count) == 3


@pytest.mark.parametrize("kwargs,match", [(dict(delay=2), "delay must be"), (dict(delay_warmup=-1), "delay_warmup")])
def test_bad_delay_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jax_dos.interleaved_adam(1e-3, **kwargs)


def test_auto_plan_with_delay_streams_nothing():
  params = random_tree(np.random.default_rng())
  streaming = lambda params, size: jax_dos.resolve_plan(MIXED, params, size)  # noqa: E731  (a planner's answer)
  plain = jax_dos.interleaved_adam(1e-3, subgroup_size=100, planner=streaming)
  delayed = jax_dos.interleaved_adam(1e-3, subgroup_size=100, planner=streaming, delay=1)
  assert jax_dos.get_plan(plain, params).placements == tuple(MIXED)
  assert jax_dos.get_plan(delayed, params).placements == ("host", "host", "device", "host")


@pytest.mark.parametrize("delay", [0, 1])
def test_the_engine_keeps_no_reference_to_what_it_returns(delay):
  """Returned updates are the caller's alone: held across steps they cost 4 B/param of accelerator memory."""
  rng = np.random.default_rng()
  params = random_tree(rng)
  tx = jax_dos.interleaved_adam(1e-2, subgroup_size=100, plan=MIXED, delay=delay, delay_warmup=0)
  state = tx.init(params)
  for _ in range(2):
    updates, state = tx.update(random_tree(rng), state, params)
    params = optax.apply_updates(params, updates)
  refs = [weakref.ref(u) for u in jax.tree.leaves(updates)]
  del updates
  jax_dos.wait_for_host_updates()
  gc.collect()
  assert [r() for r in refs] == [None] * len(refs)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_delayed_bfloat16_parameters_are_the_previous_masters_rounded(jit):
  """bf16 params land exactly on the masters rounded to bf16: those before the step for delayed host subgroups."""
  rng = np.random.default_rng()
  params = random_tree(rng, dtype=jnp.bfloat16)
  warmup, steps = 2, 6
  tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=100, plan=MIXED, delay=1, delay_warmup=warmup)
  ref = optax.adamw(1e-2, weight_decay=0.1)
  placements = jax_dos.get_plan(tx, params).leaf_placements()
  masters = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  state, ref_state = tx.init(params), ref.init(masters)
  flush = jax.jit(lambda g: g, out_shardings=jax_dos.gradient_shardings(tx, params))
  update = jit_traced(tx, tx.update) if jit else tx.update
  history = [[np.array(x) for x in jax.tree.leaves(masters)]]
  for t in range(steps):
    grads = random_tree(rng, dtype=jnp.bfloat16)
    updates, state = update(flush(grads), state, params)
    params = optax.apply_updates(params, updates)
    jax_dos.wait_for_host_updates()
    history.append([np.array(x) for x in jax.tree.leaves(state.master)])
    for i, (p, placement) in enumerate(zip(jax.tree.leaves(params), placements)):
      source = history[t] if placement == "host" and t >= warmup else history[t + 1]
      want = np.asarray(jnp.asarray(source[i]).astype(jnp.bfloat16))
      np.testing.assert_array_equal(np.asarray(p).astype(np.float32), want.astype(np.float32), f"step {t} leaf {i}")
    ref_updates, ref_state = ref.update(jax.tree.map(lambda g: g.astype(jnp.float32), grads), ref_state, masters)
    masters = optax.apply_updates(masters, ref_updates)
  assert max_rel_diff(state.master, masters) < TOL


def test_a_delayed_engine_handed_another_state_starts_from_its_masters():
  """With no warm-up the first update is already delayed: the engine's bf16 copies must come from this state."""
  rng = np.random.default_rng()
  params0 = random_tree(rng, dtype=jnp.bfloat16)
  grads = [random_tree(rng, dtype=jnp.bfloat16) for _ in range(3)]

  def run(tx, params):
    state, history = tx.init(params), []
    for g in grads:
      updates, state = tx.update(g, state, params)
      params = optax.apply_updates(params, updates)
      history.append(params)
    jax_dos.wait_for_host_updates()
    return history

  def make():
    return jax_dos.interleaved_adam(1e-2, subgroup_size=100, plan="host", delay=1, delay_warmup=0)

  used = make()
  run(used, random_tree(rng, dtype=jnp.bfloat16))  # another run first: its copies are stale for the next
  got, fresh = run(used, params0), run(make(), params0)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(fresh)):
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))
  # The first delayed step takes the parameters to the masters before it: the initial ones.
  for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(params0)):
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_delay_predict_hands_on_the_predicted_step(jit, dtype):
  """With delay_predict, host leaves get the prediction of their masters; masters and moments stay exact."""
  rng = np.random.default_rng()
  params = random_tree(rng, dtype=dtype)
  warmup, steps = 2, 6
  tx = jax_dos.interleaved_adam(
    1e-2, weight_decay=0.1, subgroup_size=100, plan=MIXED, delay=1, delay_warmup=warmup, delay_predict=True
  )
  placements = jax_dos.get_plan(tx, params).leaf_placements()
  grads = [random_tree(rng, dtype=dtype) for _ in range(steps)]
  predict = adamw_prediction(LR, weight_decay=WD)
  expected, expected_masters, _ = reference(params, given_grads(grads), steps, placements, warmup, predict)
  plain, _, _ = reference(params, given_grads(grads), steps, placements, warmup)
  state = tx.init(params)
  flush = jax.jit(lambda g: g, out_shardings=jax_dos.gradient_shardings(tx, params))
  step = jit_traced(tx, partial(jax_dos.update_params, tx)) if jit else partial(jax_dos.update_params, tx)
  for t in range(steps):
    params, state = step(flush(grads[t]), state, params)
    # bf16: a float32 rounding difference may flip the last bit of a rounded weight; allow one bf16 ulp.
    tol = TOL if dtype == jnp.float32 else 2**-7
    assert max_rel_diff(params, expected[t]) <= tol, f"step {t}"
  jax_dos.wait_for_host_updates()
  assert max_rel_diff(state.master, expected_masters) < TOL
  # The prediction differs from the plain delay's stale weights (the test can fail).
  host = [i for i, p in enumerate(placements) if p == "host" and np.size(jax.tree.leaves(params)[i])]
  assert max(max_rel_diff(jax.tree.leaves(params)[i], jax.tree.leaves(plain[-1])[i]) for i in host) > 1e-3


@pytest.mark.parametrize("predict", [True, "gradient"], ids=["moments", "gradient"])
def test_delay_predict_resumes_bit_exactly_from_a_checkpoint(tmp_path, predict):
  """A new engine on a restored state hands on exactly what the running engine would have.

  It has written no copies for that state: it makes them in its first update (for "gradient", sending them then).
  """
  rng = np.random.default_rng()
  shapes = {k: v for k, v in SHAPES.items() if k != "empty"}  # Orbax refuses zero-size arrays
  params0 = random_tree(rng, shapes, dtype=jnp.bfloat16)
  grads = [random_tree(rng, shapes, dtype=jnp.bfloat16) for _ in range(4)]

  def make():
    return jax_dos.interleaved_adam(
      1e-2, subgroup_size=100, plan="host", delay=1, delay_warmup=0, delay_predict=predict
    )

  def steps(tx, params, state, gs, history):
    for g in gs:
      params, state = jax_dos.update_params(tx, g, state, params)
      history.append([np.asarray(x).astype(np.float32) for x in jax.tree.leaves(params)])
    return params, state

  tx, straight, resumed = make(), [], []
  steps(tx, jax.tree.map(jnp.copy, params0), tx.init(params0), grads, straight)
  tx_a = make()
  params, state = steps(tx_a, jax.tree.map(jnp.copy, params0), tx_a.init(params0), grads[:2], resumed)
  with jax_dos.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(2, params=params, opt_state=state)
    mgr.wait_until_finished()
    tx_b = make()
    params, state, _ = mgr.restore(2, params=params, opt_state=tx_b.init(params))
  with jax_dos.trace.recording() as spans:
    params, state = steps(tx_b, params, state, grads[2:3], resumed)
  assert ("device.send_ahead" in {s.name for s in spans}) == (predict == "gradient")
  steps(tx_b, params, state, grads[3:], resumed)
  jax_dos.wait_for_host_updates()
  for t, (a, b) in enumerate(zip(resumed, straight)):
    for x, y in zip(a, b):
      np.testing.assert_array_equal(x, y, f"step {t}")


def test_delay_predict_needs_delay():
  with pytest.raises(ValueError, match="needs delay=1"):
    jax_dos.interleaved_adam(1e-3, delay_predict=True)
