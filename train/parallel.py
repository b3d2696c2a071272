"""The training script on several devices and processes: joining the job, the mesh, and how arrays lie on it.

* :func:`join_from_environment` calls ``jax.distributed.initialize`` when the
  environment describes a job of several processes: an explicit coordinator
  (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``; and
  ``JAX_LOCAL_DEVICE_IDS`` to give a process some of this host's GPUs), or a
  SLURM step of several tasks (which ``jax.distributed.initialize`` reads
  itself, one GPU per task); then caps each process's pinned pool at its share
  of the host's RAM (``jax_dos.share_pinned_pool``).
* Without ``--mesh`` every device of the job trains, data-parallel
  (:func:`default_mesh`): one process drives all of its host's GPUs, as JAX
  does on one host; ``--devices K`` (:func:`select_devices`, before jax
  starts) or ``CUDA_VISIBLE_DEVICES`` takes fewer.
* ``--mesh data=D,fsdp=F`` (:func:`parse_mesh`) lays all devices of the job on
  a ``(data, fsdp)`` mesh: parameters are replicated over ``data`` and sharded
  over ``fsdp`` (:func:`param_shardings`), batch rows over both
  (:func:`batch_sharding`), ``--batch`` rows a device. The optimizer's state of a parameter replicated
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


def select_devices(devices: int | None, environ: dict[str, str] | None = None) -> None:
  """``--devices K``: this process trains on its first ``K`` devices (GPUs, or ``K`` CPU devices on a CPU), set
  before jax starts a backend; nothing for ``None``. A job of several processes gives each process its GPUs itself
  (``JAX_LOCAL_DEVICE_IDS``, ``CUDA_VISIBLE_DEVICES``, SLURM): ``SystemExit`` saying so. Then XLA's CPU client gets
  enough pool threads for the process's CPU devices, however many (``jax_dos.configure_process``'s ``PJRT_NPROC``)."""
  if devices is not None:
    _first_devices(devices, os.environ if environ is None else environ)
  jax_dos.configure_process()  # now that jax_num_cpu_devices is set: PJRT_NPROC for that many


def _first_devices(devices: int, env) -> None:
  """``--devices K`` set before jax starts: the first ``K`` GPUs, or ``K`` CPU devices on a CPU."""
  if any(env.get(v) for v in COORDINATOR_VARS) or (all(v in env for v in SLURM_VARS) and int(env["SLURM_NTASKS"]) > 1):
    raise SystemExit(
      "error: --devices picks the GPUs of one process; in a job of several processes give each process its GPUs"
      " (JAX_LOCAL_DEVICE_IDS or CUDA_VISIBLE_DEVICES) and drop --devices."
    )
  if devices < 1:
    raise SystemExit(f"error: --devices must be >= 1, got {devices}.")
  jax.config.update("jax_cuda_visible_devices", ",".join(map(str, range(devices))))  # of those CUDA shows
  if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", devices)  # on a CPU: that many devices


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
  """The mesh without ``--mesh``: every device of the job data-parallel where it has several (one process of
  several GPUs, or a job of several processes), else none (one device)."""
  return {"data": jax.device_count(), "fsdp": 1} if jax.device_count() > 1 else None


def mesh_line(sizes: dict[str, int] | None, given: bool, rows: int, micro_batches: int, seq_len: int) -> str:
  """The run's devices and batch in one line: how many, the mesh and whether ``--mesh`` gave it, the rows a device
  and the global batch of a step (``rows`` a device a micro-batch, ``micro_batches`` of them)."""
  n = 1 if sizes is None else sizes["data"] * sizes["fsdp"]
  kind = jax.devices()[0].device_kind
  step_rows = rows * n * micro_batches
  batch = f"{rows} rows a device a micro-batch; a step {step_rows} x {seq_len} = {step_rows * seq_len:,} tokens"
  if sizes is None:
    return f"devices 1 x {kind}: {batch}"
  mesh = f"data={sizes['data']}" + (f",fsdp={sizes['fsdp']}" if sizes["fsdp"] > 1 else "")
  how = f"--mesh {mesh}" if given else f"all {n} of the job's, data-parallel (--mesh {mesh}; --devices K for fewer)"
  return f"devices {n} x {kind}, {how}: {batch}"


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
