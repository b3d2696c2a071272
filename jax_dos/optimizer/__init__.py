"""``interleaved_adam``, the optax transformation, and the two ways it runs a step: traced (inside ``jax.jit``) and
eager (the engine, outside it).

From the ground up, each module importing only those below it (and ``core``, ``memory``, ``kernels``, the plan's
data in ``planning``: ``plan``, ``host_plan``)::

    device_steps.py  the accelerator side of a step: jitted calls over a subgroup's leaves, shared by every eager path
    traced.py        the traced update: pure XLA, for calls of update inside jax.jit
    paths/           the update's mechanics by placement (stream.py, host.py), shared with the overlapped step
    step_ahead.py    delay_predict="gradient": a delayed update that hands on undelayed AdamW's weights
    engine.py        the eager engine: runs one Plan outside jit
    interleaved.py   the optimizer behind interleaved_adam: hyperparameters, a plan and an engine per tree signature
    transform.py     interleaved_adam itself, update_params, gradient_shardings (it plans through planning.planner)
    accumulate.py    gradient accumulation that keeps the offloaded state on the fast path

It exports nothing; ``jax_dos`` exports the public names, and the rest is imported from its module
(``jax_dos.optimizer.engine``, ...).
"""
