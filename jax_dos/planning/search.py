"""The performance model and the plan it chooses (``plan="auto"``).

Model of one eager update step (``engine.py``), from a :class:`Calibration`
(rates ``h, s, d`` of the host, stream and device paths in params/s; ``h_c,
s_c`` the host and stream rates while both run; fixed costs ``o``)::

    W_D = c o_call + N_D / d                c = ceil(N_D / 256 Mi) jitted calls for resident subgroups
    W_H = N_H / h + K_H o_host               host kernel, incl. gradient D2H and update H2D
    W_S = N_S / s + K_S o_stream             streamed through the accelerator

``W`` is each path's work in *solo seconds*. The host path starts at 0; the
stream path starts at ``W_D`` (its jitted updates queue behind the resident
update on the accelerator, a slightly pessimistic assumption). While both run,
the host path advances at ``h_c / h`` of its solo speed and the stream path at
``s_c / s`` of its own: host kernel and DMA draw on the same host DRAM, and on a
one-socket machine where DRAM binds, ``h_c + s_c`` is about ``max(h, s)``, not
``h + s``. When one path finishes the other continues at its solo speed. The
predicted time is ``o_step + max(W_D, finish_H, finish_S)``. ``K`` counts
subgroups (the engine makes one batched transfer and one jitted call per
subgroup; what its further leaves cost is in the rates, which the calibration
measures on layer-shaped subgroups of six leaves);
with one stream slot in flight (no overlap of the two PCIe directions) ``s``
is the calibration's ``stream_rate_single``.

The engine runs each path's subgroups in plan order and all gradients exist
before the step begins, so the prediction depends only on which subgroups go
where, not on their order.

Choice (deterministic, see :func:`plan_sizes`):

1. *resident*: fill the resident budget (12 B per parameter per device:
   master, mu, nu) first-fit by decreasing size; accelerator memory is worth
   ~30x the host's rate, so a full budget is almost always best, but an empty
   device set is also tried;
2. *stream slots*: a streamed subgroup in flight needs ~16 B per parameter of
   staging memory (state in, the update out); ``stream_slots = min(max_slots,
   staging // (16 * largest streamed subgroup))``. A subgroup too large to
   stage even alone is host-only; if none can be staged, nothing streams;
3. *split*: for each possible slot count, the best streamed fraction of the
   rest is found by a 1-D search of the model, the subgroups nearest that
   fraction are picked greedily by size, then improved by moving single
   subgroups between host and stream while the prediction drops;
4. the single-path plans (all host, all stream, resident + all host, resident
   + all stream) are candidates too and win ties, so the chosen plan is never
   predicted slower than any of them.

Budgets (:func:`resolve_budgets`) come from the accelerator memory free when
planning (``memory_stats``: ``bytes_limit - bytes_in_use``, smallest over
local devices). Given the training step's own needs (:class:`StepMemory`,
read from its compiled program), they are exact: with ``F`` the free memory
less an 8% margin, ``P`` the step's peak, ``L`` what it keeps alive through
the update (gradients left on the accelerator) and ``g`` the bytes of a
gradient element,

    resident <= F - P                                  (forward/backward: state beside activations)
    resident + max(0, resident g/12 - L) + staging     (update: activations gone, fp32 updates made,
        <= F - L - 4 B/param                            resident gradients back from the host unless
                                                        the step kept them on the accelerator, in L)

With ``ahead_copies`` (``delay_predict="gradient"``) the budgets are the
same, and what both phases leave free beside them becomes the *ahead* budget:
state copies (3 x the itemsize per parameter) of as many host subgroups as fit
are sent ahead and held through the forward/backward pass, the others cross
in ``update`` (6 B a bfloat16 parameter of PCIe there). The copies never take
room from resident state: at 6.7B on an 80 GB GPU all of them did, and the
host could then not hold the state (``BENCHMARKS.md``).

(no 4 B/param with ``params_in_place``: ``jax_dos.update_params`` makes no update tree)
and two streaming slots are kept unless the whole state fits. Without it,
the resident budget is ``resident_fraction`` (0.4) of the free memory, a
guess that must leave room for activations (with ``ahead_copies``, room for
every host subgroup's copies too, all sent ahead), and the staging budget
``staging_fraction`` (0.5) of what is left. With no accelerator memory
statistics (the CPU backend) the resident budget is 0 and staging is
unbounded, so ``"auto"`` still makes an offloaded plan there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from jax_dos.memory import device_elements
from jax_dos.plan import RESIDENT_CALL_ELEMENTS, Plan, partition_leaves
from jax_dos.planning.calibration import (
  Calibration,
  CalibrationSpec,
  as_calibration,
  device_free_bytes,
  get_calibration,
)

STATE_BYTES = 12  # resident: fp32 master, mu, nu
STAGING_BYTES = 16  # a streamed subgroup in flight: master, mu, nu in, the fp32 update out
DEFAULT_RESIDENT_FRACTION = 0.4
DEFAULT_STAGING_FRACTION = 0.5
DEFAULT_MAX_STREAM_SLOTS = 2
UPDATE_BYTES = 4  # the fp32 update per parameter that tx.update returns (none with jax_dos.update_params)
STEP_MARGIN = 0.08  # of free accelerator memory, kept back for fragmentation when StepMemory sets the budgets
_REL_TOL = 1e-9  # a candidate must beat the incumbent by this much (ties go to the simpler plan)
_GRID = 256
_MAX_SWEEPS = 4


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


@dataclasses.dataclass(frozen=True)
class Choice:
  """The planner's answer for a list of subgroups."""

  placements: tuple[str, ...]
  stream_slots: int
  predicted: dict[str, float]
  name: str  # which candidate won: "host", "stream", "resident+host", "split(m slots)", ...


