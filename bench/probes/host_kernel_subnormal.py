"""Probe: does the host kernel slow down where gradients are so small that Adam's ``(1 - b2) g^2`` is subnormal?

Run on a GPU machine's host (the GPU is not used), from the repository's root::

    PYTHONPATH=$PWD OUT=$OUT python bench/probes/host_kernel_subnormal.py [--elements 67108864] [--threads 16]

Why: fine-tuning a random-weight Llama-7B checkpoint, the run's steps 6-10, where its loss spikes (11 -> 21), ran
0.945-0.958x the same model from scratch, level after them (``bench/results/fine_tune-h100/``). A spiking loss means
extreme logits, and the softmax's gradient for tokens far below the top (the head's rows of tokens the data never
holds: 24k of the model's 32k) can be about 1e-18, whose ``(1 - b2) g^2`` is a subnormal float32. numba's kernels do
not flush subnormals (XLA's CPU backend does); x86 cores that handle a subnormal result with a microcode assist pay
about a hundred cycles an instruction for it. The development machine (AMD EPYC) showed no slowdown.

Measures each format's kernel (``host_kernels.adam_many`` over one flat buffer, the rates as ``host_kernel_bound.py``
takes them: best of ``--repeats`` after a warm-up) with gradients drawn from N(0, 1e-3), then with a share
``--tiny-share`` of them (and all of them) scaled to about 1e-19, at ``--threads``; with ``--keep-subnormals`` as
the kernels ran before ``jax_dos.subnormals`` (no FTZ or DAZ set). Writes ``$OUT/host_kernel_subnormal.json`` with the
CPU's model and numba's threading layer (``NUMBA_THREADING_LAYER`` chooses another).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

import numba
import numpy as np

from jax_dos import subnormals
from jax_dos.core import moment_formats as mf
from jax_dos.kernels import host_kernels


def cpu_model() -> str:
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "")
  except OSError:
    return ""


def rate(moments: str, g: np.ndarray, repeats: int) -> float:
  """G parameters a second of ``repeats`` steps (the best) on fresh state (p ~ N(0, 0.02), zero moments)."""
  n = g.size
  p = (np.random.default_rng(1).standard_normal(n) * 0.02).astype(np.float32)
  m, v = (mf.host_encode(np.zeros(n, np.float32), moments, 1.0, s) if moments != "float32"
          else np.zeros(n, np.float32) for s in (0, 1))  # fmt: skip
  hyper = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=0.0, weight_decay=0.1)
  best = float("inf")
  for t in range(1, repeats + 2):  # the first compiles (or loads) and is not counted
    scalars = [-2e-5, 1 - 0.9**t, 1 - 0.999**t, 1.0] + ([float(t % mf.SEED_PERIOD)] if moments != "float32" else [])
    start = time.perf_counter()
    host_kernels.adam_many([(g, p, m, v)], [True], scalars=np.asarray(scalars, np.float32), **hyper)
    if t > 1:
      best = min(best, time.perf_counter() - start)
  return n / best / 1e9


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--elements", type=int, default=1 << 26)
  parser.add_argument("--threads", type=int, default=0, help="0: the host kernels' default")
  parser.add_argument("--tiny-share", type=float, default=0.015)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--moments", nargs="+", default=["float32", "bfloat16", "int8"])
  parser.add_argument("--keep-subnormals", action="store_true", help="the kernels as before jax_dos.subnormals")
  args = parser.parse_args()
  if args.keep_subnormals:
    subnormals.SUPPORTED = False  # the launches leave the threads' MXCSR as it is
  threads = host_kernels.set_num_threads(args.threads or None)
  rng = np.random.default_rng(0)
  normal = (rng.standard_normal(args.elements) * 1e-3).astype(np.float32)
  some = normal.copy()
  tiny = rng.random(args.elements) < args.tiny_share
  some[tiny] *= np.float32(1e-16)  # about 1e-19: (1 - b2) g^2 about 1e-41, subnormal
  every = (normal * np.float32(1e-16)).astype(np.float32)
  result = {"cpu": cpu_model(), "threads": threads, "elements": args.elements, "tiny_share": args.tiny_share}
  result["flush_subnormals"] = not args.keep_subnormals
  result["rows"] = []
  for moments in args.moments:
    row = {"moments": moments}
    for name, g in (("normal", normal), ("some_tiny", some), ("all_tiny", every)):
      row[name] = rate(moments, g, args.repeats)
    row["some_tiny_over_normal"] = row["some_tiny"] / row["normal"]
    row["all_tiny_over_normal"] = row["all_tiny"] / row["normal"]
    print(json.dumps(row))
    result["rows"].append(row)
  result["threading_layer"] = numba.threading_layer()  # (known once a kernel has run)
  out = os.environ.get("OUT", "bench/results")
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "host_kernel_subnormal.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
