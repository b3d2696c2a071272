"""Sharded parameters on several devices, each keeping a whole copy of its shard's state (``partition_replicated=
False``; the default partitions replicated parameters' state, ``test_partition.py``), optax's numbers.

On 4 (fake) CPU devices in CI: the device count must be set before jax
starts, so the check runs in a fresh interpreter with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``. The same check runs
on real accelerators where there are at least two (skipped elsewhere), on a
2 x 2 mesh with four, and on 2 x 1 and 1 x 2 meshes with two. It also checks that the models' initialisation,
sharded, gives the unsharded values.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

SCRIPT = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, optax, sys
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    from helpers import max_rel_diff, run_pair
    import jax_dos

    devices = jax.devices()[:4] if len(jax.devices()) >= 4 else jax.devices()[:2]
    assert len(devices) in (2, 4), jax.devices()
    mesh_shape = (2, 2) if len(devices) == 4 else tuple(int(x) for x in sys.argv[1:3])
    mesh = jax.sharding.Mesh(np.array(devices).reshape(mesh_shape), ("data", "model"))
    print("mesh", mesh_shape, devices[0].platform)
    rng = np.random.default_rng()
    specs = {"fsdp": P("data", "model"), "rows": P("data"), "replicated": P(), "vec": P("model")}
    shapes = {"fsdp": (8, 6), "rows": (4, 3), "replicated": (5,), "vec": (6,)}
    params = {k: jax.device_put(jnp.asarray(rng.standard_normal(shapes[k]), jnp.float32), NamedSharding(mesh, specs[k]))
              for k in shapes}
    for plan in ["device", "stream", "host", ["host", "stream", "device", "host"]]:
        for jit in (False, True):
            tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan=plan,
                                          partition_replicated=False)  # a whole copy per shard
            p, state, ref_p, _ = run_pair(tx, optax.adamw(1e-2, weight_decay=0.1), params, 6, rng, jit=jit)
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
                                      delay_predict="gradient", partition_replicated=False)
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
    # The models' initialisation, sharded over every device (each computing its own shards, block by block), gives
    # the unsharded values.
    sys.path.insert(0, ".")
    from models import gpt, llama
    from train import parallel
    seed = int(rng.integers(2**31))
    for mod in (gpt, llama):
        cfg = mod.get_config("tiny")
        layout = parallel.param_shardings(parallel.make_mesh({"data": 2, "fsdp": len(jax.devices()) // 2}),
                                          mod.abstract_params(cfg))
        _, sharded = mod.init_params(cfg, seed=seed, shardings=layout)
        _, whole = mod.init_params(cfg, seed=seed)
        assert jax.tree.structure(sharded) == jax.tree.structure(whole)
        for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole)):
            assert len(a.sharding.device_set) == len(jax.devices()) and np.array_equal(np.asarray(a), np.asarray(b))
    print("ok sharded initialisation")
    """
)


ROOT = Path(__file__).resolve().parents[1]


def _run(env: dict | None, *args: str, host=None) -> str:
  """The script in ``host`` (an interpreter of 4 CPU devices) or in a fresh interpreter of ``env``."""
  if host is not None:
    result = host.run(SCRIPT, *args)
  else:
    result = subprocess.run(
      [sys.executable, "-c", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("ok ") == 12, result.stdout
  return result.stdout


def test_sharded_params_match_optax(four_devices):
  _run(None, host=four_devices)


def _accelerators() -> int:
  return 0 if jax.default_backend() == "cpu" else jax.device_count()  # this process's backend: the script's too


def test_sharded_params_match_optax_on_accelerators():
  n = _accelerators()
  if n < 2:
    pytest.skip("needs two or more accelerators (the CPU check above covers CI)")
  meshes = [("2", "2")] if n >= 4 else [("2", "1"), ("1", "2")]
  for mesh in meshes:
    assert "mesh" in _run(dict(os.environ), *mesh)
