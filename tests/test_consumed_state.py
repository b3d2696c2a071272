"""An eager update consumes its state (update_params also its params): reusing them is a clear error, any placement."""

import jax
import numpy as np
import pytest
from helpers import random_tree

import jax_dos

PLANS = ["device", "stream", "host", ["host", "device", "stream"]]


def _plan_for(plan, params, tx_kw):
  if isinstance(plan, str):
    return plan
  n = len(jax_dos.get_plan(jax_dos.interleaved_adam(1e-2, **tx_kw), params).placements)
  return (plan * n)[:n]


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_reusing_a_consumed_state_is_a_clear_error(plan):
  rng = np.random.default_rng()
  params = random_tree(rng)
  tx = jax_dos.interleaved_adam(1e-2, subgroup_size=64, plan=_plan_for(plan, params, {"subgroup_size": 64}))
  state = tx.init(params)
  _, new_state = tx.update(random_tree(rng), state, params)
  with pytest.raises(ValueError, match="already consumed by an earlier update.*Pass the state returned"):
    tx.update(random_tree(rng), state, params)
  updates, _ = tx.update(random_tree(rng), new_state, params)  # the latest state is fine
  assert all(np.isfinite(np.asarray(u)).all() for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("plan", PLANS, ids=str)
def test_reusing_params_consumed_by_update_params_is_a_clear_error(plan):
  rng = np.random.default_rng()
  params = random_tree(rng)
  tx = jax_dos.interleaved_adam(1e-2, subgroup_size=64, plan=_plan_for(plan, params, {"subgroup_size": 64}))
  new_params, state = jax_dos.update_params(tx, random_tree(rng), tx.init(params), params)
  with pytest.raises(ValueError, match="params were already consumed .* Pass the params it returned"):
    jax_dos.update_params(tx, random_tree(rng), state, params)
  jax_dos.update_params(tx, random_tree(rng), state, new_params)


def test_a_buffer_dying_inside_the_check_does_not_deadlock_it():
  """A state buffer whose last reference goes while the registry holds its lock (as in a collection that the
  check's own allocations trigger: its finalizer then runs in that thread): the check finishes, and the dead
  buffer's entry is dropped."""
  import concurrent.futures
  import threading

  from jax_dos.optimizer import engine

  registry = engine._WriteRegistry()
  holder = [jax.numpy.zeros(4)]
  dead = id(holder[0])
  registry.check_and_mark([holder[0]], 0)

  class DropsOnIteration(list):
    def __iter__(self):
      holder.clear()  # the registered buffer's last reference: its finalizer runs here, under the lock
      return super().__iter__()

  fresh = DropsOnIteration(jax.numpy.ones(4) for _ in range(3))
  checked = concurrent.futures.Future()
  threading.Thread(target=lambda: checked.set_result(registry.check_and_mark(fresh, 0)), daemon=True).start()
  checked.result(timeout=60)  # a deadlocked check times out here (a daemon thread: the run still ends)
  registry.check_and_mark(list(fresh), 1)  # drops what died
  assert dead not in registry._step and all(registry._step[id(a)] == 2 for a in fresh)
