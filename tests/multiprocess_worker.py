"""One of the processes of ``test_multiprocess.py``: ``python tests/multiprocess_worker.py PORT PROCESS_ID SEED``.

Joins the others through ``jax.distributed`` (CPU, gloo collectives, two
devices per process), builds a global (data, model) mesh of all devices, and
runs ``jax_dos.interleaved_adam`` eagerly for every placement on FSDP-sharded
and replicated parameters, with partitioned state (the default) and whole
copies. The reference is ``optax.adamw`` on whole arrays on this process's
first device; every process compares the shards it addresses.
Every process draws the same numbers from ``SEED``, so replicas agree.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import numpy as np

NUM_PROCESSES, LOCAL_DEVICES = 2, 2


def join(port: int, process_id: int) -> None:
  """Joins the other processes (CPU, gloo collectives, ``LOCAL_DEVICES`` devices each)."""
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes=NUM_PROCESSES, process_id=process_id,
    local_device_ids=list(range(LOCAL_DEVICES)), initialization_timeout=60,
  )  # fmt: skip


def process_local(x: np.ndarray, sharding) -> jax.Array:
  """``x`` laid out by ``sharding``, from the block of it this process holds (as a data loader would)."""
  index = list(sharding.addressable_devices_indices_map(x.shape).values())
  block = tuple(
    slice(min(i[d].indices(n)[0] for i in index), max(i[d].indices(n)[1] for i in index)) for d, n in enumerate(x.shape)
  )
  return jax.make_array_from_process_local_data(sharding, x[block], x.shape)


def main(port: int, process_id: int, seed: int) -> None:
  join(port, process_id)
  try:
    run_checks(seed)
  finally:
    jax.distributed.shutdown()


def run_checks(seed: int) -> None:
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_dos

  assert jax.process_count() == NUM_PROCESSES and jax.device_count() == NUM_PROCESSES * LOCAL_DEVICES
  # XLA's CPU client got enough pool threads for this process's devices (jax_dos/memory/cpu_client.py), or it can hang.
  assert int(os.environ["PJRT_NPROC"]) >= jax_dos.memory.cpu_client.pool_threads(LOCAL_DEVICES, 1), os.environ[
    "PJRT_NPROC"
  ]
  # Both processes run on this host: its RAM must hold what both need.
  assert jax_dos.memory.host_ram.bytes_on_this_host(2**20 * (1 + jax.process_index())) == (3 * 2**20, NUM_PROCESSES)
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(NUM_PROCESSES, LOCAL_DEVICES), ("data", "model"))
  local = jax.local_devices()[0]
  specs = {"fsdp": P("data", "model"), "rows": P("data"), "table": P(), "replicated": P(), "vec": P("model")}
  shapes = {"fsdp": (8, 6), "rows": (4, 3), "table": (4, 3), "replicated": (8,), "vec": (8,)}
  layouts = {"fsdp": ("fsdp", "rows", "vec"), "data_parallel": ("table", "replicated", "vec")}
  rng = np.random.default_rng(seed)

  def global_array(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``x`` (the same on every process) laid out by ``sharding``, from the shards this process addresses."""
    index = sharding.addressable_devices_indices_map(x.shape)
    shards = [jax.device_put(x[i], d) for d, i in index.items()]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)

  def check_shards(got: jax.Array, want: np.ndarray, what: str) -> float:
    assert not got.is_fully_addressable, what
    worst = 0.0
    for shard in got.addressable_shards:
      x, y = np.asarray(shard.data, np.float64), np.asarray(want[shard.index], np.float64)
      if y.size:
        worst = max(worst, float(np.max(np.abs(x - y)) / max(1.0, float(np.max(np.abs(y))))))
    assert worst <= 1e-6, (what, worst)
    return worst

  def check(layout: str, label: str, tx, update_params: bool = False) -> None:
    """Five eager steps of ``tx`` against ``optax.adamw`` from the same start and gradients; checks every shard.

    Partitioned (the default, on this mesh every leaf is), each process must hold only its share (1/P) of every
    leaf's state; with ``partition_replicated=False`` the state keeps the parameters' layout.
    """
    names = layouts[layout]
    shardings = {k: NamedSharding(mesh, specs[k]) for k in names}
    values = {k: rng.standard_normal(shapes[k]).astype(np.float32) for k in names}
    params = {k: process_local(values[k], shardings[k]) for k in names}
    ref_params = {k: jax.device_put(values[k], local) for k in names}
    ref = optax.adamw(1e-2, weight_decay=0.1)
    state, ref_state = tx.init(params), ref.init(ref_params)
    for _ in range(5):
      grads = {k: rng.standard_normal(shapes[k]).astype(np.float32) for k in names}
      laid_out = {k: global_array(g, shardings[k]) for k, g in grads.items()}
      if update_params:
        params, state = jax_dos.update_params(tx, laid_out, state, params)
      else:
        updates, state = tx.update(laid_out, state, params)
        params = optax.apply_updates(params, updates)
      ref_updates, ref_state = ref.update({k: jnp.asarray(g, device=local) for k, g in grads.items()}, ref_state,
                                          ref_params)  # fmt: skip
      ref_params = optax.apply_updates(ref_params, ref_updates)
    jax_dos.wait_for_host_updates()
    err = max(check_shards(params[k], np.asarray(ref_params[k]), f"{layout} {label} {k}") for k in names)
    for k in names:
      check_shards(state.master[k], np.asarray(ref_params[k]), f"{layout} {label} master {k}")
      if tx.interleaved.partitions:
        for tree in (state.master, state.mu, state.nu):
          held = sum(shard.data.size for shard in tree[k].addressable_shards)
          assert held * NUM_PROCESSES == np.prod(shapes[k]), (label, k, held)
      else:
        kind = state.master[k].sharding.memory_kind
        assert state.master[k].sharding.is_equivalent_to(shardings[k].with_memory_kind(kind), len(shapes[k])), k
      assert params[k].sharding.is_equivalent_to(shardings[k], len(shapes[k])), k
    print("ok", layout, label, err, flush=True)

  adamw = functools.partial(jax_dos.interleaved_adam, 1e-2, weight_decay=0.1, subgroup_size=1)
  for layout in layouts:
    for plan in ["device", "stream", "host", ["host", "stream", "device"]]:
      check(layout, str(plan), adamw(plan=plan))
    check(layout, "update_params", adamw(plan=["host", "stream", "device"]), update_params=True)
    check(layout, "write_behind", adamw(plan="host", write_behind=True))
    check(layout, "delay_predict=gradient", adamw(plan="host", delay=1, delay_warmup=2, delay_predict="gradient"))
    # Processes that plan differently (here: their resident budgets) agree on one plan, the leaner per subgroup.
    budget = 2**20 if jax.process_index() == 0 else 0
    tx = adamw(plan="auto", planner=jax_dos.auto_planner(resident_budget_bytes=budget, staging_budget_bytes=2**20))
    check(layout, "auto", tx)
    plan = jax_dos.get_plan(tx, {k: jax.ShapeDtypeStruct(shapes[k], jnp.float32) for k in layouts[layout]})
    assert "device" not in plan.placements, plan
    assert plan.source.endswith("+processes") == (jax.process_index() == 0), plan.source  # process 0 gave way
    print("plan", layout, plan.placements, flush=True)
  # Whole copies (partition_replicated=False): each device keeps the state of the shard its parameter holds.
  copies = functools.partial(adamw, partition_replicated=False)
  for plan in ["device", "stream", "host", ["host", "stream", "device"]]:
    check("data_parallel", f"copies {plan}", copies(plan=plan))
  mixed = ["host", "stream", "device"]
  check("data_parallel", "copies update_params", copies(plan=mixed), update_params=True)
  check("fsdp", "copies", copies(plan=mixed))
  refuse_together(mesh)
  worker_programs_have_no_collectives(mesh)


