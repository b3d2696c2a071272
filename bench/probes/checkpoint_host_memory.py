"""Probe: the host memory a checkpoint save adds, Orbax's copies to host memory all at once against in batches.

Run on a GPU machine: ``python bench/probes/checkpoint_host_memory.py OUT.json [--params N] [--batch-gib B]``.
Each case runs in a process of its own, since the peak resident set (``getrusage``'s ``ru_maxrss``) is per process:

- ``all_at_once``: ``jax_dos.CheckpointManager(async_save=False, save_batch_bytes=1 << 50)``: every array copied to
  host memory before any is written (Orbax's default order);
- ``batched``: ``save_batch_bytes`` = ``B`` GiB (the manager's order for a save it waits for).

The state: ``jax_dos.interleaved_adam(plan="host")`` over ``N`` float32 parameters on the accelerator in arrays of
64 Mi elements, one step taken, so master, mu and nu (12 B a parameter) are in pinned host memory. Each case prints
its resident set before the save, the peak during it and the difference, against the host state's size, the save's
seconds, and whether the restored state equals the saved one (a sample of leaves).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

GIB = 2**30
CASES = ("all_at_once", "batched")


def rss_gib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 2**20
  return float("nan")


def peak_rss_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_case(case: str, n: int, batch_gib: float) -> dict:
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jax_dos

  chunk = 64 * 2**20
  sizes = [min(chunk, n - i) for i in range(0, n, chunk)]
  keys = jax.random.split(jax.random.key(0), len(sizes))
  params = [jax.random.normal(k, (s,), jnp.float32) for k, s in zip(keys, sizes)]
  tx = jax_dos.interleaved_adam(1e-3, plan="host")
  state = tx.init(params)
  grads = [0.01 * p for p in params]
  updates, state = tx.update(grads, state, params)
  params = jax.block_until_ready([p + u for p, u in zip(params, updates)])
  jax.block_until_ready(state)
  host_gib = sum(x.nbytes for x in jax.tree.leaves((state.master, state.mu, state.nu))) / GIB
  directory = f"/tmp/checkpoint_host_memory_{case}"
  shutil.rmtree(directory, ignore_errors=True)
  batch = 1 << 50 if case == "all_at_once" else int(batch_gib * GIB)
  before = rss_gib()
  t0 = time.perf_counter()
  with jax_dos.CheckpointManager(directory, async_save=False, save_batch_bytes=batch) as mgr:
    mgr.save(1, params=params, opt_state=state, force=True)
    mgr.wait_until_finished()
    seconds = time.perf_counter() - t0
    peak = peak_rss_gib()
    restored_params, restored, _ = mgr.restore(1, params=params, opt_state=state)
  same = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(state)[:4] + params[:1], jax.tree.leaves(restored)[:4] + restored_params[:1])
  )
  shutil.rmtree(directory, ignore_errors=True)
  return {
    "case": case,
    "params": n,
    "host_state_gib": round(host_gib, 2),
    "batch_gib": None if case == "all_at_once" else batch_gib,
    "rss_before_save_gib": round(before, 2),
    "peak_rss_gib": round(peak, 2),
    "added_by_save_gib": round(peak - before, 2),
    "save_s": round(seconds, 1),
    "restored_equal": same,
    "device": str(jax.devices()[0].device_kind),
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out", nargs="?", default="checkpoint_host_memory.json")
  p.add_argument("--params", type=float, default=0.9e9)
  p.add_argument("--batch-gib", type=float, default=2.0)
  p.add_argument("--case", choices=CASES, help="(internal) run one case in this process")
  args = p.parse_args()
  if args.case:
    print(json.dumps(run_case(args.case, int(args.params), args.batch_gib)))
    return
  results = []
  for case in CASES:
    cmd = [sys.executable, __file__, "--case", case, "--params", str(args.params), "--batch-gib", str(args.batch_gib)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if out.returncode == 0 and lines else {"case": case, "error": out.stderr[-2000:]}
    print(json.dumps(result), flush=True)
    results.append(result)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
