"""Facts about JAX offload on this machine that jax_dos relies on, checked on the GPU.

1. ``device_put(x, pinned_sharding, may_alias=False)`` of a ``pinned_host``
   array (the checkpoint's host copy) does not use accelerator memory;
2. whether ``optax.MultiSteps`` accepts ``pinned_host`` state on this jax
   (its ``jnp.where`` needs one memory space; ``jax_dos.multi_steps`` avoids it);
3. one eager step per placement and the traced (one-jit) step on a 256 Mi
   parameter tree, to sanity-check the engine before the full benchmark.

Writes ``$OUT/gpu_probes.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common

import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jax_dos  # noqa: E402


def main() -> None:
  out: dict = {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
  dev = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")

  # 1. host-to-host copy and accelerator memory
  x = jax.jit(lambda: jnp.ones((2**30,), jnp.float32), out_shardings=host)()  # 4 GiB
  x.block_until_ready()
  before = dev.memory_stats() or {}
  t = time.perf_counter()
  y = jax.device_put(x, host, may_alias=False).block_until_ready()
  dt = time.perf_counter() - t
  after = dev.memory_stats() or {}
  out["pinned_copy"] = {
    "GBps": 4 * 2**30 / dt / 1e9,
    "fresh_buffer": x.unsafe_buffer_pointer() != y.unsafe_buffer_pointer(),
    "device_peak_before": before.get("peak_bytes_in_use"),
    "device_peak_after": after.get("peak_bytes_in_use"),
    "memory_kind": y.sharding.memory_kind,
  }
  del x, y
  print("pinned copy", out["pinned_copy"], flush=True)

  # 2. optax.MultiSteps over offloaded state
  params = {"w": jnp.ones((64, 64)), "b": jnp.zeros((64,))}
  tx = optax.MultiSteps(jax_dos.interleaved_adam(1e-3, plan="host"), 2)
  try:
    s = tx.init(params)
    for _ in range(2):
      _, s = tx.update(params, s, params)
    out["optax_multisteps_host_state"] = "works"
  except Exception as e:  # recorded, not fatal: this is what the probe asks
    out["optax_multisteps_host_state"] = f"{type(e).__name__}: {str(e)[:200]}"
  print("optax.MultiSteps", out["optax_multisteps_host_state"], flush=True)

  # 3. eager engine per placement and the traced idiom, 256 Mi params in 8 leaves
  n_leaf = 32 * 2**20
  params = {f"l{i}": jnp.full((n_leaf,), 0.5, jnp.float32) for i in range(8)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  n = 8 * n_leaf
  rates = {}
  for plan in ("device", "stream", "host", "traced"):
    tx = jax_dos.interleaved_adam(1e-4, subgroup_size=n_leaf, plan="stream" if plan == "traced" else plan)
    box = [tx.init(params)]
    update = jax.jit(tx.update, donate_argnums=1) if plan == "traced" else tx.update

    def step(update=update, box=box):
      u, box[0] = update(grads, box[0], params)
      jax.block_until_ready((u, box[0]))

    rates[plan] = n / common.timed(step)["time_s"] / 1e9
    del box
    print(f"{plan:>7}: {rates[plan]:.2f} G params/s", flush=True)
  out["engine_Gps_256Mi"] = rates

  path = os.path.join(os.environ.get("OUT", "."), "gpu_probes.json")
  with open(path, "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
