"""Sharded parameters on 4 (fake) CPU devices: state per addressable shard, optax's numbers.

The device count must be set before jax starts, so the check runs in a fresh
interpreter with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, optax, sys
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    from helpers import max_rel_diff, run_pair
    import jax_dos

    assert len(jax.devices()) == 4
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng()
    specs = {"fsdp": P("data", "model"), "rows": P("data"), "replicated": P(), "vec": P("model")}
    shapes = {"fsdp": (8, 6), "rows": (4, 3), "replicated": (5,), "vec": (6,)}
    params = {k: jax.device_put(jnp.asarray(rng.standard_normal(shapes[k]), jnp.float32), NamedSharding(mesh, specs[k]))
              for k in shapes}
    for plan in ["device", "stream", "host", ["host", "stream", "device", "host"]]:
        for jit in (False, True):
            tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan=plan)
            p, state, ref_p, _ = run_pair(tx, optax.adamw(1e-2, weight_decay=0.1), params, 20, rng, jit=jit)
            err = max_rel_diff(p, ref_p)
            assert err <= 1e-6, (plan, jit, err)
            for k in shapes:
                m = state.master[k]
                assert m.sharding.is_equivalent_to(params[k].sharding.with_memory_kind(m.sharding.memory_kind), 2), k
                assert p[k].sharding.is_equivalent_to(params[k].sharding, 2), k
            print("ok", plan, "jit" if jit else "eager", err)
    # delay_predict="gradient": the copies sent ahead are per shard too; the weights handed on are optax's.
    for plan in ["host", ["host", "stream", "device", "host"]]:
        tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan=plan, delay=1, delay_warmup=2,
                                      delay_predict="gradient")
        p, state, ref_p, _ = run_pair(tx, optax.adamw(1e-2, weight_decay=0.1), params, 8, rng, jit=False)
        jax_dos.wait_for_host_updates()
        assert max_rel_diff(p, ref_p) <= 1e-6 and max_rel_diff(state.master, ref_p) <= 1e-6, plan
        assert all(p[k].sharding.is_equivalent_to(params[k].sharding, 2) for k in shapes)
        print("ok gradient prediction", plan)
    # Gradients laid out differently from the params (here: whole, on one device) are resharded, not misread.
    tx, ref = jax_dos.interleaved_adam(1e-2, plan="host"), optax.adamw(1e-2, weight_decay=0.0)
    grads = {k: jnp.asarray(rng.standard_normal(shapes[k]), jnp.float32) for k in shapes}
    u, _ = tx.update(grads, tx.init(params), params)
    laid_out = {k: jax.device_put(g, params[k].sharding) for k, g in grads.items()}
    ref_u, _ = ref.update(laid_out, ref.init(params), params)
    assert max_rel_diff(u, ref_u) <= 1e-6
    print("ok resharded grads")
    """
)


def test_sharded_params_match_optax():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  root = Path(__file__).resolve().parents[1]
  result = subprocess.run(
    [sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("ok ") == 11
