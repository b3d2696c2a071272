"""How long a process holding much pinned host memory takes to end, and what the time goes to.

    python bench/probes/exit_probe.py --gib 48 --exit normal|os_exit|free_first

Allocates ``--gib`` GiB of ``pinned_host`` arrays through JAX (XLA's pinned
pool grows to hold them, as the overlapped step's state does), prints one
JSON line with the time taken and the process's resident set, then ends:
``normal`` returns from ``main`` and lets Python and JAX tear down;
``os_exit`` flushes and calls ``os._exit(0)`` (no interpreter or client
teardown); ``free_first`` deletes the arrays, then returns normally (the
pool keeps the memory until the client goes). The caller times the whole
process from outside (``bench/readme_6p7b.sh`` prints the times).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp


def _rss_gib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 2**20
  return float("nan")


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument("--gib", type=float, default=48)
  p.add_argument("--exit", choices=("normal", "os_exit", "free_first"), default="normal")
  args = p.parse_args()
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  t0 = time.perf_counter()
  chunk = 2**30  # float32 elements: 4 GiB an array
  arrays = [jax.jit(lambda: jnp.ones((chunk,), jnp.float32), out_shardings=host)() for _ in range(int(args.gib // 4))]
  jax.block_until_ready(arrays)
  row = {"gib": args.gib, "exit": args.exit, "alloc_s": time.perf_counter() - t0, "rss_gib": _rss_gib(),
         "ended_main_at": time.time()}  # fmt: skip
  print(json.dumps(row), flush=True)
  if args.exit == "free_first":
    for a in arrays:
      a.delete()
    del arrays
  elif args.exit == "os_exit":
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
  main()
