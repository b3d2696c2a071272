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
flight, so at most one copy exists. Accelerator-resident arrays need no guard,
but an asynchronous save has Orbax copy every one of them to host memory before
``save`` returns, and on a GPU the guarded copies once more (``np.asarray`` of a
``pinned_host`` shard is a copy there): an asynchronous save can add up to
``2 * host + accelerator`` bytes to the host's memory (:func:`async_added_bytes`).

``host_copy="auto"`` (the default) therefore saves asynchronously only where
that bound is at most the save's batch (``save_batch_bytes``, 8 GiB) and the
copy fits in half the available host memory; otherwise it saves synchronously
(``"block"``), Orbax copying a batch at a time (``transfers.py``), so that any
save adds at most about a batch. The rule before this one copied whenever the
host state fit in half the available memory: the 13B GPT on two H100s (110 GiB
of host state, 250 GiB available) spent over two minutes copying before its
first byte was written, and its save grew the process to the host's limit
(``bench/results/large_models-h100x4/gpt13b_save_stopped/``).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import jax

from jax_dos.checkpoint.processes import any_process
from jax_dos.memory import host_copies, host_ram

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


def held_bytes(trees: Any) -> tuple[int, int]:
  """``(host, accelerator)``: the bytes of ``trees``' host-resident arrays and of the others this process holds."""
  host = device = 0
  for x in jax.tree.leaves(trees):
    if aliases_host(x):
      host += process_bytes(x)
    else:
      device += process_bytes(x)
  return host, device


def async_added_bytes(host: int, device: int) -> int:
  """The most an asynchronous save adds to this process's host memory, for ``host`` and ``accelerator`` bytes
  (:func:`held_bytes`): the guard's copies of the host-resident arrays, Orbax's copies of every array."""
  return 2 * host + device


def saves_asynchronously(async_save: bool, host_copy: HostCopy, added: int, batch_bytes: int) -> bool:
  """Whether a save whose asynchronous form adds ``added`` bytes is asynchronous: ``"auto"`` where ``added`` is at
  most a batch (``batch_bytes``), ``"copy"`` always (:func:`guard_mode` also blocks ``"auto"`` where the host state
  does not fit half the available memory)."""
  return async_save and (host_copy == "copy" or (host_copy == "auto" and added <= batch_bytes))


def guard_mode(trees: Any, async_save: bool, host_copy: HostCopy, batch_bytes: int, warn: bool = True) -> str:
  """``"none"``, ``"copy"`` or ``"block"``: how a save guards ``trees``' host-resident arrays (module docstring).
  ``batch_bytes``: the save's batch (``save_batch_bytes``), which ``"auto"`` keeps an asynchronous save within;
  ``warn``: say so (once a manager) where ``"auto"`` blocks.

  With several processes a collective: all block if one does (a process blocking alone would wait at a barrier
  the others pass only at their next call).
  """
  if not async_save:
    return "none"
  host_bytes, device_bytes = held_bytes(trees)
  added = async_added_bytes(host_bytes, device_bytes)
  fits = host_copy != "auto" or host_bytes <= host_ram.host_memory_available() // 2
  mode = "copy" if saves_asynchronously(async_save, host_copy, added, batch_bytes) and fits else "block"
  if mode == "block" and host_copy == "auto" and warn:
    log.warning(
      "checkpoint: an asynchronous save of this state could add %.2f GiB of host memory, more than a save's"
      " batch (%.2f GiB): saves are waited for, copied to host memory a batch at a time.",
      added / 2**30, batch_bytes / 2**30,
    )  # fmt: skip
  if mode == "copy" and host_bytes == 0:
    mode = "none"
  return "block" if any_process(mode == "block") else mode


def guarded(trees: Any, mode: str) -> Any:
  """``trees`` as Orbax may hold them: with ``mode == "copy"`` each host-resident array replaced by a fresh copy
  (``host_copies.snapshot``, by all cores, finished before this returns); otherwise as they are."""
  if mode != "copy":
    return trees
  jax.block_until_ready(trees)  # what is copied must be computed
  return jax.tree.map(lambda x: host_copies.snapshot(x) if aliases_host(x) else x, trees)
