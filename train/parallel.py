"""The training script on several devices and processes: joining the job, the mesh, and how arrays lie on it.

* :func:`join_from_environment` calls ``jax.distributed.initialize`` when the
  environment describes a job of several processes: an explicit coordinator
  (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; and
  ``JAX_LOCAL_DEVICE_IDS`` to give a process some of this host's GPUs), or a
  SLURM step of several tasks (which ``jax.distributed.initialize`` reads
  itself, one GPU per task); then caps each process's pinned pool at its share
  of the host's RAM (``jax_dos.share_pinned_pool``).
* ``--mesh data=D,fsdp=F`` (:func:`parse_mesh`) lays all devices of the job on
  a ``(data, fsdp)`` mesh: parameters are replicated over ``data`` and sharded
  over ``fsdp`` (:func:`param_shardings`), batch rows over both
  (:func:`batch_sharding`). The optimizer's state of a parameter replicated
  over ``data`` is partitioned over it (``jax_dos.interleaved_adam``'s default).
* Each process reads only its own rows of a batch (:func:`process_rows`,
  :func:`global_batch`): the global batch is the same for any number of
  processes, so a run's numbers do not depend on how it was launched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dos

MESH_AXES = ("data", "fsdp")
COORDINATOR_VARS = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


def join_from_environment(environ: dict[str, str] | None = None) -> bool:
  """Joins the job's other processes (``jax.distributed.initialize``) if the environment names several; whether it did.

  Must run before jax starts a backend. An explicit coordinator needs all of
  ``COORDINATOR_VARS``; a SLURM step of more than one task is detected as
  ``jax.distributed.initialize`` does. On CPUs the collectives are gloo's.
  """
  env = os.environ if environ is None else environ
  given = [v for v in COORDINATOR_VARS if env.get(v)]
  if given and len(given) < len(COORDINATOR_VARS):
    missing = [v for v in COORDINATOR_VARS if v not in given]
    raise SystemExit(
      f"error: {', '.join(given)} set but not {', '.join(missing)}: an explicit coordinator needs all of"
      f" {', '.join(COORDINATOR_VARS)} (or none of them, under SLURM or for one process)."
    )
  slurm = all(v in env for v in SLURM_VARS) and int(env["SLURM_NTASKS"]) > 1
  if not given and not slurm:
    return False
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes; no effect on accelerators
  if given:
    jax.distributed.initialize(
      env["JAX_COORDINATOR_ADDRESS"], int(env["JAX_NUM_PROCESSES"]), int(env["JAX_PROCESS_ID"])
    )
  else:
    jax.distributed.initialize()
  jax_dos.share_pinned_pool()  # each process's pinned pool capped at its share of this host's RAM
  return True


def parse_mesh(text: str) -> dict[str, int]:
  """``"data=2,fsdp=1"`` -> ``{"data": 2, "fsdp": 1}`` (an axis not named has size 1); ``ValueError`` if malformed."""
  sizes = dict.fromkeys(MESH_AXES, 1)
  seen = set()
  for part in text.split(","):
    name, eq, value = part.strip().partition("=")
    if not eq or name not in MESH_AXES or name in seen or not value.isdigit() or int(value) < 1:
      raise ValueError(
        f"--mesh {text!r}: give axis sizes as data=D,fsdp=F (axes {', '.join(MESH_AXES)}, each once, sizes >= 1),"
        " e.g. --mesh data=2 or --mesh data=2,fsdp=4."
      )
    seen.add(name)
    sizes[name] = int(value)
  return sizes


def default_mesh() -> dict[str, int] | None:
  """The mesh without ``--mesh``: every device data-parallel in a job of several processes, else none (one device)."""
  return {"data": jax.device_count(), "fsdp": 1} if jax.process_count() > 1 else None


def make_mesh(sizes: dict[str, int]) -> Mesh:
  """All devices of the job as a ``(data, fsdp)`` mesh; ``fsdp`` varies fastest (within a process where it fits)."""
  shape = tuple(sizes[a] for a in MESH_AXES)
  return Mesh(np.array(jax.devices()).reshape(shape), MESH_AXES)


def param_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
  """Replicated over ``data``; over ``fsdp`` along the first dimension it divides (replicated if none)."""
  n = mesh.shape["fsdp"]
  spec = [None] * len(shape)
  for d, size in enumerate(shape):
    if n > 1 and size % n == 0:
      spec[d] = "fsdp"
      break
  return NamedSharding(mesh, P(*spec))


def param_shardings(mesh: Mesh, abstract: Any) -> Any:
  """:func:`param_sharding` of every leaf of ``abstract`` (arrays or ``ShapeDtypeStruct`` s)."""
  return jax.tree.map(lambda x: param_sharding(mesh, tuple(x.shape)), abstract)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch rows over every device (``data`` and ``fsdp``), sequences whole."""
  return NamedSharding(mesh, P(MESH_AXES))


def process_rows(sharding: NamedSharding, rows: int) -> slice:
  """The rows of a ``rows``-row batch laid out by ``sharding`` that this process's devices hold (one block)."""
  index = sharding.addressable_devices_indices_map((rows,)).values()
  bounds = [i[0].indices(rows)[:2] for i in index]
  return slice(min(lo for lo, _ in bounds), max(hi for _, hi in bounds))


def global_batch(read: Callable[[slice], tuple[np.ndarray, np.ndarray]], sharding: NamedSharding, rows: int) -> tuple:
  """A ``rows``-row batch as global arrays laid out by ``sharding``; ``read(rows_slice)`` reads this process's rows."""
  mine = process_rows(sharding, rows)
  return tuple(jax.make_array_from_process_local_data(sharding, part, (rows, *part.shape[1:])) for part in read(mine))
