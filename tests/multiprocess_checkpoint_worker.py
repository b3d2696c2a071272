"""Checkpoints across processes, for ``test_multiprocess.py``.

``python tests/multiprocess_checkpoint_worker.py PORT PROCESS_ID SEED DIR`` is one of 2 processes (2 CPU devices
each, gloo) that train a few steps with partitioned state (the default) on a (data, model) mesh, save through
``jax_dos.CheckpointManager`` (async, host state copied shard by shard) while the next step updates the host state in
place, and restore into the same layout, bit-exact. Process 0 writes the global arrays it saved (gathered) to
``DIR/expected.npz``, then damages the newest step: both processes must agree on the older one.

Both processes then restore it with bfloat16 moments (the format converted onto the mesh, each process converting
and placing its shards, several reads of a few leaves): the moments equal the saved ones converted by
``moment_formats``' own functions, the rest bit-exact.

``python tests/multiprocess_checkpoint_worker.py single DIR`` restores that checkpoint in one process, on a 2 x 2
mesh of its 4 devices and on one device, and compares with ``DIR/expected.npz`` bit-exact; and on one device with
int8 moments (the conversion issue 50's 13B checkpoint takes from 2 GPUs to 1).
"""

from __future__ import annotations

import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {"fsdp": (8, 6), "table": (4, 3), "bias": (8,)}
SPECS = {"fsdp": ("data", "model"), "table": (), "bias": ()}
DTYPES = {"fsdp": jnp.float32, "table": jnp.bfloat16, "bias": jnp.float32}
PLAN = ["host", "stream", "device"]


def optimizer(moments: str = "float32", plan=PLAN):
  import jax_dos

  return jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan=plan, moments=moments)


def template(shardings: dict) -> dict:
  """Zero parameters laid out by ``shardings`` (what a restarted run has before restoring)."""
  return {k: jax.device_put(jnp.zeros(SHAPES[k], DTYPES[k]), shardings[k]) for k in SHAPES}


def bits(x) -> np.ndarray:
  """``x`` as numpy, bfloat16 as its uint16 bits (what ``np.savez`` keeps and ``assert_array_equal`` compares)."""
  x = np.asarray(x)
  return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x


def flat(params, state) -> dict[str, jax.Array]:
  """The arrays a checkpoint holds, by name."""
  trees = {"params": params, "master": state.master, "mu": state.mu, "nu": state.nu}
  return {f"{t}/{k}": tree[k] for t, tree in trees.items() for k in SHAPES} | {"count": state.count}


def check_converted(params, state, expected, moments: str) -> None:
  """``params``, master and count bit-exact against ``expected`` (the float32 state saved); ``mu`` and ``nu`` equal
  the saved ones encoded in ``moments`` by ``moment_formats.host_encode`` (the step count as the seed), shard by
  shard (each process its own)."""
  from jax_dos.core import moment_formats as mf

  count = int(np.asarray(expected["count"]).reshape(-1)[0])  # (gathered from each process)
  for name, x in flat(params, state).items():
    want = expected[name.replace("/", ".")]
    moment, key = name.split("/")[0], name.split("/")[-1]
    if moment in ("mu", "nu"):
      salt = ("mu", "nu").index(moment)
      want = mf.host_encode(want, moments, float(count), salt).reshape(mf.stored_shape(SHAPES[key], moments))
      assert x.dtype == mf.stored_dtype(moments), (name, x.dtype)
    for shard in x.addressable_shards:
      np.testing.assert_array_equal(bits(shard.data), bits(want[shard.index]), err_msg=f"{moments} {name}")


