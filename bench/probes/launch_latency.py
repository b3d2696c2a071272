"""Probe: a host kernel's time a call on numba's threading layer, the cores idle or busy.

Run from the repository's root (no GPU used)::

    NUMBA_THREADING_LAYER=omp PYTHONPATH=$PWD OUT=$OUT python bench/probes/launch_latency.py [--elements 4000000]

Times ``--calls`` calls of the float32 kernel (``host_kernels.adam_many``) on one buffer of ``--elements`` and
writes ``$OUT/launch_latency_<layer>.json`` (the median and the 10th and 90th percentiles, ms). OpenMP's barrier waits
for every thread of the team, so with the cores busy (run it beside a load) a call takes as long as the slowest
thread's turn.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numba
import numpy as np

from jax_dos.kernels import host_kernels


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--elements", type=int, default=4_000_000)
  parser.add_argument("--calls", type=int, default=100)
  args = parser.parse_args()
  g, p, m, v = (np.ones(args.elements, np.float32) for _ in range(4))
  kw = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1)
  scalars = np.asarray([-1e-3, 0.1, 0.001, 1.0], np.float32)
  host_kernels.adam_many([(g, p, m, v)], [True], scalars=scalars, **kw)  # compiles (or loads)
  times = []
  for _ in range(args.calls):
    start = time.perf_counter()
    host_kernels.adam_many([(g, p, m, v)], [True], scalars=scalars, **kw)
    times.append(1e3 * (time.perf_counter() - start))
  layer = numba.threading_layer()
  result = {"layer": layer, "threads": numba.get_num_threads(), "elements": args.elements}
  result["load_average"] = os.getloadavg()
  result |= {f"p{q}_ms": float(np.percentile(times, q)) for q in (10, 50, 90)}
  print(json.dumps(result))
  out = os.environ.get("OUT", "bench/results")
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, f"launch_latency_{layer}.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
