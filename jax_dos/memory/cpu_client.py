"""XLA's CPU client with several devices in a process: enough threads that a multi-device program always progresses.

The CPU client (jaxlib 0.10) launches each device's part of a multi-device
program as a task on its client thread pool, and that task first takes a slot
of the device's in-flight semaphore (32 computations per device), blocking
its pool thread while the device has 32 computations queued. A part that
reaches a collective holds its thread until every peer part arrives, its
sibling parts on this process's other devices included, and those need pool
threads too. The pool has ``max(cores, local devices)`` threads (``PJRT_NPROC``
replaces the cores): on 2 cores with 2 devices, one launch blocked on a full
semaphore and one part waiting in an all-gather hold both, the sibling part
never runs, and the process hangs in dispatch while its peers wait in the
collective (native stacks of a hung 2-process run: ``Semaphore::Acquire`` under
``ExecuteLaunch`` on one pool thread, ``gloo::allgather`` on the other). The
engine dispatches several small programs per leaf and step, so a process that
runs ahead of a slower peer reaches 32 queued computations in a few steps.

Each Python thread that dispatches can block one launch task per local device,
and the program running holds one thread per local device; a pool of
``(DISPATCHING_THREADS + 1) * devices + 1`` threads always leaves one free.
:func:`size_pool` (which ``jax_dos.configure_process`` calls; importing jax_dos
does not) sets ``PJRT_NPROC`` to that (or to the cores, if more) when the
process has several CPU devices, before the backend starts, unless it is set.
One device per process (a GPU job) launches on the calling thread and never
takes this path.
"""

from __future__ import annotations

import os
import re

POOL_ENV = "PJRT_NPROC"
# Python threads that may dispatch programs at once: the caller, and the overlapped step's host, stream and decider
# workers (the plain engine's host worker is one of them at most).
DISPATCHING_THREADS = 4


def pool_threads(local_devices: int, cores: int | None = None) -> int:
  """Threads the CPU client's pool needs so that ``local_devices`` devices' parts of a program always get one."""
  if cores is None:
    cores = os.cpu_count() or 1
  if local_devices <= 1:
    return cores
  return max(cores, (DISPATCHING_THREADS + 1) * local_devices + 1)


def forced_cpu_devices(xla_flags: str | None = None) -> int:
  """CPU devices per process that ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS`` asks for (1 if none)."""
  flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
  found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", flags)
  return int(found[-1]) if found else 1


def size_pool(local_devices: int | None = None) -> None:
  """Sets ``PJRT_NPROC`` to :func:`pool_threads` for this process's CPU devices, before the backend starts.

  A value the user set is kept; with one device nothing is set. ``jax_dos.configure_process`` calls it.
  """
  from jax._src import xla_bridge

  if POOL_ENV in os.environ or xla_bridge.backends_are_initialized():
    return
  devices = forced_cpu_devices() if local_devices is None else local_devices
  import jax

  devices = max(devices, int(getattr(jax.config, "jax_num_cpu_devices", -1)))
  if devices > 1:
    os.environ[POOL_ENV] = str(pool_threads(devices))
