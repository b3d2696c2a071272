"""Budgets: the accelerator memory a plan may use, per device, for resident state, staging and copies sent ahead.

Budgets come from the accelerator memory free when planning (``memory_stats``:
``bytes_limit - bytes_in_use``, smallest over local devices). Given the
training step's own needs (:class:`StepMemory`, read from its compiled
program), they are exact: with ``F`` the free memory less an 8% margin, ``P``
the step's peak, ``L`` what it keeps alive through the update (gradients left
on the accelerator), ``g`` the bytes of a gradient element and ``U`` the 4 B
of a float32 update per parameter::

    resident <= F - P                                  (forward/backward: state beside activations)
    resident + max(0, resident g/12 - L) + staging     (update: activations gone, fp32 updates made,
        <= F - L - U N - R                              resident gradients back from the host unless
                                                        the step kept them on the accelerator, in L)

with ``R`` what the update holds for a state partitioned over ``data`` while its parameters are replicated: the
new weights' shards, ``p N`` with ``p`` the parameters' itemsize, beside the weights gathered from them (which
replace the old weights the update consumes), or, without ``params_in_place``, the float32 updates gathered back
to the parameters' layout. On two H200s the 13B GPT's plain step, planned without it, ran out of memory in its
first all-gather.

``(1 - STEP_MARGIN) F`` itself is kept (``Budgets.usable``, ``Plan.step_usable_bytes``) where no resident budget is
given: an overlapped step whose parameters are sharded sizes its room from it beside its own stage programs' peak,
not ``P`` (``overlap.room``).

``U`` is 0 with ``params_in_place`` (``jax_dos.update_params`` makes no update
tree), and two streaming slots are kept unless the whole state fits.

With ``ahead_bytes`` (``delay_predict="gradient"``) the budgets are the same,
and what both phases leave free beside them becomes the *ahead* budget: state
copies (3 x the itemsize per parameter) of as many host subgroups as fit are
sent ahead and held through the forward/backward pass, the others cross in
``update`` (6 B a bfloat16 parameter of PCIe there). The copies never take
room from resident state: at 6.7B on an 80 GB GPU all of them did, and the
host could then not hold the state (``BENCHMARKS.md``).

Without the step's needs, the resident budget is ``resident_fraction`` (0.4)
of the free memory, a guess that must leave room for activations (with
``ahead_bytes``, room for every host subgroup's copies too, all sent ahead),
and the staging budget ``staging_fraction`` (0.5) of what is left. With no
accelerator memory statistics (the CPU backend) the resident budget is 0 and
staging is unbounded, so ``"auto"`` still makes an offloaded plan there.
Explicit budgets always win.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from jax_dos.memory import kinds as memory
from jax_dos.planning.cost_model import DEFAULT_MAX_STREAM_SLOTS, Calibration
from jax_dos.planning.plan import STAGING_BYTES, STATE_BYTES

DEFAULT_RESIDENT_FRACTION = 0.4
DEFAULT_STAGING_FRACTION = 0.5
UPDATE_BYTES = 4  # the fp32 update per parameter that tx.update returns (none with jax_dos.update_params)
STEP_MARGIN = 0.08  # of free accelerator memory, kept back for fragmentation when StepMemory sets the budgets


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """Accelerator memory the training step's own programs need beyond what is allocated when planning.

  ``peak_bytes``: at the step's peak (activations, gradients, temporaries);
  ``live_bytes``: the part still allocated during the optimizer update (its
  outputs on the accelerator, such as gradients not flushed to the host).
  Build it with :meth:`of` from the compiled gradient step, or by hand. The
  plan assumes those outputs are freed after the update: drop the training
  loop's references to the gradients (``del grads``) before the next step.
  """

  peak_bytes: int
  live_bytes: int = 0

  def __post_init__(self):
    if not 0 <= self.live_bytes <= self.peak_bytes:
      raise ValueError(f"StepMemory needs 0 <= live_bytes <= peak_bytes, got {self.live_bytes}, {self.peak_bytes}.")

  def room_beside(self, free_bytes: int) -> int:
    """``(1 - STEP_MARGIN) free_bytes - peak_bytes``: what a plan may place beside the step's peak on a device with
    ``free_bytes`` free (the budgets' ``F - P``); negative where the step itself does not fit."""
    return int((1 - STEP_MARGIN) * free_bytes) - self.peak_bytes

  @classmethod
  def of(cls, compiled: Any) -> StepMemory:
    """From a compiled program (``jax.jit(f).lower(*args).compile()``): temporaries plus accelerator outputs."""
    stats = compiled.memory_analysis()
    if stats is None:
      raise ValueError("this backend gives no memory analysis for compiled programs; pass StepMemory(peak, live).")
    outputs = max(0, int(stats.output_size_in_bytes) - int(stats.alias_size_in_bytes))
    return cls(peak_bytes=int(stats.temp_size_in_bytes) + outputs, live_bytes=outputs)


class Budgets(NamedTuple):
  """Accelerator bytes per device: resident state, streamed subgroups in flight, state copies sent ahead.

  ``None`` means unbounded (no memory statistics, or every copy is sent ahead).
  """

  resident: int
  staging: int | None
  ahead: int | None = None
  step_room: int | None = None  # F - P: room beside the forward/backward's peak (None: the step's needs unknown)
  usable: int | None = None  # (1 - STEP_MARGIN) F where the step's needs set the budgets and no resident budget did


@dataclasses.dataclass(frozen=True)
class BudgetInputs:
  """What the budgets are sized from, in bytes and parameters per device; explicit budgets win.

  Attributes:
    device_elements: parameters one device holds.
    largest_subgroup: parameters of the largest subgroup on one device (two staging slots of it are kept).
    grad_itemsize: bytes of a gradient element.
    params_in_place: the training loop calls ``jax_dos.update_params``: the update phase holds no float32
      update per parameter.
    ahead_bytes: accelerator bytes per parameter of the state copies sent ahead (``delay_predict="gradient"``);
      0: none are, and the ahead budget is ``None``.
    relayout_bytes: accelerator bytes a device holds through the update for a state laid out otherwise than its
      parameters (partitioned over ``data``): the new weights' shards beside the gathered weights (the old ones are
      consumed), or the float32 updates gathered back to the parameters' layout.
    step_memory: the training step's needs (exact budgets), or ``None`` (fractions of the free memory).
    free_bytes: accelerator memory free; ``None``: the accelerator's now, else the calibration's.
    resident_budget_bytes, staging_budget_bytes: explicit budgets.
    resident_fraction, staging_fraction: the guesses used without ``step_memory``.
  """

  device_elements: int = 0
  largest_subgroup: int = 0
  grad_itemsize: int = 4
  params_in_place: bool = False
  ahead_bytes: int = 0
  relayout_bytes: int = 0
  step_memory: StepMemory | None = None
  free_bytes: int | None = None
  resident_budget_bytes: int | None = None
  staging_budget_bytes: int | None = None
  resident_fraction: float = DEFAULT_RESIDENT_FRACTION
  staging_fraction: float = DEFAULT_STAGING_FRACTION

  def __post_init__(self):
    for name in ("resident_fraction", "staging_fraction"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}.")


def resolve_budgets(inputs: BudgetInputs, calibration: Calibration | None = None) -> Budgets:
  """:class:`Budgets` for ``inputs`` (see the module docstring).

  The free memory is ``inputs.free_bytes``, else the accelerator's now, else
  the calibration's; with none (CPU backend) the resident default is 0 and
  the staging and ahead budgets unbounded (``None``).
  """
  free = inputs.free_bytes
  if free is None:
    free = memory.device_free_bytes()
  if free is None and calibration is not None:
    free = calibration.device_free_bytes
  if inputs.step_memory is not None and free is not None:
    return _step_budgets(inputs, free)
  return _guessed_budgets(inputs, free)


def _step_budgets(b: BudgetInputs, free: int) -> Budgets:
  """The largest budgets that fit both phases of the step (the module docstring's inequalities)."""
  everything = STATE_BYTES * b.device_elements
  usable = int((1 - STEP_MARGIN) * max(0, free))
  update_bytes = 0 if b.params_in_place else UPDATE_BYTES
  live, grad_share = b.step_memory.live_bytes, b.grad_itemsize / STATE_BYTES
  fb_room = usable - b.step_memory.peak_bytes
  update_room = usable - live - update_bytes * b.device_elements - b.relayout_bytes

  def update_need(resident: int) -> int:  # resident gradients come back unless the step kept them (counted in L)
    return resident + max(0, int(grad_share * resident) - live)

  def update_cap(room: int) -> float:  # the largest resident with update_need(resident) <= room
    return room if room * grad_share <= live else (room + live) / (1 + grad_share)

  resident = b.resident_budget_bytes
  if resident is None:
    whole = min(fb_room, update_cap(update_room))
    if whole >= everything:  # all of it: no staging slots
      resident = int(whole)
    else:
      slots = DEFAULT_MAX_STREAM_SLOTS * STAGING_BYTES * b.largest_subgroup
      resident = max(0, int(min(fb_room, update_cap(update_room - slots), everything)))
  held = min(resident, everything)
  ahead = None
  if b.ahead_bytes:  # copies are held through the forward/backward pass and into the update, where nothing streams
    ahead = max(0, min(fb_room - held, update_room - update_need(held)))
  staging = b.staging_budget_bytes
  if staging is None:
    staging = max(0, update_room - update_need(resident))
  usable_left = usable if b.resident_budget_bytes is None else None  # an explicit resident budget binds every step
  return Budgets(max(0, int(resident)), staging, ahead, max(0, fb_room), usable_left)


def _guessed_budgets(b: BudgetInputs, free: int | None) -> Budgets:
  """Fractions of the free memory, when the step's needs (or the free memory) are unknown."""
  resident = b.resident_budget_bytes
  if resident is None:
    resident = 0 if free is None else int(b.resident_fraction * max(0, free))
    if b.ahead_bytes:  # the state copies sent ahead share that fraction: each resident byte saves ahead_bytes / 12
      room = resident - b.ahead_bytes * b.device_elements
      resident = _cap(room, 1 - b.ahead_bytes / STATE_BYTES, STATE_BYTES * b.device_elements)
  staging = b.staging_budget_bytes
  if staging is None and free is not None:
    staging = int(b.staging_fraction * max(0, free - resident))
  return Budgets(max(0, int(resident)), staging, None)


def _cap(room: float, per_byte: float, everything: int) -> int:
  """Largest ``r <= everything`` with ``r * per_byte <= room`` (``per_byte`` may be <= 0: then all or none)."""
  if per_byte > 0:
    return int(min(everything, room / per_byte))
  return everything if room >= 0 else 0
