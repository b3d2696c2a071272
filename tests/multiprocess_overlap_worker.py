"""The overlapped step on a data-parallel mesh of several processes, for ``test_multiprocess.py``.

``python tests/multiprocess_overlap_worker.py PORT PROCESS_ID SEED DIR`` is one of 2 processes (2 CPU devices each,
gloo) that train ``overlap_model``'s staged model with ``jax_dos.OverlappedStep`` on a ``(data, model)`` mesh:
parameters replicated over ``data`` (which spans the processes) and sharded over ``model``, batch rows over
``data``, every placement (``overlap_model.MIXED``). Each process compares what it holds against
``optax.chain(clip_by_global_norm, adamw)`` run on whole arrays on its own first device, with the clip firing and
silent, and counts its pinned host bytes (half of the state, as it holds); a layout one process's host cannot hold
is refused on both before anything is allocated; then a checkpoint both processes wrote after 2 steps resumes,
bit-exact against the run that went on. Every process draws the same numbers from ``SEED``.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 3


def check_close(ours, theirs, tol: float, label: str) -> None:
  """Each shard of ``ours`` this process holds against the same block of ``theirs`` (whole arrays), as
  ``helpers.max_rel_diff`` measures: relative to the largest magnitude of the leaf (at least 1)."""
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    b = np.asarray(b, np.float64)
    scale = max(1.0, float(np.max(np.abs(b)))) if b.size else 1.0
    for shard in a.addressable_shards:
      diff = np.max(np.abs(np.asarray(shard.data, np.float64) - b[shard.index]), initial=0.0) / scale
      assert diff < tol, (label, diff)


def check_equal(ours, theirs, label: str) -> None:
  """Bit-equal shard by shard, in the same layout (memory kinds aside)."""
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    assert a.sharding.is_equivalent_to(b.sharding.with_memory_kind(a.sharding.memory_kind), a.ndim), label
    for x, y in zip(a.addressable_shards, b.addressable_shards):
      np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data), err_msg=label)


def pinned(tree) -> list[jax.Array]:
  return [a for a in jax.tree.leaves(tree) if a.sharding.memory_kind == "pinned_host"]


def check_host_bytes(step) -> None:
  """The step's host bytes count the half of the state this process holds (the mesh's "data" axis spans the two
  processes): the pinned state it addresses is half the whole arrays', and is what ``host_bytes`` plans for it."""
  from jax_dos.overlap import memory as overlap_memory

  state = step.opt_state
  arrays = pinned((state.master, state.mu, state.nu))
  here = sum(shard.data.nbytes for a in arrays for shard in a.addressable_shards)
  assert arrays and 2 * here == sum(a.nbytes for a in arrays), (here, [a.nbytes for a in arrays])
  plan, layout = step.plan, step._layout
  offloaded = [i for leaves, p in zip(plan.subgroups, plan.placements) if p != "device" for i in leaves]
  assert here == 12 * sum(layout.held[i] for i in offloaded), here  # float32 master, mu and nu
  whole = dataclasses.replace(layout, leaf_held=())  # every leaf counted whole, as one process of it all would
  assert 2 * overlap_memory.fixed_host_bytes(plan, layout) == overlap_memory.fixed_host_bytes(plan, whole)
  assert here <= step.host_bytes() <= overlap_memory.host_bytes(plan, whole, None) // 2


