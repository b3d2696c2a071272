"""How the eager engine's rate depends on the host/stream split and on stream slots.

One fp32 tree of ``--leaves`` leaves of ``--leaf`` elements (one subgroup each);
every plan with ``k`` streamed subgroups (the rest on the host) for the given
``k`` and slot counts, plus the traced one-jit idiom. Tells whether host kernel
and streaming add up on this machine when run by the real engine. Writes
``$OUT/engine_sweep.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import common
import jax
import jax.numpy as jnp

import jax_dos


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--leaves", type=int, default=8)
  ap.add_argument("--leaf", type=int, default=64 * 2**20)
  ap.add_argument("--streamed", default="0,2,4,5,6,8")
  ap.add_argument("--slots", default="1,2,3,4")
  ap.add_argument("--reps", type=int, default=3)
  args = ap.parse_args()

  params = {f"l{i:02d}": jnp.full((args.leaf,), 0.5, jnp.float32) for i in range(args.leaves)}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
  n = args.leaves * args.leaf
  base = jax_dos.resolve_plan("host", params, args.leaf)
  rows = []

  def measure(name, tx, jit=False, **extra):
    box = [tx.init(params)]
    # Donating pinned_host state aborts jax 0.10.2's CPU client; the GPU client takes it.
    donate = 1 if jax.default_backend() != "cpu" else ()
    update = jax.jit(tx.update, donate_argnums=donate) if jit else tx.update

    def step():
      u, box[0] = update(grads, box[0], params)
      jax.block_until_ready((u, box[0]))

    t = common.timed(step, reps=args.reps)["time_s"]
    rows.append(dict(name=name, time_s=t, Gps=n / t / 1e9, **extra))
    print(f"{name:>28}: {n / t / 1e9:6.2f} G params/s  ({t * 1e3:7.1f} ms)", flush=True)
    box.clear()  # free the state before the next plan

  measure(
    "traced (one jit, all pinned)", jax_dos.interleaved_adam(1e-4, subgroup_size=args.leaf, plan="stream"), jit=True
  )
  for k in (int(x) for x in args.streamed.split(",")):
    for slots in (int(s) for s in args.slots.split(",")) if k else (1,):
      placements = ["stream"] * k + ["host"] * (args.leaves - k)
      plan = dataclasses.replace(base, placements=tuple(placements), stream_slots=slots)
      measure(
        f"stream {k}/{args.leaves} slots {slots}", jax_dos.interleaved_adam(1e-4, plan=plan), streamed=k, slots=slots
      )
  with open(os.path.join(os.environ.get("OUT", "."), "engine_sweep.json"), "w") as f:
    json.dump(
      dict(jax=jax.__version__, device=jax.devices()[0].device_kind, leaves=args.leaves, leaf=args.leaf, rows=rows),
      f,
      indent=1,
    )


if __name__ == "__main__":
  main()
