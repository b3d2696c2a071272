"""The search: a placement per subgroup that minimises the cost model's predicted step time.

Deterministic (see :func:`plan_sizes`):

1. *resident*: fill the resident budget (12 B per parameter per device:
   master, mu, nu) first-fit by decreasing size; accelerator memory is worth
   ~30x the host's rate, so a full budget is almost always best, but an empty
   device set is also tried;
2. *stream slots*: a streamed subgroup in flight needs 16 B per parameter of
   staging memory (master, mu and nu in, the float32 update out:
   ``plan.STAGING_BYTES``); ``stream_slots = min(max_slots, staging // (16 x
   largest streamed subgroup))``. A subgroup too large to stage even alone is
   host-only; if none can be staged, nothing streams;
3. *split*: for each possible slot count, the best streamed fraction of the
   rest is found by a 1-D search of the model, the subgroups nearest that
   fraction are picked greedily by size, then improved by moving single
   subgroups between host and stream while the prediction drops;
4. the single-path plans (all host, all stream, resident + all host, resident
   + all stream) are candidates too and win ties, so the chosen plan is never
   predicted slower than any of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax_dos.planning.cost_model import DEFAULT_MAX_STREAM_SLOTS, Calibration, predict
from jax_dos.planning.plan import STAGING_BYTES, STATE_BYTES

_REL_TOL = 1e-9  # a candidate must beat the incumbent by this much (ties go to the simpler plan)
_GRID = 256
_MAX_SWEEPS = 4


@dataclasses.dataclass(frozen=True)
class Choice:
  """The planner's answer for a list of subgroups."""

  placements: tuple[str, ...]
  stream_slots: int
  predicted: dict[str, float]
  name: str  # which candidate won: "host", "stream", "resident+host", "split(m slots)", ...


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
  """Streamed subgroups in flight: ``min(max_slots, staging // (STAGING_BYTES x largest streamed subgroup))``, >= 1."""
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

  def stageable(i: int, m: int) -> bool:  # whether m subgroups of subgroup i's size fit in staging at once
    return staging is None or STAGING_BYTES * dev_sizes[i] * m <= staging

  candidates: list[tuple[str, frozenset[int], frozenset[int]]] = []
  for device, tag in ((frozenset(), ""), (fit, "resident+")):
    if tag and not fit:
      continue
    rest = [i for i in range(n) if i not in device]
    candidates.append((tag + "host", device, frozenset()))
    if rest and all(stageable(i, 1) for i in rest):
      candidates.append((tag + "stream", device, frozenset(rest)))
  for device, tag in ((frozenset(), ""), (fit, "resident+")):
    if tag and not fit:
      continue
    rest = [i for i in range(n) if i not in device]
    seen: set[tuple[int, ...]] = set()
    for m in range(max_stream_slots, 0, -1):  # more slots first; fewer only if they admit more subgroups
      eligible = [i for i in rest if stageable(i, m)]
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
