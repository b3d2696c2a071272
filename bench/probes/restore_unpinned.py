"""Probe: a checkpoint restored into ordinary host memory (``unpinned_host``), then moved into a pinned arena.

Run on a GPU machine (or the CPU backend), from the repository's root::

    PYTHONPATH=$PWD OUT=$OUT python bench/probes/restore_unpinned.py [--gib 4] [--leaves 16]

Why: a resume restores the overlapped step's offloaded state into XLA's pinned pool (its template's memory kind,
``pinned_host``), and the step then keeps the pool: at 13B on one H100 the resumed process held 218.8 GiB for a
printed 202.0 and ended 37 s after its last line (``docs/checkpoints.md``, "A resume's host memory"). The plan there
restores into ``unpinned_host`` and copies each leaf into the step's arena, freeing it as it lands. This probe tries
the parts a GPU has to show first: Orbax reading into ``unpinned_host`` on this backend, ``copy_out.CopyOut``'s
``memmove`` from such a leaf into an arena array (``free_sources``), the bytes equal, the time of each part and the
process's resident set after each.

Writes ``$OUT/restore_unpinned.json``: ``ok`` (every leaf's bytes equal), the seconds and GB/s of the save, the
restore and the moves, and the resident set (GiB) before the restore, after it, at its largest during the moves and
after them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for common

import jax  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from common import rss_gib  # noqa: E402

from jax_dos import pinned_arena  # noqa: E402
from jax_dos.copy_out import CopyOut  # noqa: E402
from jax_dos.hand_off import receive  # noqa: E402


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--gib", type=float, default=4.0, help="the state's size")
  ap.add_argument("--leaves", type=int, default=16)
  args = ap.parse_args()
  device = jax.devices()[0]
  kinds = sorted(m.kind for m in device.addressable_memories())
  out: dict = dict(backend=jax.default_backend(), device=str(device), memory_kinds=kinds, gib=args.gib,
                   leaves=args.leaves, arena_supported=pinned_arena.supported([device]))  # fmt: skip
  n = int(args.gib * 2**30 / 4 / args.leaves)
  pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  unpinned = jax.sharding.SingleDeviceSharding(device, memory_kind="unpinned_host")
  rng = np.random.default_rng(0)
  sums = []
  state = {}
  for i in range(args.leaves):
    x = rng.standard_normal(n, dtype=np.float32)
    sums.append(float(np.sum(x, dtype=np.float64)))
    state[f"leaf{i:03d}"] = jax.device_put(x, pinned)
  del x
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ckpt")
    t = time.perf_counter()
    with ocp.StandardCheckpointer() as saver:
      saver.save(path, state)
    out["save_s"] = time.perf_counter() - t
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=unpinned), state)
    out["rss_before_restore_gib"] = rss_gib()
    t = time.perf_counter()
    with ocp.StandardCheckpointer() as reader:
      restored = reader.restore(path, state)
    jax.block_until_ready(restored)
    out["restore_s"] = time.perf_counter() - t
  out["restored_kinds"] = sorted({a.sharding.memory_kind for a in jax.tree.leaves(restored)})
  out["rss_after_restore_gib"] = rss_gib()
  if not out["arena_supported"]:
    out["ok"] = None
  else:
    arena, copier = pinned_arena.PinnedArena([device]), CopyOut()
    moved, peak = {}, out["rss_after_restore_gib"]
    t = time.perf_counter()
    for name in sorted(restored):
      src = restored.pop(name)  # the one holder: the copy frees it once its bytes have landed
      (moved[name],) = receive(copier.submit([src], [arena.array_like(src)], free_sources=True), None, name)
      del src
      peak = max(peak, rss_gib())
    out["move_s"] = time.perf_counter() - t
    copier.close()
    out["rss_peak_moving_gib"], out["rss_after_moves_gib"] = peak, rss_gib()
    out["ok"] = all(
      abs(float(np.sum(np.asarray(moved[f"leaf{i:03d}"]), dtype=np.float64)) - sums[i]) == 0 for i in range(args.leaves)
    )
  gb = args.gib * 2**30 / 1e9
  for phase in ("save", "restore", "move"):
    if f"{phase}_s" in out:
      out[f"{phase}_GBps"] = gb / max(out[f"{phase}_s"], 1e-9)
  print(json.dumps(out, indent=1), flush=True)
  dest = os.environ.get("OUT", ".")
  os.makedirs(dest, exist_ok=True)
  with open(os.path.join(dest, "restore_unpinned.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
