"""Host kernel rate: jax_dos's fused numba AdamW against torch's fused CPU AdamW.

Both run on the same buffers: ``pinned_host`` jax arrays (the ones the engine
updates), seen through writable numpy views (torch through ``from_numpy``), at
the same thread counts, in the same process. Prints a table and writes JSON to
``$OUT/host_kernel.json`` (or ``bench/results/``).

    python bench/host_kernel.py [--elements 268435456] [--threads 4 8 16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import common
import jax
import jax.numpy as jnp
import numpy as np

from jax_dos import adam_math, host_kernels


def pinned_buffers(n: int, seed: int) -> list[jax.Array]:
  """g, p, m, v as pinned_host float32 arrays (v >= 0), filled with random data."""
  device = jax.devices()[0]
  host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  keys = jax.random.split(jax.random.key(seed), 4)
  make = jax.jit(lambda k, sign: sign * jax.random.normal(k, (n,), jnp.float32), out_shardings=host)
  g, p, m = (make(k, 1.0) for k in keys[:3])
  v = jax.jit(lambda k: jnp.abs(jax.random.normal(k, (n,), jnp.float32)), out_shardings=host)(keys[3])
  return [jax.block_until_ready(x) for x in (g, p, m, v)]


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--elements", type=int, default=256 * 2**20)
  ap.add_argument("--threads", type=int, nargs="+", default=[4, 8, os.cpu_count()])
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args()

  import torch

  n = args.elements
  arrays = pinned_buffers(n, seed=0)
  g, p, m, v = (host_kernels.writable_view(a) for a in arrays)
  hyper = adam_math.AdamHyper(1e-3)
  scalars = np.asarray(adam_math.step_scalars(hyper, jnp.asarray(10, jnp.int32)))
  tg, tp, tm, tv = (torch.from_numpy(a) for a in (g, p, m, v))
  step = torch.tensor(11.0)

  def ours_kernel_only():
    host_kernels.adam_inplace(
      g, p, m, v, b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0, decay=False, scalars=scalars
    )

  def torch_fused():
    torch._fused_adamw_(
      [tp],
      [tg],
      [tm],
      [tv],
      [],
      [step],
      lr=1e-3,
      beta1=0.9,
      beta2=0.999,
      weight_decay=0.0,
      eps=1e-8,
      amsgrad=False,
      maximize=False,
    )

  rows = []
  for threads in args.threads:
    host_kernels.set_num_threads(threads)
    torch.set_num_threads(threads)
    # Our kernel overwrites g with the update (which the engine sends to the GPU), so repeated runs feed
    # on their own output: the same bytes move and the values stay finite.
    t_ours = common.timed(ours_kernel_only, reps=args.repeats)["time_s"]  # warm-up compiles
    t_torch = common.timed(torch_fused, reps=args.repeats)["time_s"]
    rows.append(
      dict(
        threads=threads,
        jax_dos_Gps=n / t_ours / 1e9,
        torch_Gps=n / t_torch / 1e9,
        ratio=t_torch / t_ours,
        jax_dos_s=t_ours,
        torch_s=t_torch,
      )
    )
    print(
      f"threads {threads:3d}: jax_dos {rows[-1]['jax_dos_Gps']:.2f} G params/s, torch fused "
      f"{rows[-1]['torch_Gps']:.2f} G params/s, ratio {rows[-1]['ratio']:.3f}",
      flush=True,
    )

  result = dict(
    benchmark="host_kernel",
    elements=n,
    device=str(jax.devices()[0].device_kind),
    jax=jax.__version__,
    torch=torch.__version__,
    cpus=os.cpu_count(),
    host=platform.node(),
    rows=rows,
    bytes_per_param={"jax_dos": 28, "torch": 28},
    note="both read g, p, m, v and write p, m, v (28 B/param).",
  )
  out = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
  with open(os.path.join(out, "host_kernel.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
