"""Which of jax_dos's modules run, and on which threads, in overlapped steps whose whole state is on the host.

Issue 47's measure of a host parameter's path: the test model of ``tests/overlap_model.py`` on
``jax_dos.OverlappedStep(plan="host")``, two steps to warm up, then every Python call of three steps (and the
settling after them) on every thread, counted by the module of the called function::

    python bench/probes/host_path_modules.py [--clip 1e-3]   # 1e-3 fires the clip every step; default silent
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
import overlap_model as om  # noqa: E402

import jax_dos  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--clip", type=float, default=om.NEVER, help="the clip norm (1e-3 fires every step)")
  args = p.parse_args()
  rng = np.random.default_rng(0)
  groups, batch = om.make_groups(rng), om.make_batch(rng)
  tx = jax_dos.interleaved_adamw(om.LR, weight_decay=om.WD, b1=om.B1, b2=om.B2)
  seen: dict[str, set[str]] = collections.defaultdict(set)

  def called(frame, event, arg):
    module = frame.f_globals.get("__name__", "")
    if event == "call" and module.startswith("jax_dos"):
      seen[module].add(threading.current_thread().name)

  threading.setprofile(called)  # the step's threads start with it
  sys.setprofile(called)
  step = jax_dos.OverlappedStep(tx, om.STAGES, groups, plan="host", clip_norm=args.clip, micro_batches=2)
  for _ in range(2):
    step(batch)
  step.settle()
  seen.clear()
  for _ in range(3):
    step(batch)
  step.settle()
  counted = {k: sorted(v) for k, v in seen.items()}
  sys.setprofile(None)
  threading.setprofile(None)
  step.close()
  for module in sorted(counted):
    print(f"{module:36s} {', '.join(counted[module])}")
  threads = set().union(*map(set, counted.values()))
  print(f"{len(counted)} modules on {len(threads)} threads")


if __name__ == "__main__":
  main()
