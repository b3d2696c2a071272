"""The room beside the overlapped step's own peak where the parameters are sharded: sized from its stage programs.

The plain step is one program over the whole model, and its peak (``planning.budgets.StepMemory``, ``P``) sizes the
room beside it (``Plan.step_room_bytes``, ``F - P``). Where the parameters are sharded (``fsdp``), XLA hoists the
all-gathers of many layers in that program, and its peak is not the overlapped step's, whose programs each hold one
stage's gathered weights (the 30B GPT on four H100s: 69.6 GiB a device for the plain program, 31.2 GiB in use at
most by the overlapped step). There the overlapped step's room is its own (:func:`stage_room`), per device::

    room = U - ((1 + TEMP_MARGIN) T + A + k' c + max_i (k x_<=i + g_>=i))

* ``U``: the accelerator bytes the step may take beside what was allocated when planning (the parameters' shards),
  ``(1 - STEP_MARGIN) F`` (``Plan.step_usable_bytes``, ``planning.budgets``: 8 % of the free memory kept back);
* ``T``: the largest stage backward program's temporaries under ``"full"`` (``StageTimes.temp_bytes``, measured:
  ``memory_analysis()`` of the compiled programs). On a sharded mesh they hold the stage's gathered weights and
  their gradients before the reduce-scatter; a backward program under ``"full"`` recomputes its forward pass, so
  they hold the forward program's too. A policy other than ``"full"`` adds its saved residuals and any growth of
  ``T`` on top (``StageTimes.extra_activation_bytes``, as beside the plain program's peak);
* ``A``: the largest stage's weights gathered whole ahead of its backward programs (``StepLayout.ahead_bytes``,
  ``jax_dos.staged.gather_ahead``): alive beside the program before it, which gathers them, and its own gathered weights
  (those ``T`` holds as temporaries where they are gathered in the program); 0 where none are gathered ahead;
* ``c``: the largest cotangent a micro-batch's backward pass carries between stages (``StageTimes.cotangent_bytes``),
  ``k' = k`` of them in the ``"stage"`` order (each micro-batch's is alive through the backward pass), one in the
  ``"batch"`` order;
* ``x_<=i``: the inputs of stages ``0..i`` of one micro-batch (``StageTimes.input_bytes``), ``k`` micro-batches'
  in the ``"stage"`` order: alive while the forward pass runs stage ``i`` and while the backward pass does;
* ``g_>=i``: the gradients (each device's shard) of the subgroups whose group a stage ``>= i`` uses: all that may
  be alive then. In the backward pass at stage ``i`` a group's sum exists once the last stage using it has run
  its backward program; resident subgroups keep their gradients until the clip decision, streamed ones until the
  stream worker has stepped them (kept for the redo of a fired clip until it ends the step), which may be in the
  next forward pass; but that pass runs stage ``i`` only once every group a stage ``<= i`` uses is final, so what is
  still held then belongs to groups first used after ``i``. Host subgroups' gradients leave at the hand-over, but
  which subgroups go to the host is the timeline's choice, made after the room: they are counted too.

In the ``"batch"`` order with ``k > 1`` every group's running sum is alive between micro-batches: the last term is
then ``x + g``, every stage input of one micro-batch and every gradient. Without each stage's input measured, every
stage input is counted at every ``i``.

The margin: ``STEP_MARGIN`` of ``F`` (fragmentation, as the plain step's budgets keep), and ``TEMP_MARGIN`` more of
``T``: a stage program dispatched ahead (``run_ahead_stages``) where the allocator does not hand the running one's
temporaries on in stream order, and what one program's analysis does not see (the workers' update programs'
temporaries, a subgroup's gradients or weights copied at the hand-over). Beyond the margins the terms err toward
holding less: host gradients counted, the largest temporaries and cotangents at every stage.

Resident state and the streamed subgroups in flight then fit that room (:func:`room_beside_step`), resident
up to every parameter: the plain plan's resident share, sized beside the plain program's peak, does not bound it.
Where the parameters are whole on every device (one device, ``data`` only), or ``T`` or ``U`` is unknown, the room
stays the plain program's (:func:`stage_room` returns ``None``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax_dos.core import moment_formats
from jax_dos.planning.plan import STAGING_BYTES, STATE_BYTES, Plan
from jax_dos.planning.timeline import StageTimes, stage_ordered_placements

# Of the largest stage program's temporaries, how many more the room keeps back (the module docstring's margin).
TEMP_MARGIN = 1


@dataclasses.dataclass(frozen=True)
class StageRoom:
  """The terms of :func:`stage_room`, bytes per device: ``usable`` (``U``) and what the step's peak takes of it, the
  stage inputs and gradients at the stage where together they are the most (``at``)."""

  usable: int
  temporaries: int  # (1 + TEMP_MARGIN) T
  cotangents: int  # k' c
  stage_inputs: int  # k x_<=i at the stage i where the sum is largest
  gradients: int  # g_>=i there
  at: int  # that stage
  gathered_ahead: int = 0  # A

  @property
  def peak(self) -> int:
    """The overlapped step's peak beside the parameters, its resident state and its streamed subgroups in flight."""
    return self.temporaries + self.gathered_ahead + self.cotangents + self.stage_inputs + self.gradients

  @property
  def room(self) -> int:
    """``U`` less the peak, at least 0."""
    return max(0, self.usable - self.peak)

  def terms(self) -> tuple[tuple[str, int], ...]:
    """``Plan.step_room_terms``: the usable bytes, then each term taken from them."""
    return (
      ("usable", self.usable),
      (f"stage temporaries x{1 + TEMP_MARGIN}", self.temporaries),
      *((("weights gathered ahead", self.gathered_ahead),) if self.gathered_ahead else ()),
      ("cotangents", self.cotangents),
      (f"stage inputs at stage {self.at}", self.stage_inputs),
      ("gradients", self.gradients),
    )