def run(seed: int, directory: str) -> None:
  import overlap_model as t
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from multiprocess_worker import LOCAL_DEVICES, NUM_PROCESSES, process_local

  import jax_dos
  from jax_dos.core import partition

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(NUM_PROCESSES, LOCAL_DEVICES), ("data", "model"))
  replicated = lambda x: NamedSharding(mesh, P(None, "model") if x.ndim == 2 else P("model"))  # noqa: E731
  rows = NamedSharding(mesh, P("data"))
  rng = np.random.default_rng(seed)
  with jax.default_device(jax.local_devices()[0]):
    whole = t.make_groups(rng)
    whole_batches = [t.make_batch(rng) for _ in range(2 * STEPS)]
  lay = lambda tree: jax.tree.map(lambda x: process_local(np.asarray(x), replicated(x)), tree)  # noqa: E731
  batches = [tuple(process_local(np.asarray(x), rows) for x in b) for b in whole_batches]
  plan = t.MIXED[: t._subgroup_count(whole)]

  for clip in (t.FIRES, t.NEVER):
    step, _ = t.overlapped_run(lay(whole), batches[:STEPS], clip, 2, plan)
    assert bool(step.grad_norm > clip) == (clip == t.FIRES)
    with jax.default_device(jax.local_devices()[0]):
      masters, ref_state = t.reference_run(whole, whole_batches[:STEPS], clip, 2)
    adam = t.adam_state(ref_state)
    state = step.opt_state
    for ours, theirs, name in ((state.master, masters, "master"), (state.mu, adam.mu, "mu"), (state.nu, adam.nu, "nu")):
      check_close(ours, theirs, 1e-5, f"clip {clip} {name}")
    check_close(step.params, masters, 1e-5, f"clip {clip} params")
    for m, p in zip(jax.tree.leaves(state.master), jax.tree.leaves(step.params)):  # the state partitioned over data
      want = partition.state_sharding(p)
      assert want is not None and m.sharding.is_equivalent_to(want.with_memory_kind(m.sharding.memory_kind), m.ndim)
    check_host_bytes(step)
    step.close()
    print(f"ok equals optax, clip {'fires' if clip == t.FIRES else 'silent'}", flush=True)

  # One plan: each process plans "auto" from its own rates and stage times, set far apart here (process 0's host
  # fast, process 1's link fast): the plans they would make alone differ, the plan both run is one.
  fast, slow = 4e9, 2e5
  host, stream = (fast, slow) if jax.process_index() == 0 else (slow, fast)
  cal = jax_dos.Calibration(host, stream, 50e9, host, stream, device_free_bytes=0)
  tx = jax_dos.interleaved_adamw(
    t.LR, b1=t.B1, b2=t.B2, weight_decay=t.WD, subgroup_size=40, planner=jax_dos.auto_planner(cal)
  )
  times = jax_dos.StageTimes((0.01 * (1 + jax.process_index()),) * len(t.STAGES), (0.02,) * len(t.STAGES))
  groups = lay(whole)
  own = jax_dos.overlapped_plan(tx, t.STAGES, groups, stage_times=times, micro_batches=2)
  placements = np.array([jax_dos.PLACEMENTS.index(p) for p in own.placements], np.int32)
  every = np.asarray(multihost_utils.process_allgather(placements)).reshape(NUM_PROCESSES, -1)
  assert (every == every[0]).all(), every
  share = [own.calibration[k] for k in ("host_rate_concurrent", "stream_rate_concurrent")]
  assert share == [fast, slow], share  # process 0's rates split a fired clip's redo on every process
  changed = own.source.endswith("+processes")
  assert changed == (not own.predicted), own  # a process whose plan changed keeps no prediction
  assert np.asarray(multihost_utils.process_allgather(np.array([changed]))).any()  # the plans alone differed
  # A host whose RAM cannot hold process 1's share of the state (a small host_memory on that process): both refuse
  # before anything is allocated, process 1 with its numbers; the parameters then train below.
  small = jax_dos.HostMemory(1000, processes=2) if jax.process_index() == 1 else jax_dos.HostMemory(2**50, 2)
  cramped = jax_dos.interleaved_adamw(t.LR, b1=t.B1, b2=t.B2, weight_decay=t.WD, subgroup_size=40, host_memory=small)
  gc.collect()
  before = len(pinned(jax.live_arrays()))
  try:
    jax_dos.OverlappedStep(cramped, t.STAGES, groups, None, clip_norm=t.FIRES, micro_batches=2, plan=own)
    raise AssertionError("a layout that does not fit the host was not refused")
  except MemoryError as e:
    message = str(e)
  if jax.process_index() == 1:
    assert "does not fit this host's RAM" in message and "450 bytes (90% of 1,000 bytes RAM shared by 2" in message
    assert "needs " in message and "--moments" in message and "fewer processes" in message, message
  else:
    assert "process 1 of the job refused" in message, message
  assert len(pinned(jax.live_arrays())) <= before  # no state, no spare buffer
  print("ok refused before allocation", flush=True)
  step = jax_dos.OverlappedStep(tx, t.STAGES, groups, None, clip_norm=t.FIRES, micro_batches=2, plan=own)
  for batch in batches[:2]:
    step(batch)
  with jax.default_device(jax.local_devices()[0]):
    masters, _ = t.reference_run(whole, whole_batches[:2], t.FIRES, 2)
  check_close(step.opt_state.master, masters, 1e-5, "one plan")
  step.close()
  print("ok one plan", flush=True)

  # Resume: a checkpoint both processes wrote after 2 steps continues as the run that went on, bit for bit.
  straight, _ = t.overlapped_run(lay(whole), batches[:4], t.FIRES, 2, plan)
  first, _ = t.overlapped_run(lay(whole), batches[:2], t.FIRES, 2, plan)
  tx = jax_dos.interleaved_adamw(t.LR, b1=t.B1, b2=t.B2, weight_decay=t.WD, subgroup_size=40, plan=plan)
  with jax_dos.CheckpointManager(directory, save_interval_steps=1) as manager:
    manager.save(2, params=first.params, opt_state=first.opt_state, force=True)
    manager.wait_until_finished()
    first.close()
    template = lay(jax.tree.map(jnp.zeros_like, whole))
    params, state, _ = manager.restore(2, params=template, opt_state=tx.init(template))
  resumed = jax_dos.OverlappedStep(tx, t.STAGES, params, state, clip_norm=t.FIRES, micro_batches=2)
  for batch in batches[2:4]:
    resumed(batch)
  check_equal((resumed.params, resumed.opt_state), (straight.params, straight.opt_state), "resumed")
  resumed.close()
  straight.close()
  print("ok resumed bit-exact", flush=True)


if __name__ == "__main__":
  from multiprocess_worker import join

  join(int(sys.argv[1]), int(sys.argv[2]))
  try:
    run(int(sys.argv[3]), sys.argv[4])
  finally:
    jax.distributed.shutdown()