# ----------------------------------------------------------------------------- the model


def _two_paths(w1: float, start1: float, slow1: float, w2: float, start2: float, slow2: float) -> tuple[float, float]:
  """Finish times of two paths with ``w`` solo-seconds of work each, starting at ``start``.

  Alone a path advances at speed 1; while both run, at ``1 / slow``. A path
  with no work finishes at 0.
  """
  rem, start, slow = [w1, w2], [start1, start2], [slow1, slow2]
  fin = [0.0 if w <= 0 else math.inf for w in rem]
  t = min((start[i] for i in (0, 1) if fin[i] == math.inf), default=0.0)
  while math.inf in fin:
    active = [i for i in (0, 1) if fin[i] == math.inf and start[i] <= t]
    speed = {i: (1.0 / slow[i] if len(active) == 2 else 1.0) for i in active}
    ends = {i: t + rem[i] / speed[i] for i in active}
    pending = [start[i] for i in (0, 1) if fin[i] == math.inf and start[i] > t]
    t_next = min([*ends.values(), *pending])
    for i in active:
      if ends[i] <= t_next:
        fin[i], rem[i] = t_next, 0.0
      else:
        rem[i] -= (t_next - t) * speed[i]
    t = t_next
  return fin[0], fin[1]


def _stream_rates(cal: Calibration, stream_slots: int) -> tuple[float, float]:
  if stream_slots >= 2:
    return cal.stream_rate, cal.stream_rate_concurrent
  single = cal.stream_rate_single or cal.stream_rate / 2
  return single, cal.stream_rate_concurrent * single / cal.stream_rate


def predict(
  cal: Calibration,
  *,
  n_device: float = 0,
  n_host: float = 0,
  n_stream: float = 0,
  k_host: float = 0,
  k_stream: float = 0,
  stream_slots: int = DEFAULT_MAX_STREAM_SLOTS,
) -> dict[str, float]:
  """Predicted seconds of one step: when each path finishes, and ``"total"`` (see module docstring).

  ``n_*`` are parameters per path, ``k_*`` subgroups per path (fixed costs).
  """
  s, s_c = _stream_rates(cal, stream_slots)
  calls = math.ceil(n_device / RESIDENT_CALL_ELEMENTS)  # the engine's jitted calls for resident subgroups
  w_d = calls * cal.device_call_overhead + n_device / cal.device_rate if n_device > 0 else 0.0
  w_h = n_host / cal.host_rate + k_host * cal.subgroup_overhead_host if (n_host > 0 or k_host > 0) else 0.0
  w_s = n_stream / s + k_stream * cal.subgroup_overhead_stream if (n_stream > 0 or k_stream > 0) else 0.0
  slow_h = max(1.0, cal.host_rate / cal.host_rate_concurrent)
  slow_s = max(1.0, s / s_c)
  fin_h, fin_s = _two_paths(w_h, 0.0, slow_h, w_s, w_d, slow_s)
  total = cal.step_overhead + max(w_d, fin_h, fin_s)
  return {"device": w_d, "host": fin_h, "stream": fin_s, "total": total}


