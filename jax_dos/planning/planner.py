"""The planner on top of the planning wing: :func:`make_plan` and :func:`auto_planner` (``plan="auto"``).

``make_plan`` sizes the budgets (``budgets.py``) for a parameter tree, searches
the placements (``search.py``) with the calibration's rates (``cost_model.py``)
and returns a :class:`~jax_dos.planning.plan.Plan`; ``auto_planner`` resolves the
calibration once (``calibration.py``: given, ``$JAX_DOS_CALIBRATION``, cached,
or measured) and plans every tree it is handed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jax_dos.core import moment_formats
from jax_dos.memory.kinds import device_elements
from jax_dos.planning.budgets import (
  DEFAULT_RESIDENT_FRACTION,
  DEFAULT_STAGING_FRACTION,
  UPDATE_BYTES,
  BudgetInputs,
  StepMemory,
  resolve_budgets,
)
from jax_dos.planning.calibration import get_calibration
from jax_dos.planning.cost_model import DEFAULT_MAX_STREAM_SLOTS, Calibration, CalibrationSpec, as_calibration
from jax_dos.planning.plan import STAGING_BYTES, STATE_BYTES, Plan, partition_leaves
from jax_dos.planning.search import plan_sizes


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
  moments: str = "float32",
  relayout_elements: tuple[int, int] = (0, 0),
) -> Plan:
  """The model's :class:`~jax_dos.planning.plan.Plan` for ``params``.

  Budgets as :func:`~jax_dos.planning.budgets.resolve_budgets` sizes them (explicit
  ones win), placements as :func:`~jax_dos.planning.search.plan_sizes` chooses them.
  ``moments``: the optimizer's format; its state takes ``moment_formats.state_bytes_per_param`` bytes a
  parameter (12, 8, about 6) resident or in flight, and the rates are ``Calibration.for_moments``'.
  ``relayout_elements``: of the leaves whose state is laid out otherwise than their parameters (partitioned), the
  elements a device holds in the state's layout and in the parameters' (``budgets.BudgetInputs.relayout_bytes``).
  """
  cal = as_calibration(calibration).for_moments(moment_formats.check(moments))
  subgroups, sizes = partition_leaves(params, subgroup_size)
  per_leaf = [device_elements(x) for x in jax.tree.leaves(params)]
  dev_sizes = [sum(per_leaf[i] for i in g) for g in subgroups]
  itemsize = max((jax.numpy.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)), default=4)
  inputs = BudgetInputs(
    device_elements=sum(dev_sizes),
    largest_subgroup=max(dev_sizes, default=0),
    grad_itemsize=itemsize,
    params_in_place=params_in_place,
    ahead_bytes=3 * itemsize if ahead_copies else 0,  # copies of master, mu and nu in the parameters' dtype
    relayout_bytes=itemsize * relayout_elements[0] if params_in_place else UPDATE_BYTES * relayout_elements[1],
    step_memory=step_memory,
    resident_budget_bytes=resident_budget_bytes,
    staging_budget_bytes=staging_budget_bytes,
    resident_fraction=resident_fraction,
    staging_fraction=staging_fraction,
  )
  budgets = resolve_budgets(inputs, cal)
  # The search counts float32 state (STATE_BYTES, STAGING_BYTES a parameter): compact state fits more parameters.
  state = moment_formats.state_bytes_per_param(moments)
  resident = int(budgets.resident * STATE_BYTES / state)
  staging = (
    None if budgets.staging is None else int(budgets.staging * STAGING_BYTES / (STAGING_BYTES - STATE_BYTES + state))
  )
  choice = plan_sizes(
    sizes,
    cal,
    resident_budget_bytes=resident,
    staging_budget_bytes=staging,
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
    step_room_bytes=budgets.step_room,
    step_usable_bytes=budgets.usable,
  )


def auto_planner(calibration: CalibrationSpec = None, **plan_kwargs) -> Callable[[Any, int], Plan]:
  """The planner ``interleaved_adam(plan="auto")`` uses: ``(params, subgroup_size) -> Plan``.

  The calibration is resolved on first use (``calibration`` if given, else
  ``$JAX_DOS_CALIBRATION``, else the cache, else measured now: a few seconds)
  and kept. ``plan_kwargs`` go to :func:`make_plan` (budgets, fractions,
  ``max_stream_slots``, ``step_memory``, ``params_in_place``, ``ahead_copies``: set it for
  ``delay_predict="gradient"``; ``moments``: the optimizer's, which ``interleaved_adam`` passes to its own
  planner); budgets left out are read from free
  memory at plan time, exactly when ``step_memory`` says what the training
  step needs (``StepMemory.of(jax.jit(grad_fn).lower(params, batch).compile())``).
  """
  if calibration is not None:
    calibration = as_calibration(calibration)  # fail early on a bad override
  held: list[Calibration] = []

  def planner(params: Any, subgroup_size: int, relayout_elements: tuple[int, int] = (0, 0)) -> Plan:
    if not held:
      held.append(get_calibration(calibration))
    return make_plan(params, subgroup_size, held[0], relayout_elements=relayout_elements, **plan_kwargs)

  planner.counts_relayout = True  # interleaved_adam tells it what a partitioned state's update holds
  return planner
