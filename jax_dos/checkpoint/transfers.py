"""The order of Orbax's copies to host memory during a save: all at once, or in batches of bounded size.

Orbax writes an array from a host copy: ``copy_to_host_async`` then
``np.asarray`` of each shard. On a GPU that is a copy even for an array already
in pinned host memory, and by default Orbax makes every array's copy before it
writes any: a save then holds the host state twice. The 13B GPT on two GPUs
(257 GiB of pinned state on a 503 GiB host) was killed by the kernel 250 s into
its first save, at 485 GiB resident.

:class:`TransferOrder` tells Orbax (its ``ArrayHandler``'s status callback)
which way to go for the next save:

* ``batched = False``: every array's copy starts before ``save`` returns
  (``SYNCHRONOUS``), as Orbax does by default. An asynchronous save needs
  this: after ``save`` returns the next step may overwrite or donate the arrays.
* ``batched = True``: the copies go in batches of at most ``batch_bytes``, each
  batch written before the next is copied (``ASYNCHRONOUS_DEPRIORITIZED`` with
  Orbax's ``save_device_host_concurrent_gb``), so a save adds at most about
  ``batch_bytes`` (or its largest array) to the host's memory. Only for a save
  the caller waits for (``host_copy="block"``, or a synchronous manager): the
  arrays are read after ``save`` returns.

The callback is Orbax's ``SerializationStatusCallback`` protocol (in
``orbax.checkpoint._src``, as its docstring shows it used; orbax-checkpoint
0.12.4 to 0.12.8 tested). ``batched`` is set by the training thread between
saves, while no save is in flight (``CheckpointManager.save`` waits for the
previous one first); Orbax's threads only read it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import jax

DEFAULT_BATCH_BYTES = 8 * 2**30  # a batched save's host copies at a time: large writes, a bounded footprint


def _priorities() -> Any:
  from orbax.checkpoint._src.serialization import types as serialization_types

  return serialization_types.TransferPriority


class TransferOrder:
  """Orbax's status callback for jax arrays: all copies at once, or in batches (module docstring). Records the
  number of arrays copied and not yet written, at most, in the last save (``peak_in_flight``)."""

  def __init__(self) -> None:
    self.batched = False
    self._lock = threading.Lock()  # Orbax calls back from its writer threads
    self._in_flight = 0
    self.peak_in_flight = 0

  def start(self, batched: bool) -> None:
    """Sets the order of the next save (called while no save is in flight)."""
    with self._lock:
      self.batched, self._in_flight, self.peak_in_flight = batched, 0, 0

  def key_priority(self, keypath: Any) -> Any:
    p = _priorities()
    return p.ASYNCHRONOUS_DEPRIORITIZED if self.batched else p.SYNCHRONOUS

  def on_transfer_start(self, keypath: Any) -> None:
    pass

  def on_transfer_end(self, keypath: Any) -> None:
    with self._lock:
      self._in_flight += 1
      self.peak_in_flight = max(self.peak_in_flight, self._in_flight)

  def on_write_end(self, keypath: Any) -> None:
    with self._lock:
      self._in_flight -= 1

  def on_read_start(self, keypath: Any) -> None:  # (restores: nothing to order)
    pass

  def on_read_end(self, keypath: Any) -> None:
    pass


class _QuietBatches(logging.Filter):
  """Drops Orbax's warning that no array's copy is prioritized: in a batched save that is the order asked for."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("No prioritized params found for saving")


_QUIET = _QuietBatches()


def pytree_handler(order: TransferOrder, batch_bytes: int) -> Any:
  """An Orbax ``PyTreeCheckpointHandler`` whose jax arrays are copied to host memory in ``order``, at most
  ``batch_bytes`` at a time when batched. Not through XLA's pinned pool (``enable_pinned_host_transfer=False``:
  docs/checkpoints.md, "Saving on a GPU")."""
  import orbax.checkpoint as ocp
  from orbax.checkpoint._src.metadata import array_metadata_store
  from orbax.checkpoint._src.serialization import type_handler_registry as registries

  registry = registries.create_type_handler_registry(
    *((ty, handler) for ty, handler in registries._DEFAULT_TYPE_HANDLERS if ty is not jax.Array)
  )
  arrays = ocp.type_handlers.ArrayHandler(array_metadata_store=array_metadata_store.Store(), callback=order)
  registry.add(jax.Array, arrays, override=True)
  if _QUIET not in logging.getLogger("absl").filters:
    logging.getLogger("absl").addFilter(_QUIET)
  return ocp.PyTreeCheckpointHandler(
    enable_pinned_host_transfer=False,
    use_compression=False,
    save_device_host_concurrent_gb=batch_bytes / 1e9,
    type_handler_registry=registry,
  )