def refuse_together(mesh) -> None:
  """Processes told different things about their host (process 0: no RAM) refuse the plan together, from shapes:
  one refusing alone would leave the other waiting in the next collective. A tree of one process alone is checked
  without the others (no collective), or process 0 would take the others' next collective for its own."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  import jax_dos

  if jax.process_index() == 0:  # a tree of this process alone (as the calibration's) is planned without the others
    jax_dos.get_plan(jax_dos.interleaved_adam(1e-2, plan="host"), {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32)})
  params = {"w": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))}
  host = jax_dos.HostMemory(ram_bytes=1 if jax.process_index() == 0 else 1 << 40, processes=NUM_PROCESSES)
  try:
    jax_dos.get_plan(jax_dos.interleaved_adam(1e-2, plan="host", host_memory=host), params)
  except MemoryError as e:
    print("ok refused together:", e, flush=True)
  else:
    raise AssertionError("this process planned while another refused its plan")


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")


def worker_programs_have_no_collectives(mesh) -> None:
  """The engine's host worker dispatches, beside the caller's programs and in an order that timing decides, only
  programs without collectives: the new masters' send and their cast into the parameters, on the state's own
  (partitioned) layout. The caller's gather back to the parameters' layout is where the collective is."""
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_dos.core import partition
  from jax_dos.optimizer import device_steps

  param = jax.ShapeDtypeStruct((8, 6), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model")))
  state = partition.state_sharding(param)
  host = jax.ShapeDtypeStruct(param.shape, jnp.bfloat16, sharding=state.with_memory_kind("pinned_host"))
  on_state = jax.ShapeDtypeStruct(param.shape, jnp.bfloat16, sharding=state)

  def collectives(lowered) -> list[str]:
    text = lowered.compile().as_text()
    return [c for c in COLLECTIVES if c in text]

  send = jax.jit(lambda x: x, out_shardings=state.with_memory_kind("device"))  # jax's device_put of the send
  assert collectives(send.lower(host)) == [], "the send"
  assert collectives(device_steps.assign.lower([on_state], [on_state])) == [], "the assign"
  master = jax.ShapeDtypeStruct(param.shape, jnp.float32, sharding=state)
  assert collectives(device_steps.updates_from_masters.lower([master], [on_state])) == [], "the update"
  gather = jax.jit(lambda x: x, out_shardings=param.sharding)  # the caller's relaid back: the collective
  assert "all-gather" in collectives(gather.lower(on_state)), "the gather back"
  print("ok worker programs without collectives", flush=True)


if __name__ == "__main__":
  main(*(int(a) for a in sys.argv[1:4]))
