"""Host-resident arrays guarded while Orbax writes them: copied first, or saved synchronously.

Orbax's synchronous part of an async save (``save`` returning)
only starts device-to-host copies and then holds ``np.asarray`` of each shard;
for an array on the CPU backend that is a zero-copy view of the live buffer
(checked: overwriting the buffer after ``save`` returns changes what is
written). On a GPU it is a copy for a ``pinned_host`` shard as well (the 13B
save's resident set: docs/checkpoints.md, "Saving on a GPU"), which this guard
does not rely on. jax_dos's eager
``update`` overwrites host state buffers in place, so the next step would race
the writer. ``save`` therefore gives Orbax fresh copies of every host-resident
array (``host_copy="copy"``: ``host_copies.snapshot``, a copy into ordinary
memory by all cores, finished before ``save`` returns; XLA's own host-to-host
copy ran single-threaded at 1.7 GB/s on the H100 machine). The copy costs host
memory equal to the host state until the write ends; at most one save is in
flight, so at most one copy exists. If that copy does not
fit in half the available host memory, ``host_copy="auto"`` (the default)
instead saves synchronously (``"block"``): slower, but never out of memory.
Accelerator-resident arrays need nothing: Orbax copies them to host before
``save`` returns.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import jax

from jax_dos import host_copies, host_ram
from jax_dos.checkpoint.processes import any_process

HostCopy = Literal["auto", "copy", "block"]

log = logging.getLogger(__name__)


def aliases_host(x: Any) -> bool:
  """Whether Orbax would keep a zero-copy view of ``x``'s live buffer."""
  if not isinstance(x, jax.Array):
    return False
  if x.sharding.memory_kind in ("pinned_host", "unpinned_host"):
    return True
  return any(d.platform == "cpu" for d in x.sharding.device_set)


def process_bytes(x: Any) -> int:
  """Bytes of ``x`` held by this process's devices (all of a numpy array)."""
  if isinstance(x, jax.Array):
    return sum(s.data.nbytes for s in x.addressable_shards)
  return int(getattr(x, "nbytes", 0))


def guard_mode(trees: Any, async_save: bool, host_copy: HostCopy) -> str:
  """``"none"``, ``"copy"`` or ``"block"``: how a save guards ``trees``' host-resident arrays (module docstring).

  With several processes a collective: all block if one does (a process blocking alone would wait at a barrier
  the others pass only at their next call).
  """
  if not async_save:
    return "none"
  host_bytes = sum(process_bytes(x) for x in jax.tree.leaves(trees) if aliases_host(x))
  too_much = host_copy == "auto" and host_bytes > host_ram.host_memory_available() // 2
  mode = "none" if host_bytes == 0 else "block" if too_much else host_copy.replace("auto", "copy")
  if too_much:
    log.warning("checkpoint: %.2f GiB of host state is too much to copy; saving synchronously.", host_bytes / 2**30)
  return "block" if any_process(mode == "block") else mode


def guarded(trees: Any, mode: str) -> Any:
  """``trees`` as Orbax may hold them: with ``mode == "copy"`` each host-resident array replaced by a fresh copy
  (``host_copies.snapshot``, by all cores, finished before this returns); otherwise as they are."""
  if mode != "copy":
    return trees
  jax.block_until_ready(trees)  # what is copied must be computed
  return jax.tree.map(lambda x: host_copies.snapshot(x) if aliases_host(x) else x, trees)
