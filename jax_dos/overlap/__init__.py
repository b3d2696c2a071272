"""The overlapped step (``jax_dos.OverlappedStep``): the AdamW update runs under the backward and the next forward pass.

One module a job, from the ground up, each importing only those below it (docs/overlap.md, docs/design.md)::

    memory.py       the step's pinned host bytes, against its budget and the host's share
    plan.py         its plan: placements and rematerialisation, room beside the step's peak
    routes.py       what its threads read of a plan, the fired clip's split, a rebalanced plan
    clip.py         the clip decision and a step's speculation record (futures between the threads)
    state.py        its optimizer state in the plan's placements, allocated once
    process.py      what it asks of the process: command buffers off, open steps closed at exit
    dispatch.py     the training thread's run-ahead pacing and its first step's held jobs
    host_path.py    the host worker: host subgroups' state, spares, weight copies; new weights as futures
    stream_path.py  the stream worker: streamed state, slots, copies; new weights as futures (after a fired
                    clip it also steps the host path's share, so it stands above the host path)
    workers.py      the worker threads (host, stream, decider) and the paths they own, started and ended
    step.py         OverlappedStep: the training thread, the parameters' one writer

A step runs plan -> step -> host path / stream path -> clip decision: ``plan`` makes the plan (and its ``routes``)
from shapes and stage times, checked against ``memory``; ``step`` allocates the state in its placements
(``state``), runs the stages and hands each completed group to the host path or the stream path, which speculate on
the clip staying silent until the decider resolves the step's decision (``clip``). The plan flows one way: the step
never edits one, it asks ``plan`` for a new one.

The modules it stands on (``staged.stages``, ``planning.timeline``, ``job_thread``, ``memory.copy_out``,
``memory.pinned_arena``, the stream and host mechanics of ``optimizer.paths``, which the eager engine runs too, ...)
are in the packages below it, and none of them imports this one. It exports only the step (``jax_dos`` exports it
too); everything else is imported from its module (``jax_dos.overlap.plan``, ...).
"""

from jax_dos.overlap.step import OverlappedStep

__all__ = ["OverlappedStep"]
