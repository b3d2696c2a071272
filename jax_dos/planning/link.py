"""The devices' collective link, measured: what a data-parallel step's reductions and gathers cost (``Collectives``).

A step on a mesh of ``N`` devices reduce-scatters its gradients and all-gathers the new weights
(``docs/scaling.md``). Both move ``(N - 1) / N`` of the bytes over each device's link, at the link's *bus
bandwidth* (NCCL's term): NVLink's 160-181 GB/s on two H100s, a network card's 45 GB/s between hosts. The timeline
prices them from that one figure (``collectives.Collectives.link``), measured here with one all-gather over all of the
mesh's devices, in the process that trains, before the plans are made.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_dos.planning.collectives import Collectives
from jax_dos.planning.host_plan import processes_on_this_host

LINK_PROBE_BYTES = 256 * 2**20  # each device's shard in the probe: large enough for NCCL's bus bandwidth to level off


def measure_link(mesh: Mesh, bytes_per_device: int = LINK_PROBE_BYTES, repeats: int = 3) -> float:
  """Bytes a second each device's link moves each way in an all-gather over all of ``mesh``'s devices.

  The bus bandwidth ``(N - 1) / N x gathered bytes / seconds`` of an all-gather of ``bytes_per_device`` bf16 bytes
  a device, the best of ``repeats`` after one that compiles. It is a collective: every process of a job calls it
  at the same point. One device: ``inf`` (nothing crosses a link).
  """
  n = mesh.devices.size
  if n == 1:
    return math.inf
  if bytes_per_device < 2 or repeats < 1:
    raise ValueError(f"measure_link needs bytes_per_device >= 2 and repeats >= 1, got {bytes_per_device}, {repeats}.")
  flat = Mesh(np.asarray(mesh.devices).reshape(-1), ("link",))
  elements = bytes_per_device // 2 * n
  split = NamedSharding(flat, PartitionSpec("link"))
  shards = jax.jit(lambda: jnp.ones((elements,), jnp.bfloat16), out_shardings=split)
  gather = jax.jit(lambda x: x, out_shardings=NamedSharding(flat, PartitionSpec()))
  x = shards()
  gather(x).block_until_ready()  # compiled, and NCCL's communicators made
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    gathered = gather(x)
    gathered.block_until_ready()
    best = min(best, time.perf_counter() - start)
    del gathered
  return (n - 1) / n * elements * 2 / best


def mesh_collectives(mesh: Mesh | None, link: float | None = None, partitioned: bool = True) -> Collectives | None:
  """The collectives of a data-parallel step over ``mesh``'s devices (``None`` on one device): ``link`` measured
  (:func:`measure_link`) where not given, and the ranks sharing this host's DRAM and cores: this process's devices
  in the mesh times the job's processes on this host (each process drives as many). ``partitioned``: the state
  partitioned over the ranks (``interleaved_adam(partition_replicated=...)``, the default on a mesh)."""
  if mesh is None or mesh.devices.size == 1:
    return None
  mine = sum(d.process_index == jax.process_index() for d in np.asarray(mesh.devices).flat)
  link = measure_link(mesh) if link is None else link
  return Collectives(
    ranks=int(mesh.devices.size), link=link, partitioned=partitioned,
    ranks_per_host=min(int(mesh.devices.size), mine * processes_on_this_host()),
  )  # fmt: skip
