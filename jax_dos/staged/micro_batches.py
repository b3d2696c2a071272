"""A step's micro-batches: each one's part of the batch, and the order the stages' programs run them in.

``micro_batch`` cuts the batch into ``k`` equal consecutive parts (laid out as the batch is, on a mesh);
``schedule`` lists a step's programs in dispatch order, in the ``"stage"`` order (every micro-batch through a stage
before the next stage) or the ``"batch"`` order (one micro-batch's forward and backward passes after another):
``jax_dos.planning.timeline.MICRO_BATCH_ORDERS``.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_dos.planning.timeline import MICRO_BATCH_ORDERS


def schedule(stages: int, micro_batches: int, order: str) -> list[tuple[str, int, int]]:
  """A step's programs in dispatch order: ``(kind, stage, micro_batch)``, ``kind`` ``"forward"`` or ``"backward"``.

  The last stage has no forward program (its backward pass computes the
  loss). In both orders stage ``i``'s backward program of the last
  micro-batch (``micro_batches - 1``) is the one that completes the groups
  ``i`` completes.
  """
  if order not in MICRO_BATCH_ORDERS:
    raise ValueError(f"micro_batch_order must be one of {MICRO_BATCH_ORDERS}, got {order!r}.")
  forward = lambda m: [("forward", i, m) for i in range(stages - 1)]  # noqa: E731
  backward = lambda m: [("backward", i, m) for i in reversed(range(stages))]  # noqa: E731
  if order == "batch":
    return [p for m in range(micro_batches) for p in (*forward(m), *backward(m))]
  stage_major = lambda programs: [(kind, i, m) for kind, i, _ in programs for m in range(micro_batches)]  # noqa: E731
  return stage_major(forward(0)) + stage_major(backward(0))


def micro_batch(batch: Any, m: int, micro_batches: int) -> Any:
  """Micro-batch ``m`` of ``micro_batches`` equal consecutive parts of ``batch`` along its leading axis.

  On a mesh (a leaf with a ``NamedSharding``) each part is laid out as the
  whole batch is, its rows over every device, as the plain accumulated step
  lays out its parts: each device computes on its rows of every micro-batch.
  """
  if micro_batches == 1:
    return batch
  n = jax.tree.leaves(batch)[0].shape[0] // micro_batches

  def part(x):
    y = x[m * n : (m + 1) * n]
    sharding = getattr(x, "sharding", None)
    return jax.device_put(y, sharding) if isinstance(sharding, jax.sharding.NamedSharding) else y

  return jax.tree.map(part, batch)
