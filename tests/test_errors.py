"""Bad input gets a clear error that says what to change."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import random_tree

import jax_dos
from jax_dos.memory import host_ram, pinned_pool


@pytest.fixture
def params():
  return random_tree(np.random.default_rng())


def test_non_float_leaf_is_named(params):
  bad = dict(params, step=jnp.zeros((), jnp.int32))
  with pytest.raises(TypeError, match=r"\['step'\].*int32"):
    jax_dos.interleaved_adam(1e-3).init(bad)


def test_gradient_tree_must_match_state(params):
  tx = jax_dos.interleaved_adam(1e-3, plan="host")
  state = tx.init(params)
  grads = dict(params)
  del grads["scale"]
  with pytest.raises(ValueError, match="gradient tree does not match"):
    tx.update(grads, state, params)


def test_gradient_shape_must_match(params):
  tx = jax_dos.interleaved_adam(1e-3, plan="host")
  state = tx.init(params)
  grads = dict(params, scale=jnp.ones((2,)))
  with pytest.raises(ValueError, match=r"\['scale'\] has shape \(2,\)"):
    tx.update(grads, state, params)


def test_update_needs_params(params):
  tx = jax_dos.interleaved_adam(1e-3)
  with pytest.raises(ValueError, match="needs params"):
    tx.update(params, tx.init(params))


def test_plan_of_wrong_length(params):
  with pytest.raises(ValueError, match="placements but the tree packs into"):
    jax_dos.interleaved_adam(1e-3, subgroup_size=1, plan=["host", "device"]).init(params)


@pytest.mark.parametrize("plan", ["gpu", ["host", "nvme", "host", "host"]])
def test_unknown_placement(params, plan):
  with pytest.raises(ValueError, match="unknown"):
    jax_dos.interleaved_adam(1e-3, subgroup_size=100, plan=plan).init(params)


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_subgroup_size_must_be_a_positive_integer(size):
  with pytest.raises(ValueError, match="subgroup_size must be an integer >= 1"):
    jax_dos.interleaved_adam(1e-3, subgroup_size=size)


@pytest.mark.parametrize("mode", ["yes", None, 1, "on"])
def test_partition_mode_must_be_auto_or_a_bool(mode):
  with pytest.raises(ValueError, match="partition_replicated must be 'auto'.*False"):
    jax_dos.interleaved_adam(1e-3, partition_replicated=mode)


def test_plan_for_another_tree_is_refused(params):
  other = jax_dos.resolve_plan("host", {"w": jnp.ones(3)}, 1)
  with pytest.raises(ValueError, match="covers 1 leaves"):
    jax_dos.interleaved_adam(1e-3, plan=other).init(params)


@pytest.mark.parametrize(
  "field, value, match",
  [("stream_slots", 0, "stream_slots must be >= 1"), ("ahead_budget_bytes", -1, "ahead_budget_bytes must be >= 0")],
)
def test_plan_budgets_must_be_sensible(params, field, value, match):
  plan = jax_dos.resolve_plan("host", params, 100)
  with pytest.raises(ValueError, match=match):
    jax_dos.Plan(plan.subgroups, plan.placements, plan.sizes, **{field: value})


def test_host_memory_request_that_cannot_be_met():
  huge = {"w": jax.ShapeDtypeStruct((host_ram.host_memory_total() // 4,), jnp.float32)}  # 3x the RAM
  with pytest.raises(MemoryError, match="does not fit this host's RAM"):  # refused by the plan, from shapes
    jax_dos.interleaved_adam(1e-3, plan="host").init(huge)


def test_host_memory_counts_every_process_on_this_host():
  one = host_ram.host_memory_total() // 2 + 1  # fits alone; two processes of it do not
  pinned_pool.check_host_capacity(one // 4)
  with pytest.raises(MemoryError, match="2 processes on this host together"):
    pinned_pool.check_host_capacity(one, on_host=(2 * one, 2))


def test_state_from_another_optimizer_is_refused(params):
  import optax

  with pytest.raises(TypeError, match="InterleavedAdamState"):
    jax_dos.interleaved_adam(1e-3).update(params, optax.adamw(1e-3).init(params), params)


def test_multi_steps_every_k_must_be_positive():
  with pytest.raises(ValueError, match="every_k"):
    jax_dos.multi_steps(jax_dos.interleaved_adam(1e-3), 0)


def test_state_beyond_xlas_pinned_pool_is_refused_with_the_variable_to_set(monkeypatch):
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the cap exists on GPU clients only
  monkeypatch.setenv(pinned_pool.POOL_LIMIT_ENV, "1")
  state = {"w": jax.ShapeDtypeStruct((2**28,), jnp.float32)}  # 3 GiB of state + 1 GiB of host gradients
  with pytest.raises(MemoryError, match=pinned_pool.POOL_LIMIT_ENV):
    jax_dos.interleaved_adam(1e-3, plan="host").init(state)


def test_host_bytes_count_the_prediction_buffers_of_float32_parameters():
  """delay_predict keeps a float32 copy per float32 host parameter (bfloat16 ones reuse the rounded copy)."""
  from jax_dos.optimizer.interleaved import host_state_bytes

  leaves = [jax.ShapeDtypeStruct((10,), jnp.float32), jax.ShapeDtypeStruct((6,), jnp.bfloat16)]
  plan = jax_dos.resolve_plan("host", {"a": leaves[0], "b": leaves[1]}, 100)
  assert host_state_bytes(plan, leaves) == 16 * 16
  assert host_state_bytes(plan, leaves, float32_copies=True) == 16 * 16 + 4 * 10
