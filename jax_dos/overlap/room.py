"""The room beside the overlapped step's own peak where the parameters are sharded: sized from its stage programs.

The plain step is one program over the whole model, and its peak (``planning.budgets.StepMemory``, ``P``) sizes the
room beside it (``Plan.step_room_bytes``, ``F - P``). Where the parameters are sharded (``fsdp``), XLA hoists the
all-gathers of many layers in that program, and its peak is not the overlapped step's, whose programs each hold one
stage's gathered weights (the 30B GPT on four H100s: 69.6 GiB a device for the plain program, 31.2 GiB in use at
most by the overlapped step). There the overlapped step's room is its own (:func:`stage_room`), per device::

    room = U - ((1 + TEMP_MARGIN) T + G + b + k' c)

* ``U``: the accelerator bytes the step may take beside what was allocated when planning (the parameters' shards),
  ``(1 - STEP_MARGIN) F`` (``Plan.step_usable_bytes``, ``planning.budgets``: 8 % of the free memory kept back);
* ``T``: the largest stage backward program's temporaries under ``"full"`` (``StageTimes.temp_bytes``, measured:
  ``memory_analysis()`` of the compiled programs). On a sharded mesh they hold the stage's gathered weights and
  their gradients before the reduce-scatter; a backward program under ``"full"`` recomputes its forward pass, so
  they hold the forward program's too. A policy other than ``"full"`` adds its saved residuals and any growth of
  ``T`` on top (``StageTimes.extra_activation_bytes``, as beside the plain program's peak);
* ``G``: every parameter's gradient, the shard a device holds in the gradients' layout. Resident subgroups' are
  held until the clip decision, at the end of the backward pass; streamed ones' until the stream worker ends the
  step (kept for the redo of a fired clip), which may be late in the next forward pass, whose stage inputs are then
  alive: ``G`` and ``b`` are counted at once. Host subgroups' leave at the hand-over, but which subgroups go to the
  host is the timeline's choice, made after the room; and in the ``"batch"`` order every group's running sum is
  alive between micro-batches. So all of them are counted;
* ``b``: one micro-batch's stage inputs (``StageTimes.boundary_bytes``), as the plain program's peak holds them; the
  ``"stage"`` order's other ``k - 1`` micro-batches' come out of the room afterwards, as beside the plain peak
  (``overlap.plan.room_beside_step``'s ``boundary_bytes``);
* ``c``: the largest cotangent a micro-batch's backward pass carries between stages (``StageTimes.cotangent_bytes``),
  ``k' = k`` of them in the ``"stage"`` order (each micro-batch's is alive through the backward pass), one in the
  ``"batch"`` order.

The margin: ``STEP_MARGIN`` of ``F`` (fragmentation, as the plain step's budgets keep), and ``TEMP_MARGIN`` more of
``T``: a stage program dispatched ahead (``run_ahead_stages``) where the allocator does not hand the running one's
temporaries on in stream order, and what one program's analysis does not see (the workers' update programs'
temporaries, a subgroup's gradients or weights copied at the hand-over). Beyond the margins the sum errs toward
holding less: ``G`` and ``b`` at their highest at once, host gradients counted.

Resident state and the streamed subgroups in flight then fit that room (``overlap.plan.room_beside_step``), resident
up to every parameter: the plain plan's resident share, sized beside the plain program's peak, does not bound it.
Where the parameters are whole on every device (one device, ``data`` only), or ``T`` or ``U`` is unknown, the room
stays the plain program's (:func:`stage_room` returns ``None``).
"""

from __future__ import annotations

import dataclasses

from jax_dos.timeline import StageTimes

# Of the largest stage program's temporaries, how many more the room keeps back (the module docstring's margin).
TEMP_MARGIN = 1


@dataclasses.dataclass(frozen=True)
class StageRoom:
  """The terms of :func:`stage_room`, bytes per device: ``usable`` (``U``) and what the step's peak takes of it."""

  usable: int
  temporaries: int  # (1 + TEMP_MARGIN) T
  gradients: int  # G
  stage_inputs: int  # b
  cotangents: int  # k' c

  @property
  def peak(self) -> int:
    """The overlapped step's peak beside the parameters, its resident state and its streamed subgroups in flight."""
    return self.temporaries + self.gradients + self.stage_inputs + self.cotangents

  @property
  def room(self) -> int:
    """``U`` less the peak, at least 0."""
    return max(0, self.usable - self.peak)

  def terms(self) -> tuple[tuple[str, int], ...]:
    """``Plan.step_room_terms``: the usable bytes, then each term taken from them."""
    return (
      ("usable", self.usable),
      ("gradients", self.gradients),
      (f"stage temporaries x{1 + TEMP_MARGIN}", self.temporaries),
      ("a micro-batch's stage inputs", self.stage_inputs),
      ("cotangents", self.cotangents),
    )


def stage_room(
  usable: int | None, times: StageTimes | None, gradient_bytes: int, sharded: bool, micro_batches: int, order: str
) -> StageRoom | None:
  """The room beside the overlapped step's own peak (the module docstring), or ``None`` where the plain program's
  stands: parameters whole on every device (``sharded`` false), no usable bytes known (``usable``), or no stage
  program's temporaries measured (``times.temp_bytes`` 0). ``gradient_bytes``: ``G``, every parameter's gradient
  shard on one device."""
  if not sharded or usable is None or times is None or times.temp_bytes <= 0:
    return None
  k = micro_batches if order == "stage" else 1
  return StageRoom(
    usable=int(usable),
    temporaries=(1 + TEMP_MARGIN) * int(times.temp_bytes),
    gradients=int(gradient_bytes),
    stage_inputs=int(times.boundary_bytes),
    cotangents=k * int(times.cotangent_bytes),
  )