def stage_room(
  usable: int | None, times: StageTimes | None, gradient_bytes: Sequence[int], last_stages: Sequence[int],
  sharded: bool, micro_batches: int, order: str, ahead_bytes: int = 0,
) -> StageRoom | None:  # fmt: skip
  """The room beside the overlapped step's own peak (the module docstring), or ``None`` where the plain program's
  stands: parameters whole on every device (``sharded`` false), no usable bytes known (``usable``), or no stage
  program's temporaries measured (``times.temp_bytes`` 0). ``gradient_bytes`` and ``last_stages``: each subgroup's
  gradient shard on one device, and the last stage using its group; ``ahead_bytes``: ``A``."""
  if not sharded or usable is None or times is None or times.temp_bytes <= 0:
    return None
  n, k = len(times.forward), micro_batches
  per_stage = times.input_bytes or (0,) * n
  unmeasured = 0 if times.input_bytes else times.boundary_bytes  # every stage input, at every stage
  copies = k if order == "stage" else 1
  rows = []
  for i in range(n):
    inputs = copies * (sum(per_stage[: i + 1]) + unmeasured)
    grads = sum(g for g, last in zip(gradient_bytes, last_stages) if last >= i)
    if order == "batch" and k > 1:  # every running sum between micro-batches, one micro-batch's inputs
      inputs, grads = sum(per_stage) + unmeasured, sum(gradient_bytes)
    rows.append((inputs + grads, i, inputs, grads))
  _, at, inputs, grads = max(rows)
  return StageRoom(int(usable), (1 + TEMP_MARGIN) * int(times.temp_bytes), copies * int(times.cotangent_bytes),
                   int(inputs), int(grads), at, int(ahead_bytes))  # fmt: skip


def device_bytes(moments: str) -> tuple[float, float]:
  """Accelerator bytes a parameter of ``moments`` takes resident and streamed in flight (``STATE_BYTES`` and
  ``STAGING_BYTES`` with float32 moments; the plain planner counts the same)."""
  state = moment_formats.state_bytes_per_param(moments)
  return state, STAGING_BYTES - STATE_BYTES + state


def room_beside_step(
  whole: Plan,
  per_device: float,
  sizes: tuple[int, ...],
  forward_order: list[int],
  max_slots: int,
  boundary_bytes: int = 0,
  moments: str = "float32",
  most: int | None = None,
) -> tuple[int, int]:
  """Parameters to keep resident and streamed subgroups in flight, so that both fit beside the step's peak.

  The plain plan holds its streaming slots only in the update phase, after
  the activations are gone; here they are in flight during the backward
  pass, at the step's peak. So resident state and ``slots x STAGING_BYTES x``
  the largest subgroup that is not resident (per device; both with the bytes
  of ``moments``' state) must fit the room
  beside that peak (``whole.step_room_bytes``, less ``boundary_bytes``: the
  stage inputs the plain step's peak does not hold): the resident share
  shrinks, and the slots only where the room cannot hold them all (down to
  one). Resident subgroups are the first ``resident`` elements in forward
  order, so the largest one left out grows as the share shrinks: the share is
  shrunk until it holds (a few rounds). Room unknown: the plain plan's share
  and ``max_slots``. ``per_device``: the elements of state one device holds
  a parameter (``StepLayout.device_share``: ``1/N`` partitioned over ``N``).
  ``most``: resident elements at most, the plain plan's share where not
  given; every parameter where the room is the stage programs' own
  (``overlap.room``: the plain plan's share was sized beside another peak).
  """
  resident, total, slots = whole.elements("device") if most is None else most, sum(sizes), max_slots
  if whole.step_room_bytes is None:
    return resident, slots
  state, staging = device_bytes(moments)
  room, cap = max(0, whole.step_room_bytes - boundary_bytes), resident
  if resident >= total and state * total * per_device <= room:
    return resident, slots
  for _ in range(len(sizes)):
    kept = stage_ordered_placements(forward_order, sizes, cap, 0)
    largest = max((n for n, p in zip(sizes, kept) if p != "device"), default=0)
    slot = staging * largest * per_device
    slots = max(1, min(max_slots, int(room // slot))) if slot else max_slots
    smaller = int(min(resident, max(0.0, (room - slots * slot) / state) / per_device))
    if smaller >= cap:
      break
    cap = smaller
  return cap, slots
