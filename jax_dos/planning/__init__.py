"""The planning wing: where each subgroup's Adam state is updated (``plan="auto"``).

From the ground up, each module importing only those below it::

    cost_model.py    the calibration's rates (Calibration) and a step's predicted time (predict)
    calibration.py   those rates measured on this machine with the real engine, and cached (calibrate)
    budgets.py       the accelerator memory a plan may use (StepMemory, BudgetInputs, resolve_budgets)
    search.py        the placements that minimise the predicted time (plan_sizes)
    planner.py       make_plan and auto_planner, which interleaved_adam(plan="auto") calls
    link.py          the devices' collective link measured, and a mesh's Collectives for the timeline
"""

from jax_dos.planning.budgets import BudgetInputs, Budgets, StepMemory, resolve_budgets
from jax_dos.planning.calibration import calibrate, get_calibration
from jax_dos.planning.cost_model import Calibration, as_calibration, predict
from jax_dos.planning.planner import auto_planner, make_plan
from jax_dos.planning.search import Choice, fill_resident, plan_sizes, stream_slots_for

__all__ = [
  "BudgetInputs",
  "Budgets",
  "Calibration",
  "Choice",
  "StepMemory",
  "as_calibration",
  "auto_planner",
  "calibrate",
  "fill_resident",
  "get_calibration",
  "make_plan",
  "plan_sizes",
  "predict",
  "resolve_budgets",
  "stream_slots_for",
]
