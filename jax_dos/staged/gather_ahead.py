"""Sharded weights gathered one stage ahead: a backward program all-gathers the next backward program's weights.

Where a stage's parameters are sharded over the mesh (``fsdp``), its programs compute on them whole: XLA all-gathers
them inside each program, where little can run beside the gather of the weights the first operations need
(``bench/results/gather_probe-h200x2/``: 18.1 % of a 13B GPT block's forward and backward programs on ``fsdp=2``,
the backward program about two gathers' time; a 6.7B block's none, XLA hiding them). Gathered ahead, the gather runs
inside the program before, beside its compute (XLA's latency-hiding scheduler starts the all-gather early and waits
for it late), and the program that uses the weights receives them whole. Whether that is faster depends on the
shapes, so ``StagedModel.measure_times`` times one block both ways (:data:`AHEAD_MARGIN`;
``bench/results/gather_ahead-h200x2/``).

In the backward pass the next stage's weights are already final: nothing updates a stage's weights before its own
backward program has run (a group's update starts once the first stage using it is through its backward pass). So a
backward program whose next program is another stage's backward program gathers that stage's sharded weights
(:func:`ahead_stages`) and returns them whole; the programs of that stage take them instead of their shards, and
under the ``"stage"`` micro-batch order a stage's micro-batches share that one gather. The forward pass gathers as
before: its next stage's weights may still be on their way back from the optimizer, and its programs lose little
to the gather (a third of one, by the same probe).

A gathered weight is whole on every device (:func:`whole_sharding`): the layout an FSDP stage program computes in.
A model whose weights stay sharded in its compute (tensor parallelism over a mesh axis) would gather more than it
needs; the overlapped step's ``gather_ahead=False`` leaves each program to gather what it needs itself.

The cost in memory: one more stage's gathered weights on each device while the program before it runs
(:func:`gathered_bytes`; ``overlap.room`` counts the largest).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# How much faster a block's backward program must run gathering ahead for a step to do so
# (``StagedModel.measure_times``): it holds one more block's weights on each device, and a smaller gain is within the
# timing's noise.
AHEAD_MARGIN = 0.02


def whole_sharding(x: Any) -> NamedSharding | None:
  """``x``'s sharding with every mesh axis dropped (whole on each device, in device memory), or ``None`` where a
  device holds it whole already or its sharding is not a ``NamedSharding``."""
  sharding = getattr(x, "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  return _whole(sharding, tuple(getattr(x, "shape", ())))


@functools.lru_cache(maxsize=4096)
def _whole(sharding: NamedSharding, shape: tuple[int, ...]) -> NamedSharding | None:
  if tuple(sharding.shard_shape(shape)) == shape:
    return None
  return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind="device")


def gather_targets(params: Any) -> tuple[tuple[int, NamedSharding], ...]:
  """``(leaf index, whole sharding)`` of each leaf of ``params`` (flat) that a device does not hold whole."""
  targets = ((j, whole_sharding(x)) for j, x in enumerate(jax.tree.leaves(params)))
  return tuple((j, s) for j, s in targets if s is not None)


def with_gathered(params: Any, targets: Sequence[tuple[int, Any]], gathered: Sequence[jax.Array]) -> Any:
  """``params`` with the leaves ``targets`` names replaced by ``gathered`` (their whole copies, in that order)."""
  leaves, treedef = jax.tree.flatten(params)
  for (j, _), x in zip(targets, gathered, strict=True):
    leaves[j] = x
  return jax.tree.unflatten(treedef, leaves)


def ahead_stages(programs: Sequence[tuple[str, int, int]], gathers: Sequence[bool]) -> list[int | None]:
  """For each program of ``programs`` (``micro_batches.schedule``'s ``(kind, stage, micro_batch)``), the stage whose
  weights it gathers for the programs after it, or ``None``: the next program's stage, where both are backward
  programs of different stages and that stage has weights to gather (``gathers[stage]``)."""
  ahead: list[int | None] = [None] * len(programs)
  for j, ((kind, i, _), (next_kind, after, _)) in enumerate(zip(programs, programs[1:])):
    if kind == next_kind == "backward" and after != i and gathers[after]:
      ahead[j] = after
  return ahead


def gathered_bytes(leaves: Sequence[Any]) -> int:
  """Bytes a device holds of ``leaves`` gathered whole: those it does not hold whole already, at full size."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves if whole_sharding(x) is not None)


class HeldWeights:
  """One step's weights gathered ahead, as its programs run (the training loop's own, for one pass over
  ``programs``): which program gathers which stage's (:func:`ahead_stages`), and the whole weights held from the
  program that gathered them to the last of that stage's programs in a row, then dropped."""

  def __init__(self, programs: Sequence[tuple[str, int, int]], gathers: Sequence[bool]):
    self._programs = list(programs)
    self._ahead = ahead_stages(self._programs, gathers)
    self._held: tuple[int, tuple] | None = None  # (stage, its weights' whole leaves)

  def ahead(self, j: int) -> int | None:
    """The stage whose weights program ``j`` gathers, or ``None``."""
    return self._ahead[j]

  def mine(self, j: int) -> tuple | None:
    """The whole leaves of program ``j``'s stage's weights, where an earlier program gathered them, else ``None``."""
    _, stage, _ = self._programs[j]
    return self._held[1] if self._held is not None and self._held[0] == stage else None

  def ran(self, j: int, gathered: tuple | None) -> None:
    """Program ``j`` was dispatched, returning ``gathered`` (the whole leaves of :meth:`ahead`'s stage, or ``None``):
    they are held for the programs after it, and what no later program takes is dropped."""
    kind, stage, _ = self._programs[j]
    if self._ahead[j] is not None:
      self._held = (self._ahead[j], gathered)
    elif j + 1 == len(self._programs) or self._programs[j + 1][:2] != (kind, stage):
      self._held = None
