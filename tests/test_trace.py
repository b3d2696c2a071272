"""jax_dos.trace: the engine's spans, recorded only on request."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dos
from jax_dos.planning import calibration


def _mixed_step():
  rng = np.random.default_rng()
  params = {f"w{i}": jnp.asarray(rng.standard_normal(256), jnp.float32) for i in range(4)}
  grads = jax.tree.map(lambda p: 1e-3 * p, params)
  tx = jax_dos.interleaved_adam(1e-3, subgroup_size=256, plan=["stream", "host", "stream", "host"])
  state = tx.init(params)
  return lambda: jax.block_until_ready(jax_dos.update_params(tx, grads, state, params))


def test_recording_collects_both_threads_spans():
  step = _mixed_step()
  with jax_dos.trace.recording() as spans:
    step()
  names = {s.name for s in spans}
  assert {"host.kernel", "host.send", "stream.dispatch", "wait.host"} <= names
  assert {s.thread for s in spans if s.name == "host.kernel"} == {"jax_dos-host"}
  assert all(s.end >= s.start for s in spans)
  totals = jax_dos.trace.totals(spans)
  assert totals["host.kernel"]["count"] == 2  # one kernel call per host subgroup
  assert totals["wall"]["seconds"] >= max(s.seconds for s in spans)
  assert "host.kernel" in jax_dos.trace.summary(spans)


def test_nothing_is_recorded_outside_a_recording():
  step = _mixed_step()
  with jax_dos.trace.recording() as spans:
    pass
  step()
  assert spans == []
  with jax_dos.trace.recording():
    with pytest.raises(RuntimeError, match="already active"):
      with jax_dos.trace.recording():
        pass


@pytest.mark.parametrize("size", [64, 1000, 8 * 2**20 + 3])
def test_calibration_subgroups_are_layer_shaped(size):
  sizes = calibration.layer_leaf_sizes(size)
  assert len(sizes) == 6 and sum(sizes) == size and min(sizes) >= 1
  assert sizes[4] >= sizes[1] >= sizes[2]  # MLP matrix >= qkv >= attention projection