# ----------------------------------------------------------------------------- the choice


def fill_resident(dev_sizes: Sequence[int], budget: int) -> frozenset[int]:
  """First-fit by decreasing size (ties: lower index) of ``12 * size`` bytes into ``budget``."""
  chosen, used = [], 0
  for i in sorted(range(len(dev_sizes)), key=lambda i: (-dev_sizes[i], i)):
    need = STATE_BYTES * dev_sizes[i]
    if dev_sizes[i] > 0 and used + need <= budget:
      chosen.append(i)
      used += need
  return frozenset(chosen)


def stream_slots_for(
  stream: Sequence[int], dev_sizes: Sequence[int], staging: int | None, max_slots: int = DEFAULT_MAX_STREAM_SLOTS
) -> int:
  """Streamed subgroups in flight: ``min(max_slots, staging // (16 B x largest streamed subgroup))``, >= 1."""
  largest = max((STAGING_BYTES * dev_sizes[i] for i in stream), default=0)
  if staging is None or largest == 0:
    return max_slots
  return max(1, min(max_slots, staging // largest))


class _Problem:
  """Subgroup sizes, leaf counts and budgets, with the model evaluated on index sets."""

  def __init__(self, sizes, dev_sizes, leaf_counts, cal, staging, max_slots):
    self.sizes, self.dev_sizes, self.leaves = sizes, dev_sizes, leaf_counts
    self.cal, self.staging, self.max_slots = cal, staging, max_slots

  def placements(self, device: frozenset[int], stream: frozenset[int]) -> tuple[str, ...]:
    return tuple("device" if i in device else "stream" if i in stream else "host" for i in range(len(self.sizes)))

  def evaluate(self, device: frozenset[int], stream: frozenset[int], slots: int | None = None) -> dict[str, float]:
    if slots is None:
      slots = stream_slots_for(sorted(stream), self.dev_sizes, self.staging, self.max_slots)
    host = [i for i in range(len(self.sizes)) if i not in device and i not in stream]
    return predict(
      self.cal,
      n_device=sum(self.sizes[i] for i in device),
      n_host=sum(self.sizes[i] for i in host),
      n_stream=sum(self.sizes[i] for i in stream),
      k_host=sum(self.leaves[i] for i in host),
      k_stream=sum(self.leaves[i] for i in stream),
      stream_slots=slots,
    )

  def split(self, device: frozenset[int], eligible: list[int], slots: int) -> frozenset[int]:
    """Streamed subset of ``eligible`` minimising the model, for fixed ``slots``."""
    rest = [i for i in range(len(self.sizes)) if i not in device]
    n_d = sum(self.sizes[i] for i in device)
    n_rest, k_rest = sum(self.sizes[i] for i in rest), sum(self.leaves[i] for i in rest)
    n_el, k_el = sum(self.sizes[i] for i in eligible), sum(self.leaves[i] for i in eligible)
    if n_el == 0:
      return frozenset()

    def total(n_s, k_s):
      kw = dict(n_device=n_d, n_host=n_rest - n_s, n_stream=n_s, k_host=k_rest - k_s, k_stream=k_s)
      return predict(self.cal, **kw, stream_slots=slots)["total"]

    f = lambda x: total(x, k_el * x / n_el)  # noqa: E731
    lo, hi = 0.0, float(n_el)
    for _ in range(2):  # a grid, then a finer grid around its best point
      xs = [lo + (hi - lo) * j / _GRID for j in range(_GRID + 1)]
      best = min(range(len(xs)), key=lambda j: (f(xs[j]), j))
      step = (hi - lo) / _GRID
      lo, hi, target = max(0.0, xs[best] - step), min(float(n_el), xs[best] + step), xs[best]

    chosen, n_s, k_s = set(), 0, 0
    for i in sorted(eligible, key=lambda i: (-self.sizes[i], i)):
      if n_s + self.sizes[i] / 2 < target:
        chosen.add(i)
        n_s, k_s = n_s + self.sizes[i], k_s + self.leaves[i]

    current = total(n_s, k_s)  # improve by single moves between host and stream
    for _ in range(_MAX_SWEEPS):
      improved = False
      for i in eligible:
        sign = -1 if i in chosen else 1
        t = total(n_s + sign * self.sizes[i], k_s + sign * self.leaves[i])
        if t < current * (1 - _REL_TOL):
          chosen.symmetric_difference_update({i})
          n_s, k_s, current, improved = n_s + sign * self.sizes[i], k_s + sign * self.leaves[i], t, True
      if not improved:
        break
    return frozenset(chosen)


def plan_sizes(
  sizes: Sequence[int],
  calibration: Calibration,
  *,
  resident_budget_bytes: int = 0,
  staging_budget_bytes: int | None = None,
  device_sizes: Sequence[int] | None = None,
  leaf_counts: Sequence[int] | None = None,
  max_stream_slots: int = DEFAULT_MAX_STREAM_SLOTS,
) -> Choice:
  """Chooses a placement per subgroup to minimise the predicted step time.

  Args:
    sizes: parameters per subgroup (global).
    calibration: the rates to plan with.
    resident_budget_bytes: accelerator memory (per device) for resident state.
    staging_budget_bytes: accelerator memory (per device) for streamed
      subgroups in flight; ``None`` means unbounded.
    device_sizes: parameters per subgroup held by one device (default:
      ``sizes``; smaller when leaves are sharded); budgets count these.
    leaf_counts: fixed-cost units per subgroup (default 1 each: the model's costs are per subgroup).
    max_stream_slots: most streamed subgroups in flight.
  """
  n = len(sizes)
  dev_sizes = list(device_sizes) if device_sizes is not None else list(sizes)
  leaves = list(leaf_counts) if leaf_counts is not None else [1] * n
  if len(dev_sizes) != n or len(leaves) != n:
    raise ValueError(f"device_sizes and leaf_counts need one entry per subgroup ({n}).")
  if max_stream_slots < 1:
    raise ValueError(f"max_stream_slots must be >= 1, got {max_stream_slots}.")
  if any(x < 0 for x in (*sizes, *dev_sizes)):
    raise ValueError("subgroup sizes must be >= 0.")
  budget = max(0, int(resident_budget_bytes or 0))
  staging = None if staging_budget_bytes is None else max(0, int(staging_budget_bytes))
  prob = _Problem(list(sizes), dev_sizes, leaves, calibration, staging, max_stream_slots)

  fit = fill_resident(dev_sizes, budget)
  candidates: list[tuple[str, frozenset[int], frozenset[int]]] = []
  for device, tag in ((frozenset(), ""), (fit, "resident+")):
    if tag and not fit:
      continue
    rest = [i for i in range(n) if i not in device]
    candidates.append((tag + "host", device, frozenset()))
    stageable = lambda i, m: staging is None or STAGING_BYTES * dev_sizes[i] * m <= staging  # noqa: E731
    if rest and all(stageable(i, 1) for i in rest):
      candidates.append((tag + "stream", device, frozenset(rest)))
  for device, tag in ((frozenset(), ""), (fit, "resident+")):
    if tag and not fit:
      continue
    rest = [i for i in range(n) if i not in device]
    seen: set[tuple[int, ...]] = set()
    for m in range(max_stream_slots, 0, -1):  # more slots first; fewer only if they admit more subgroups
      eligible = [i for i in rest if staging is None or STAGING_BYTES * dev_sizes[i] * m <= staging]
      if not eligible or tuple(eligible) in seen:
        continue
      seen.add(tuple(eligible))
      stream = prob.split(device, eligible, m)
      if stream:
        candidates.append((f"{tag}split({m} slots)", device, stream))

  best = None
  for name, device, stream in candidates:
    pred = prob.evaluate(device, stream)
    if best is None or pred["total"] < best[1]["total"] * (1 - _REL_TOL):
      best = (name, pred, device, stream)
  name, pred, device, stream = best
  slots = stream_slots_for(sorted(stream), dev_sizes, staging, max_stream_slots)
  return Choice(prob.placements(device, stream), slots, pred, name)


# ----------------------------------------------------------------------------- trees and budgets


def resolve_budgets(
  calibration: Calibration | None = None,
  *,
  resident_budget_bytes: int | None = None,
  staging_budget_bytes: int | None = None,
  resident_fraction: float = DEFAULT_RESIDENT_FRACTION,
  staging_fraction: float = DEFAULT_STAGING_FRACTION,
  free_bytes: int | None = None,
  step_memory: StepMemory | None = None,
  device_elements: int = 0,
  largest_subgroup: int = 0,
  grad_itemsize: int = 4,
  params_in_place: bool = False,
  ahead_bytes: int = 0,
) -> Budgets:
  """:class:`Budgets` in bytes per device; explicit values win (see module docstring).

  ``free_bytes`` defaults to the accelerator memory free now, else the
  calibration's; with neither (CPU backend) the resident default is 0 and the
  staging and ahead budgets unbounded (``None``). With ``step_memory``, the
  budgets follow the step's needs for ``device_elements`` parameters per
  device in subgroups of at most ``largest_subgroup`` (per device), with
  gradients of ``grad_itemsize`` bytes an element. The update phase holds a
  float32 update per parameter unless ``params_in_place`` (the training loop
  calls ``jax_dos.update_params``). ``ahead_bytes``: accelerator bytes of the
  state copies of a parameter sent ahead (``delay_predict="gradient"``); 0:
  none are (the ahead budget is then ``None``, unused).
  """
  for name, frac in (("resident_fraction", resident_fraction), ("staging_fraction", staging_fraction)):
    if not 0 <= frac <= 1:
      raise ValueError(f"{name} must be in [0, 1], got {frac}.")
  if free_bytes is None:
    free_bytes = device_free_bytes()
  if free_bytes is None and calibration is not None:
    free_bytes = calibration.device_free_bytes
  everything = STATE_BYTES * device_elements
  ahead = None
  if step_memory is not None and free_bytes is not None:
    usable = int((1 - STEP_MARGIN) * max(0, free_bytes))
    update_bytes = 0 if params_in_place else UPDATE_BYTES
    update_room = usable - step_memory.live_bytes - update_bytes * device_elements
    fb_room = usable - step_memory.peak_bytes
    live, grad_share = step_memory.live_bytes, grad_itemsize / STATE_BYTES

    def update_need(resident: int) -> int:  # resident gradients come back unless the step kept them (counted in L)
      return resident + max(0, int(grad_share * resident) - live)

    def update_cap(room: int) -> float:  # the largest resident with update_need(resident) <= room
      return room if room * grad_share <= live else (room + live) / (1 + grad_share)

    if resident_budget_bytes is None:
      slots = DEFAULT_MAX_STREAM_SLOTS * STAGING_BYTES * largest_subgroup
      if min(fb_room, update_cap(update_room)) >= everything:  # all of it: no staging slots
        resident_budget_bytes = int(min(fb_room, update_cap(update_room)))
      else:
        resident_budget_bytes = max(0, int(min(fb_room, update_cap(update_room - slots), everything)))
    resident = min(resident_budget_bytes, everything)
    if ahead_bytes:  # copies are held through the forward/backward pass and into the update, where nothing streams
      ahead = max(0, min(fb_room - resident, update_room - update_need(resident)))
    if staging_budget_bytes is None:
      staging_budget_bytes = max(0, update_room - update_need(resident_budget_bytes))
  if resident_budget_bytes is None:
    guess = 0 if free_bytes is None else int(resident_fraction * max(0, free_bytes))
    # The state copies sent ahead share that fraction: each resident byte saves ahead_bytes / 12 of them.
    room = guess - ahead_bytes * device_elements
    resident_budget_bytes = _cap(room, 1 - ahead_bytes / STATE_BYTES, everything) if ahead_bytes else guess
  if staging_budget_bytes is None and free_bytes is not None:
    staging_budget_bytes = int(staging_fraction * max(0, free_bytes - resident_budget_bytes))
  return Budgets(max(0, int(resident_budget_bytes)), staging_budget_bytes, ahead)


def _cap(room: float, per_byte: float, everything: int) -> int:
  """Largest ``r <= everything`` with ``r * per_byte <= room`` (``per_byte`` may be <= 0: then all or none)."""
  if per_byte > 0:
    return int(min(everything, room / per_byte))
  return everything if room >= 0 else 0


def make_plan(
  params: Any,
  subgroup_size: int,
  calibration: CalibrationSpec,
  *,
  resident_budget_bytes: int | None = None,
  staging_budget_bytes: int | None = None,
  resident_fraction: float = DEFAULT_RESIDENT_FRACTION,
  staging_fraction: float = DEFAULT_STAGING_FRACTION,
  max_stream_slots: int = DEFAULT_MAX_STREAM_SLOTS,
  step_memory: StepMemory | None = None,
  params_in_place: bool = False,
  ahead_copies: bool = False,
) -> Plan:
  """The model's :class:`~jax_dos.plan.Plan` for ``params`` (see :func:`plan_sizes`, :func:`resolve_budgets`)."""
  import jax

  cal = as_calibration(calibration)
  subgroups, sizes = partition_leaves(params, subgroup_size)
  per_leaf = [device_elements(x) for x in jax.tree.leaves(params)]
  dev_sizes = [sum(per_leaf[i] for i in g) for g in subgroups]
  itemsize = max((jax.numpy.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)), default=4)
  budgets = resolve_budgets(
    cal,
    resident_budget_bytes=resident_budget_bytes,
    staging_budget_bytes=staging_budget_bytes,
    resident_fraction=resident_fraction,
    staging_fraction=staging_fraction,
    step_memory=step_memory,
    device_elements=sum(dev_sizes),
    largest_subgroup=max(dev_sizes, default=0),
    grad_itemsize=itemsize,
    params_in_place=params_in_place,
    ahead_bytes=3 * itemsize if ahead_copies else 0,  # copies of master, mu and nu in the parameters' dtype
  )
  choice = plan_sizes(
    sizes,
    cal,
    resident_budget_bytes=budgets.resident,
    staging_budget_bytes=budgets.staging,
    device_sizes=dev_sizes,
    max_stream_slots=max_stream_slots,
  )
  return Plan(
    subgroups,
    choice.placements,
    sizes,
    stream_slots=choice.stream_slots,
    predicted=choice.predicted,
    source="model",
    calibration=cal.to_dict(),
    ahead_budget_bytes=budgets.ahead,
  )


def auto_planner(calibration: CalibrationSpec = None, **plan_kwargs) -> Callable[[Any, int], Plan]:
  """The planner ``interleaved_adam(plan="auto")`` uses: ``(params, subgroup_size) -> Plan``.

  The calibration is resolved on first use (``calibration`` if given, else
  ``$JAX_DOS_CALIBRATION``, else the cache, else measured now: a few seconds)
  and kept. ``plan_kwargs`` go to :func:`make_plan` (budgets, fractions,
  ``max_stream_slots``, ``step_memory``, ``params_in_place``, ``ahead_copies``: set it for
  ``delay_predict="gradient"``); budgets left out are read from free
  memory at plan time, exactly when ``step_memory`` says what the training
  step needs (``StepMemory.of(jax.jit(grad_fn).lower(params, batch).compile())``).
  """
  if calibration is not None:
    calibration = as_calibration(calibration)  # fail early on a bad override
  held: list[Calibration] = []

  def planner(params: Any, subgroup_size: int) -> Plan:
    if not held:
      held.append(get_calibration(calibration))
    return make_plan(params, subgroup_size, held[0], **plan_kwargs)

  return planner
