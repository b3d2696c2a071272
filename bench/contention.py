"""Do the host kernel and streaming contend more at scale, or with more subgroups?

For each ``--configs`` entry ``LEAVESxLEAF`` (an fp32 tree of LEAVES equal
leaves, one subgroup each) the eager engine runs: every subgroup on the host,
every subgroup streamed, and a half/half mix (alternating, so both paths run
for the whole step), each with ``jax_dos.trace`` spans. Next to each time: the
performance model's prediction from this machine's calibration (measured once
at the start, at ``--calibration-size``). ``--switch-interval`` reruns the
mix with that Python thread switch interval (the host worker and the
streaming loop are two Python threads sharing the GIL).

Writes ``$OUT/contention.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import common

common.setup_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_dos  # noqa: E402
from jax_dos.planning import cost_model  # noqa: E402


def run_plan(params, grads, placements, leaf: int, reps: int) -> dict:
  subgroups, sizes = jax_dos.partition_leaves(params, leaf)
  plan = jax_dos.Plan(subgroups, tuple(placements), sizes, source="user")
  tx = jax_dos.interleaved_adam(1e-3, weight_decay=0.01, subgroup_size=leaf, plan=plan)
  # update_params consumes both, so they are carried from step to step
  carry = {"params": jax.tree.map(jnp.copy, params), "state": tx.init(params)}

  def step():
    carry["params"], carry["state"] = jax_dos.update_params(tx, grads, carry["state"], carry["params"])
    jax.block_until_ready(carry)

  r = common.timed(step, reps=reps)
  with jax_dos.trace.recording() as spans:
    step()
  r["trace"] = jax_dos.trace.totals(spans)
  carry.clear()
  gc.collect()
  return r


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--configs", default="8x268435456,64x33554432", help="comma list of LEAVESxLEAF")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--calibration-size", type=int, default=None)
  ap.add_argument("--switch-interval", type=float, default=None, help="seconds; also run the mix with it")
  args = ap.parse_args()
  t0 = time.perf_counter()
  cal = jax_dos.calibrate(size=args.calibration_size, force=True, cache=False)
  print(f"calibration: {cal.summary()}", flush=True)
  out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "calibration": cal.to_dict(), "rows": []}
  for cfg in args.configs.split(","):
    n_leaves, leaf = (int(x) for x in cfg.split("x"))
    keys = jax.random.split(jax.random.key(0), 2 * n_leaves)
    params = {f"w{i:03d}": jax.random.normal(keys[i], (leaf,), jnp.float32) for i in range(n_leaves)}
    grads = {f"w{i:03d}": 1e-3 * jax.random.normal(keys[n_leaves + i], (leaf,)) for i in range(n_leaves)}
    n = n_leaves * leaf
    mix = ["stream" if i % 2 == 0 else "host" for i in range(n_leaves)]
    plans = {"host": ["host"] * n_leaves, "stream": ["stream"] * n_leaves, "mix": mix}
    runs = [(name, pl, None) for name, pl in plans.items()]
    if args.switch_interval:
      runs.append((f"mix@{args.switch_interval:g}", mix, args.switch_interval))
    for name, placements, interval in runs:
      k_s = placements.count("stream")
      k_h = n_leaves - k_s
      pred = cost_model.predict(cal, n_host=k_h * leaf, n_stream=k_s * leaf, k_host=k_h, k_stream=k_s)["total"]
      old = sys.getswitchinterval()
      if interval:
        sys.setswitchinterval(interval)
      try:
        r = run_plan(params, grads, placements, leaf, args.reps)
      finally:
        sys.setswitchinterval(old)
      row = dict(config=cfg, leaves=n_leaves, leaf=leaf, params=n, plan=name, predicted_s=pred, **r)
      out["rows"].append(row)
      tr = ", ".join(f"{k} {v['seconds'] * 1e3:.0f}" for k, v in r["trace"].items())
      print(
        f"{cfg:>14} {name:>10}: {r['time_s']:.4f} s ({n / r['time_s'] / 1e9:.2f} G/s), predicted {pred:.4f} s"
        f" | ms: {tr}",
        flush=True,
      )
    del params, grads
    gc.collect()
  out["elapsed_s"] = time.perf_counter() - t0
  with open(os.path.join(os.environ.get("OUT", "."), "contention.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
