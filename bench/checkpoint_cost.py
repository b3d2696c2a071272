"""What checkpoint integrity costs: the manifest's checksums in a save, the verification in a restore.

One jax_dos state (bfloat16 parameters, float32 master, mu and nu in pinned host
memory, random values so that nothing compresses) of ``--params`` parameters,
about 14 bytes a parameter on disk, saved with ``jax_dos.CheckpointManager``
(asynchronous, as the training script saves) and restored into a fresh state.
Times, in seconds:

  save_returned      ``save`` returns (host copies made, Orbax writing in the background)
  save_complete      ``wait_until_finished`` returns: committed, and the manifest written
  manifest           ``checkpoint_integrity.write_manifest`` of the step on its own (every file read back and
                     checksummed; part of save_complete)
  verify             ``checkpoint_integrity.verify`` of the step on its own (part of restore)
  restore            ``restore(step)``: verification, then Orbax's read into pinned host memory

Files are read through the page cache: right after a save they are in it, as
they are for a restore on a machine whose RAM holds the checkpoint. Verifying
a checkpoint that is not cached reads it from disk once, and the restore that
follows then reads from the cache. Results go to ``$OUT/checkpoint_cost.json``
(default ``bench/results/``).

Usage::

    python bench/checkpoint_cost.py --params 100e6     # ~1.4 GB, a CPU is fine
    python bench/checkpoint_cost.py --params 1.3e9     # a 1.3B-class checkpoint, ~18 GB
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_dos
from jax_dos.checkpoint import integrity as checkpoint_integrity

LEAF = 2**24  # parameters per leaf (a 4096 x 4096 matrix)


def _state(n: int, seed: int):
  leaves = [LEAF] * (n // LEAF) + ([n % LEAF] if n % LEAF else [])
  params = {f"w{i}": jnp.zeros((k,), jnp.bfloat16) for i, k in enumerate(leaves)}
  tx = jax_dos.interleaved_adam(1e-3, plan="host")
  state = tx.init(params)
  rng = np.random.default_rng(seed)

  def fill(tree, dtype):
    return jax.tree.map(
      lambda x: jax.device_put(rng.standard_normal(x.shape, np.float32).astype(dtype), x.sharding), tree
    )

  params = fill(params, jnp.bfloat16)
  state = state._replace(
    master=fill(state.master, np.float32), mu=fill(state.mu, np.float32), nu=fill(state.nu, np.float32)
  )
  return params, state


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--params", type=float, default=100e6, help="parameters in the checkpoint")
  ap.add_argument("--dir", default=None, help="where to write it (default: a temporary folder, deleted after)")
  ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(os.path.dirname(__file__), "results")))
  args = ap.parse_args()
  n = int(args.params)
  root = args.dir or tempfile.mkdtemp(prefix="jax_dos_ckpt_cost_")
  try:
    params, state = _state(n, 0)
    times = {}
    with jax_dos.CheckpointManager(root, max_to_keep=None) as mgr:
      t = time.perf_counter()
      mgr.save(1, params=params, opt_state=state, force=True)
      times["save_returned"] = time.perf_counter() - t
      mgr.wait_until_finished()
      times["save_complete"] = time.perf_counter() - t
      step_dir = os.path.join(root, "1")
      t = time.perf_counter()
      checkpoint_integrity.write_manifest(step_dir, 1)
      times["manifest"] = time.perf_counter() - t
      t = time.perf_counter()
      assert checkpoint_integrity.verify(step_dir) is None
      times["verify"] = time.perf_counter() - t
      del params, state
      template = _state(n, 1)
      t = time.perf_counter()
      mgr.restore(1, params=template[0], opt_state=template[1])
      times["restore"] = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step_dir) for f in fs)
    result = {
      "params": n,
      "bytes_on_disk": size,
      "cpus": os.cpu_count(),
      "checksum_threads": checkpoint_integrity._threads(),
      "seconds": times,
      "manifest_share_of_save": times["manifest"] / times["save_complete"],
      "verify_share_of_restore": times["verify"] / times["restore"],
      "checksum_gb_per_s": size / times["verify"] / 1e9,
      "device": str(jax.devices()[0].device_kind),
      "jax": jax.__version__,
    }
  finally:
    if args.dir is None:
      shutil.rmtree(root, ignore_errors=True)
  print(json.dumps(result, indent=1))
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, "checkpoint_cost.json"), "w") as f:
    json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
