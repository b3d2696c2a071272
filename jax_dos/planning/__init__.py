"""One performance model: where each subgroup's Adam state is updated, and what a step's time is, for the plain and
the overlapped step.

From the ground up, each module importing only those below it. The lower floors are data and prices that the
optimizer and the stages read; ``calibration`` measures the rates with the real engine (``jax_dos.optimizer``), so it
and ``planner`` stand above the optimizer::

    rates.py         the update rates of the state's three paths, as the timeline, the routes and collectives price
    plan.py          Plan: subgroups of the parameter tree and where each one's state is updated (it names the remat
                     policies of jax_dos.staged.remat)
    host_plan.py     the pinned host memory a plan needs, per process and on its host (HostMemory, pool_share)
    collectives.py   a data-parallel step's collectives as the timeline prices them
    timeline.py      the overlapped step's timeline: when each subgroup's update can run, what the next pass waits for
    fired.py         a step after a fired clip: its timeline, the redo's split between the paths, its bound
    cost_model.py    the plain step's rates (Calibration) and its predicted time (predict)
    budgets.py       the accelerator memory a plan may use (StepMemory, BudgetInputs, resolve_budgets)
    search.py        the placements that minimise the predicted time (plan_sizes)
    link.py          the devices' collective link measured, and a mesh's Collectives for the timeline
    calibration.py   the rates measured on this machine with the real engine, and cached (calibrate)
    planner.py       make_plan and auto_planner, which interleaved_adam(plan="auto") calls

It exports nothing; each module is imported by name (``jax_dos.planning.planner``, ...).
"""
