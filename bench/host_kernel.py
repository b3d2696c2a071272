"""Host kernel rate: jax_dos's fused numba AdamW against torch's fused CPU AdamW, per moment format.

Both run on the same buffers: ``pinned_host`` jax arrays (the ones the engine
updates), seen through writable numpy views (torch through ``from_numpy``), at
the same thread counts, in the same process. With ``--moments``, jax_dos's
kernel also runs on bfloat16 or int8 moments (``interleaved_adam(moments=...)``;
torch, float32 only, is skipped where it is not installed). Prints a table and
writes JSON to ``$OUT/host_kernel.json`` (or ``bench/results/``).

    python bench/host_kernel.py [--elements 268435456] [--threads 4 8 16] [--moments float32 bfloat16 int8]
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

from jax_dos.core import adam_math
from jax_dos.core import moment_formats as mf
from jax_dos.kernels import host_kernels
from jax_dos.planning.cost_model import kernel_bytes


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
  ap.add_argument("--moments", nargs="+", choices=mf.FORMATS, default=["float32"])
  args = ap.parse_args()

  try:
    import torch
  except ImportError:
    torch = None

  n = args.elements
  arrays = pinned_buffers(n, seed=0)
  g, p, m, v = (host_kernels.writable_view(a) for a in arrays)
  compact = {fmt: (mf.host_encode(m, fmt, 1.0, 0), mf.host_encode(v, fmt, 1.0, 1)) for fmt in args.moments}
  tg, tp, tm, tv = (torch.from_numpy(a) for a in (g, p, m, v)) if torch else (None,) * 4
  step = torch.tensor(11.0) if torch else None

  def ours(fmt):
    hyper = adam_math.AdamHyper(1e-3, moments=fmt)
    scalars = np.asarray(adam_math.step_scalars(hyper, jnp.asarray(10, jnp.int32)))
    mm, vv = (m, v) if fmt == "float32" else compact[fmt]
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.0, scalars=scalars)
    return lambda: host_kernels.adam_many([(g, p, mm, vv)], [False], **kw)

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
    row = dict(threads=threads)
    # Repeated runs feed on their own output: the same bytes move and the values stay finite.
    for fmt in args.moments:
      t = common.timed(ours(fmt), reps=args.repeats)["time_s"]  # warm-up compiles
      row[f"jax_dos_{fmt}_Gps"], row[f"jax_dos_{fmt}_s"] = n / t / 1e9, t
    if "float32" in args.moments:
      row["jax_dos_Gps"], row["jax_dos_s"] = row["jax_dos_float32_Gps"], row["jax_dos_float32_s"]
    if torch is not None:
      torch.set_num_threads(threads)
      t_torch = common.timed(torch_fused, reps=args.repeats)["time_s"]
      row.update(torch_Gps=n / t_torch / 1e9, torch_s=t_torch)
      if "jax_dos_s" in row:
        row["ratio"] = t_torch / row["jax_dos_s"]
    rows.append(row)
    rates = ", ".join(f"{fmt} {row[f'jax_dos_{fmt}_Gps']:.3f}" for fmt in args.moments)
    vs = f"; torch fused {row['torch_Gps']:.3f}" if torch is not None else ""
    print(f"threads {threads:3d}: jax_dos G params/s: {rates}{vs}", flush=True)

  result = dict(
    benchmark="host_kernel",
    elements=n,
    device=str(jax.devices()[0].device_kind),
    jax=jax.__version__,
    torch=getattr(torch, "__version__", None),
    moments=args.moments,
    cpus=os.cpu_count(),
    host=platform.node(),
    rows=rows,
    bytes_per_param={"torch": 28, **{f"jax_dos_{fmt}": kernel_bytes(fmt) for fmt in args.moments}},
    note="both read g, p, m, v and write p, m, v (28 B/param with float32 moments, 20 bfloat16, ~16 int8).",
  )
  out = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
  with open(os.path.join(out, "host_kernel.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
