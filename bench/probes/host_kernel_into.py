"""Probe: the host kernel in place against into other buffers (the speculation's spare state), each format.

Run on a GPU machine's host (the GPU is not used), from the repository's root::

    PYTHONPATH=$PWD OUT=$OUT python bench/probes/host_kernel_into.py [--elements 67108864] [--threads 8 16]

Why: the overlapped step's host path stepped every host subgroup into its spare state (``adam_many_into``), also
after the decision, where the state no longer has to survive a redo. A store to a line the cache does not hold reads
the line first, so into moves about 42 bytes of DRAM a float32 parameter where in place moves 30 (reads of the
bfloat16 gradient and the state, 14 B; writes of the state and the bfloat16 copy, 14 B; and the copy's line read
first, 2 B). The fired step's trace had the kernel after the decision at well under its calibrated rate, which the
calibration times in place (``planning.calibration.host_kernel_rate``).

Measures ``host_kernels.adam_many`` (in place) and ``adam_many_into`` over one flat buffer of ``--elements``
parameters, each format, at each of ``--threads``: the median of ``--repeats`` after a warm-up pass that touches the
pages. Writes ``$OUT/host_kernel_into.json`` (rates in G params/s, and into's rate over in place's).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common

import common  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numba  # noqa: E402
import numpy as np  # noqa: E402

from jax_dos.core import adam_math  # noqa: E402
from jax_dos.core import moment_formats as mf  # noqa: E402
from jax_dos.core.adam_math import AdamHyper  # noqa: E402
from jax_dos.kernels import host_kernels

HYPER = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.01)


def buffers(n: int, moments: str) -> tuple[tuple, tuple, np.ndarray]:
  """``(g, p, m, v)``, the spare ``(p, m, v)`` and the step's scalars, for ``n`` parameters in ``moments``."""
  g = np.asarray(np.random.default_rng(0).normal(0, 1e-3, n), jnp.bfloat16)
  p = np.full(n, 0.02, np.float32)
  if moments == "float32":
    m, v = np.full(n, 1e-4, np.float32), np.full(n, 1e-8, np.float32)
    scalars = np.asarray([-1e-3, 0.1, 0.001], np.float32)
  else:
    m, v = (mf.host_encode(np.full(n, x, np.float32), moments, 1.0, salt) for salt, x in ((0, 1e-4), (1, 1e-8)))
    scalars = np.asarray(adam_math.step_scalars(AdamHyper(1e-3, moments=moments), jnp.asarray(10, jnp.int32)))
  return (g, p, m, v), tuple(np.empty_like(a) for a in (p, m, v)), scalars


def rate(fn, n: int, repeats: int) -> float:
  """``fn``'s parameters a second (G), the median of ``repeats`` after one pass that touches the pages."""
  return n / common.timed(fn, reps=repeats)["time_s"] / 1e9


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--elements", type=int, default=64 * 2**20)
  ap.add_argument("--threads", type=int, nargs="+", default=[numba.config.NUMBA_NUM_THREADS])
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--formats", nargs="+", default=["float32", "bfloat16", "int8"])
  args = ap.parse_args()
  n, rows = args.elements, []
  for moments in args.formats:
    state, spare, scalars = buffers(n, moments)
    low = np.empty(n, jnp.bfloat16)
    kw = dict(**HYPER, scalars=scalars)
    in_place = functools.partial(host_kernels.adam_many, [(*state, low)], [True], **kw)
    into = functools.partial(host_kernels.adam_many_into, [(*state, *spare, low)], [True], **kw)
    for threads in args.threads:
      numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
      row = dict(moments=moments, threads=threads, in_place=rate(in_place, n, args.repeats))
      row["into"] = rate(into, n, args.repeats)
      row["into_over_in_place"] = row["into"] / row["in_place"]
      rows.append(row)
      print(json.dumps({k: round(x, 3) if isinstance(x, float) else x for k, x in row.items()}), flush=True)
  out = os.environ.get("OUT", ".")
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "host_kernel_into.json"), "w") as f:
    json.dump(dict(elements=n, threading_layer=numba.threading_layer(), rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