def train_and_save(seed: int, directory: str) -> None:
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from multiprocess_worker import LOCAL_DEVICES, NUM_PROCESSES, process_local

  import jax_dos

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(NUM_PROCESSES, LOCAL_DEVICES), ("data", "model"))
  shardings = {k: NamedSharding(mesh, P(*SPECS[k])) for k in SHAPES}
  rng = np.random.default_rng(seed)
  values = {k: rng.standard_normal(SHAPES[k]).astype(np.float32) for k in SHAPES}
  params = {k: process_local(values[k].astype(DTYPES[k]), shardings[k]) for k in SHAPES}
  tx = optimizer()
  state = tx.init(params)

  def step(params, state):
    grads = {k: rng.standard_normal(SHAPES[k]).astype(DTYPES[k]) for k in SHAPES}
    grads = {k: process_local(g, shardings[k]) for k, g in grads.items()}
    return jax_dos.update_params(tx, grads, state, params)

  for _ in range(3):
    params, state = step(params, state)
  held = sum(s.data.size for s in state.master["table"].addressable_shards)
  assert held * NUM_PROCESSES == np.prod(SHAPES["table"]), held  # partitioned: each process holds its half
  saved = flat(params, state)
  expected = {k: np.asarray(multihost_utils.process_allgather(x, tiled=True)) for k, x in saved.items()}
  with jax_dos.CheckpointManager(directory, max_to_keep=None) as manager:
    manager.save(3, params=params, opt_state=state, meta={"step": 3}, force=True)
    params, state = step(params, state)  # updates host state in place while the save may still be writing
    manager.save(4, params=params, opt_state=state, meta={"step": 4}, force=True)
  if jax.process_index() == 0:
    np.savez(os.path.join(directory, "expected.npz"), **{k.replace("/", "."): bits(v) for k, v in expected.items()})

  # (a) The same layout (2 processes), bit-exact; the newest step damaged by process 0: both restore step 3.
  if jax.process_index() == 0:
    with open(os.path.join(directory, "4", "meta", "metadata"), "ab") as f:
      f.write(b" ")
  multihost_utils.sync_global_devices("damaged")
  fresh = template(shardings)
  manager = jax_dos.CheckpointManager(directory)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    params, state, meta = manager.restore(params=fresh, opt_state=tx.init(fresh))
  manager.close()
  assert meta == {"step": 3}, meta
  damaged = [w for w in caught if issubclass(w.category, jax_dos.DamagedCheckpointWarning)]
  assert len(damaged) == (jax.process_index() == 0), [str(w.message) for w in caught]  # process 0 reports it
  assert sorted(os.listdir(os.path.join(directory, "damaged"))) == ["4-size-mismatch"], os.listdir(directory)
  for name, x in flat(params, state).items():
    like = flat(fresh, tx.init(fresh))[name]
    assert x.sharding == like.sharding, (name, x.sharding, like.sharding)
    for shard in x.addressable_shards:
      np.testing.assert_array_equal(bits(shard.data), bits(expected[name][shard.index]), err_msg=name)
  print("ok restored in 2 processes", flush=True)

  # (b) Into bfloat16 moments on the same mesh: each process converts the leaves and puts its own shards, reading
  # about one leaf's moments at a time.
  from jax_dos.checkpoint import moments as checkpoint_moments

  checkpoint_moments.CONVERT_BYTES = 2 * 4 * 12  # mu and nu of the small leaves (float32), each read apart
  bf16 = optimizer("bfloat16")
  with jax_dos.CheckpointManager(directory) as manager:
    params, state, _ = manager.restore(params=fresh, opt_state=bf16.init(fresh))
  check_converted(params, state, {k.replace("/", "."): v for k, v in expected.items()}, "bfloat16")
  jax.block_until_ready(jax_dos.update_params(bf16, jax.tree.map(jnp.ones_like, params), state, params))
  print("ok converted in 2 processes", flush=True)


def restore_in_one_process(directory: str) -> None:
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_dos

  assert jax.process_count() == 1 and len(jax.devices()) == 4, jax.devices()
  expected = np.load(os.path.join(directory, "expected.npz"))
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
  layouts = {
    "a 2 x 2 mesh": {k: NamedSharding(mesh, P(*SPECS[k])) for k in SHAPES},
    "one device": {k: jax.sharding.SingleDeviceSharding(jax.devices()[0]) for k in SHAPES},
  }
  for label, shardings in layouts.items():
    fresh = template(shardings)
    tx = optimizer()
    with jax_dos.CheckpointManager(directory) as manager:
      params, state, meta = manager.restore(params=fresh, opt_state=tx.init(fresh))
    assert meta == {"step": 3}, meta
    for name, x in flat(params, state).items():
      np.testing.assert_array_equal(bits(x), expected[name.replace("/", ".")], err_msg=f"{label} {name}")
    print("ok restored in one process on", label, flush=True)
  # Saved on 2 processes' 4 devices, restored on one device with int8 moments (each leaf's moments whole there).
  fresh = template(layouts["one device"])
  int8 = optimizer("int8", plan="host")
  with jax_dos.CheckpointManager(directory) as manager:
    params, state, _ = manager.restore(params=fresh, opt_state=int8.init(fresh))
  check_converted(params, state, expected, "int8")  # (and trained on: test_train_resume.py, through the script)
  print("ok restored in one process with int8 moments", flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "single":
    restore_in_one_process(sys.argv[2])
  else:
    from multiprocess_worker import join

    join(int(sys.argv[1]), int(sys.argv[2]))
    try:
      train_and_save(int(sys.argv[3]), sys.argv[4])
    finally:
      jax.distributed.shutdown()
