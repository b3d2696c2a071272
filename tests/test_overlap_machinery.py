"""How the overlapped step (``jax_dos.OverlappedStep``) plans and runs, beside its numbers (``test_overlap_numbers``).

Its plan (measured from the stages' timeline, made from shapes before any state, the optimizer's own kept, budgeted
beside the step's peak and within the host budget, rebalanced between host and stream, the fired clip's redo share
sized from the calibration), the micro-batch schedules, its options (pacing depth, stream slots, run-ahead), its
threads (the first step's start, futures and failures, a dropped step's end, leaving Python with updates pending or
a worker stuck) and the errors it gives for what it cannot do. Where a test runs steps, the numbers are still
optax's (``overlap_model``).
"""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import textwrap
import time
import weakref
from concurrent.futures import Future
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from overlap_model import (
  B1,
  B2,
  BLOCKS,
  D_H,
  FIRES,
  LR,
  MIXED,
  NEVER,
  ROWS,
  STAGES,
  WD,
  _head,
  _subgroup_count,
  check_against_reference,
  make_batch,
  make_groups,
  overlapped_run,
)

import jax_dos
from jax_dos.job_thread import Failure, JobThread, result_of
from jax_dos.overlap.plan import STREAM_SLOTS


def test_auto_plan_from_the_measured_timeline():
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  times = jax_dos.StagedModel(STAGES, len(groups)).measure_times(
    groups, jax.tree.map(lambda x: x[: ROWS // 2], batches[0])
  )
  assert len(times.forward) == len(STAGES) and min(times.backward) > 0
  step, _ = overlapped_run(groups, batches, FIRES, 2, "auto", stage_times=times)
  assert step.plan.source == "model+timeline"
  assert step.plan.predicted["step"] >= times.compute_s(2)
  check_against_reference(step, groups, batches, FIRES, 2)


def test_schedules_run_every_program_once_in_their_order():
  n, k = 4, 3
  for order in ("stage", "batch"):
    programs = jax_dos.staged.micro_batches.schedule(n, k, order)
    assert sorted(programs) == sorted([("forward", i, m) for i in range(n - 1) for m in range(k)]
                                      + [("backward", i, m) for i in range(n) for m in range(k)])  # fmt: skip
    for m in range(k):  # each micro-batch: its forward pass, then its backward pass from the last stage
      mine = [(kind, i) for kind, i, mm in programs if mm == m]
      assert mine == [("forward", i) for i in range(n - 1)] + [("backward", i) for i in reversed(range(n))]
  stage = jax_dos.staged.micro_batches.schedule(n, k, "stage")
  assert stage[:k] == [("forward", 0, m) for m in range(k)]
  assert all(kind == "backward" for kind, _, _ in stage[(n - 1) * k :])  # one backward pass of every micro-batch
  with pytest.raises(ValueError, match="micro_batch_order"):
    jax_dos.staged.micro_batches.schedule(n, k, "interleaved")


@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
def test_streamed_speculation_is_held_to_the_host_budget(clip_norm):
  """A budget that holds the state but speculation on one subgroup (or none): the stream worker waits for the
  decision past it, the host bytes stay within the budget, and the numbers are optax's."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan="stream")
  sizes = jax_dos.planning.plan.partition_groups(groups, 40)[1]
  state_bytes = 12 * sum(sizes)
  for speculated in (0, max(sizes)):
    budget = state_bytes + 12 * speculated
    step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=clip_norm,
                                  micro_batches=2, host_budget_bytes=budget)  # fmt: skip
    assert step.stream_speculation == speculated and step.host_bytes() <= budget
    records = []
    for batch in batches:
      step(batch)
      records.append(step._last_record)
    step.settle()  # each worker's record of a step is its own until then
    assert all(r.stream.speculated_elements <= speculated for r in records)
    check_against_reference(step, groups, batches, clip_norm, 2)
    step.close()
  with pytest.raises(MemoryError, match="plain path"):
    jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups), host_budget_bytes=state_bytes - 1)


def test_a_plan_made_from_shapes_and_a_fresh_state_allocated_once():
  """``jax_dos.overlapped_plan`` makes the step's plan before any state exists, and the step it is given makes the
  fresh state in that plan's placements (``opt_state=None``): optax's numbers; ``abstract_state`` is its layout."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  plan = MIXED[: _subgroup_count(groups)]
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan=plan)
  planned = jax_dos.overlapped_plan(tx, STAGES, groups, micro_batches=2)
  assert planned.placements == tuple(plan)
  abstract = jax_dos.abstract_state(planned, groups)
  step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), clip_norm=FIRES, micro_batches=2,
                                plan=planned)  # fmt: skip
  assert step.plan is planned
  state = step.opt_state
  for tree, want in zip(state, abstract):
    for x, a in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
      assert (x.shape, x.dtype, x.sharding.memory_kind) == (a.shape, a.dtype, a.sharding.memory_kind)
  for batch in batches:
    step(batch)
  check_against_reference(step, groups, batches, FIRES, 2)


def test_the_first_steps_workers_start_once_its_programs_have_run():
  """A program's first run initialises it (on a GPU, loading cuDNN graphs through a stream capture that a launch from
  another thread breaks), so the first step's workers wait until every program of the step has run."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  with jax_dos.trace.recording() as spans:
    step, _ = overlapped_run(groups, batches[:1], NEVER, 2, MIXED[: _subgroup_count(groups)])
    step.settle()
  dispatched = max(s.end for s in spans if s.name in ("overlap.backward", "overlap.resident"))
  workers = [s for s in spans if s.name.startswith(("host.", "stream."))]
  assert workers and min(s.start for s in workers) >= dispatched
  step(batches[1])
  check_against_reference(step, groups, batches, NEVER, 2)


def test_the_first_steps_programs_are_every_steps():
  """Parameters made without a device (uncommitted) are committed by the step: its first step's stage programs are
  then those of every later step, none compiled and loaded while the optimizer's threads launch work."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  assert not any(x.committed for x in jax.tree.leaves(groups))
  step, _ = overlapped_run(groups, batches[:1], FIRES, 2, MIXED[: _subgroup_count(groups)])
  step.settle()
  programs_now = (
    jax_dos.staged.stage_programs._jit_forward._cache_size,
    jax_dos.staged.stage_programs._jit_backward._cache_size,
  )
  programs = tuple(f() for f in programs_now)
  for batch in batches[1:]:
    step(batch)
  step.settle()
  assert tuple(f() for f in programs_now) == programs
  check_against_reference(step, groups, batches, FIRES, 2)


def test_refuses_what_it_cannot_do():
  rng = np.random.default_rng()
  groups = make_groups(rng)
  with pytest.raises(TypeError, match="plain path"):
    jax_dos.OverlappedStep(optax.adamw(1e-3), STAGES, groups, optax.adamw(1e-3).init(groups))
  delayed = jax_dos.interleaved_adam(1e-3, delay=1)
  with pytest.raises(ValueError, match="plain path"):
    jax_dos.OverlappedStep(delayed, STAGES, groups, delayed.init(groups))
  tx = jax_dos.interleaved_adam(1e-3, plan="host")
  with pytest.raises(TypeError, match="list of parameter groups"):
    jax_dos.OverlappedStep(tx, STAGES, {"a": groups[0]}, tx.init({"a": groups[0]}))
  with pytest.raises(ValueError, match="used by no stage"):
    jax_dos.OverlappedStep(tx, STAGES[:-1] + [jax_dos.Stage(_head, (0,))], groups, tx.init(groups))
  with pytest.raises(ValueError, match="distinct group indices"):
    jax_dos.Stage(_head, (1, 1))
  whole = jax_dos.Plan(((0, 1, 2, 3),) + tuple((i,) for i in range(4, 9)), ("host",) * 6, (1,) * 6)
  with pytest.raises(ValueError, match="spans two parameter groups"):
    jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups), plan=whole)
  with pytest.raises(ValueError, match="micro_batch_order"):
    jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups), micro_batches=2, micro_batch_order="interleaved")
  with pytest.raises(TypeError, match="InterleavedAdamState of tx.init"):
    jax_dos.OverlappedStep(tx, STAGES, groups, optax.adamw(1e-3).init(groups))
  with pytest.raises(ValueError, match="opt_state.master does not match params"):
    jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups[:-1] + [{"other": groups[-1]}]))
  times = jax_dos.StageTimes((0.1,) * 3, (0.2,) * 3)
  with pytest.raises(ValueError, match="stage_times has 3 stages, the model 5"):
    jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups), stage_times=times)
  step = jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups), micro_batches=3)
  with pytest.raises(ValueError, match="divisible by micro_batches=3"):
    step(make_batch(rng))
  step.close()
  with pytest.raises(RuntimeError, match="closed"):
    step(make_batch(rng))


EXIT_PENDING = textwrap.dedent(
  """
    import sys
    import numpy as np
    sys.path.insert(0, "tests")
    import overlap_model as t

    rng = np.random.default_rng()
    groups = t.make_groups(rng)
    batches = [t.make_batch(rng) for _ in range(4)]
    step, _ = t.overlapped_run(groups, batches * 8, t.FIRES, 2, t.MIXED[: t._subgroup_count(groups)])
    print("stepped", flush=True)  # and leaves with the last steps' updates (and their redos) still running
  """
)


def test_leaving_python_with_updates_pending_settles_them():
  root = Path(__file__).resolve().parent.parent
  for _ in range(3):  # the workers were mid-update at exit in 2 runs of 3 before the step settled at exit
    out = subprocess.run([sys.executable, "-c", EXIT_PENDING], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "stepped" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


EXIT_STUCK = textwrap.dedent(
  """
    import sys, threading
    import numpy as np
    sys.path.insert(0, "tests")
    import jax_dos.overlap.process
    import overlap_model as t

    jax_dos.overlap.process.EXIT_SETTLE_S = 1.0
    rng = np.random.default_rng()
    groups = t.make_groups(rng)
    step, _ = t.overlapped_run(groups, [t.make_batch(rng)], t.NEVER, 2, "host")
    step._workers.host.submit(threading.Event().wait)  # a worker that never comes back (a fault would leave it so)
    print("stepped", flush=True)
  """
)


def test_leaving_python_with_a_stuck_worker_ends_with_a_message():
  root = Path(__file__).resolve().parent.parent
  out = subprocess.run([sys.executable, "-c", EXIT_STUCK], cwd=root, capture_output=True, text=True, timeout=120)
  assert "stepped" in out.stdout, out.stderr[-3000:]
  assert "did not settle within 1 s" in out.stderr and "Resume from the last checkpoint" in out.stderr


def test_streamed_subgroups_in_flight_are_budgeted_beside_the_step_peak(monkeypatch):
  """With the step's needs known, resident state plus the streaming slots fit the room beside the step's peak."""
  monkeypatch.setattr(jax_dos.memory.kinds, "device_free_bytes", lambda: None)  # the calibration's figure, on a GPU too
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  elements = sum(x.size for x in jax.tree.leaves(groups))
  largest = max(jax_dos.planning.plan.partition_groups(groups, 40)[1])
  free = 10 * jax_dos.planning.plan.STATE_BYTES * elements  # the peak leaves room for half the state and one slot
  cal = jax_dos.Calibration(2e9, 3e9, 50e9, 1.8e9, 2e9, device_free_bytes=free)
  peak = (
    int(free * (1 - 0.08))
    - jax_dos.planning.plan.STATE_BYTES * elements // 2
    - jax_dos.planning.plan.STAGING_BYTES * largest
  )
  planner = jax_dos.auto_planner(cal, step_memory=jax_dos.StepMemory(peak, 0), params_in_place=True)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, planner=planner)
  whole = tx.interleaved.plan_for(groups)
  assert whole.step_room_bytes is not None and 0 < whole.elements("device") < elements
  step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=NEVER,
                                micro_batches=2)  # fmt: skip
  largest_not_resident = max(n for n, p in zip(step.plan.sizes, step.plan.placements) if p != "device")
  slots = step.plan.stream_slots * jax_dos.planning.plan.STAGING_BYTES * largest_not_resident
  assert jax_dos.planning.plan.STATE_BYTES * step.plan.elements("device") + slots <= whole.step_room_bytes
  assert step.plan.elements("device") < whole.elements("device") or step.plan.stream_slots < STREAM_SLOTS
  for batch in batches:
    step(batch)
  check_against_reference(step, groups, batches, NEVER, 2)
  # With measured stages, the "stage" order's extra micro-batches' stage inputs come out of that room too.
  times = jax_dos.StagedModel(STAGES, len(groups)).measure_times(groups, jax.tree.map(lambda x: x[: ROWS // 3],
                                                                                      batches[0]))  # fmt: skip
  assert times.boundary_bytes == BLOCKS * (ROWS // 3) * D_H * 4 + (ROWS // 3) * D_H * 4  # the inputs of stages 1..4
  times = dataclasses.replace(times, boundary_bytes=jax_dos.planning.plan.STATE_BYTES * elements // 8)
  for order in ("batch", "stage"):
    ordered = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=NEVER,
                                     micro_batches=3, micro_batch_order=order, stage_times=times)  # fmt: skip
    extra = 2 * times.boundary_bytes if order == "stage" else 0
    largest_not_resident = max(n for n, p in zip(ordered.plan.sizes, ordered.plan.placements) if p != "device")
    slots = ordered.plan.stream_slots * jax_dos.planning.plan.STAGING_BYTES * largest_not_resident
    assert jax_dos.planning.plan.STATE_BYTES * ordered.plan.elements("device") + slots + extra <= whole.step_room_bytes
    ordered.close()


def test_the_optimizers_own_plan_is_kept():
  """The step plans nothing afresh: a new plan, made after tx.init's state took accelerator memory, would find the
  resident state's room already taken (at 6.7B on an H100 it left nothing resident). On a mesh: the sharded test."""
  rng = np.random.default_rng()
  groups = make_groups(rng)
  calls = []
  planner = jax_dos.auto_planner(jax_dos.Calibration(2e9, 3e9, 50e9, 1.8e9, 2e9))

  def counting(params, subgroup_size):
    calls.append(subgroup_size)
    return planner(params, subgroup_size)

  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, planner=counting)
  assert tx.interleaved.partition_replicated == "auto"
  step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), micro_batches=1)
  assert len(calls) == 1
  assert step.plan.subgroups == tx.interleaved.plan_for(groups).subgroups
  step.close()


def test_pacing_depth_changes_no_number():
  """The training thread paced one stage ahead or many: the same numbers as optax; a depth below one is refused."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  for depth in (1, 8):
    step, _ = overlapped_run(groups, batches, FIRES, 2, MIXED[: _subgroup_count(groups)], run_ahead_stages=depth)
    check_against_reference(step, groups, batches, FIRES, 2)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan="host")
  with pytest.raises(ValueError, match="run_ahead_stages"):
    jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), run_ahead_stages=0)


def test_a_host_budget_too_small_is_refused_before_anything_moves():
  """Above host_budget_bytes: a MemoryError naming the plain path, and params and state still usable there."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan="host")
  params, state = jax.tree.map(jnp.copy, groups), tx.init(groups)
  with pytest.raises(MemoryError, match="plain path"):
    jax_dos.OverlappedStep(tx, STAGES, params, state, micro_batches=2, host_budget_bytes=1)
  step = jax_dos.OverlappedStep(tx, STAGES, params, state, micro_batches=2, host_budget_bytes=2**40)
  for batch in batches:
    step(batch)
  check_against_reference(step, groups, batches, None, 2)


@pytest.mark.parametrize("late", ["host", "stream"])
def test_rebalancing_moves_subgroups_between_host_and_stream_and_keeps_the_numbers(monkeypatch, late):
  """The boundary moves away from the path made to look late, one subgroup a step, until the first move back;
  every step equals optax."""
  from jax_dos.overlap.plan import REBALANCE_AFTER_STEPS
  from jax_dos.overlap.step import OverlappedStep

  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(5 + REBALANCE_AFTER_STEPS)]
  plan = MIXED[: _subgroup_count(groups)]
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan=plan)
  step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=FIRES,
                                micro_batches=2, rebalance=True)  # fmt: skip
  hosts = step.plan.elements("host")
  real = OverlappedStep._move_boundary

  def seen_late(self, ends):  # the late path finishes a second after the other in the first two steps, then early
    moves.append(self.plan.elements("host"))
    first, then = {late: 1.0, other: 0.0}, {late: 0.0, other: 1.0}
    real(self, first if len(moves) <= 2 else then)

  other = "stream" if late == "host" else "host"
  moves: list[int] = []
  monkeypatch.setattr(OverlappedStep, "_move_boundary", seen_late)
  for batch in batches:
    step(batch)
  check_against_reference(step, groups, batches, FIRES, 2)
  fewer = (lambda a, b: a < b) if late == "host" else (lambda a, b: a > b)  # two subgroups left the late path
  assert moves[0] == hosts and fewer(moves[1], hosts) and fewer(moves[2], moves[1])
  assert step.plan.source.endswith("+rebalanced") and step._rebalance_left == 0  # the move back was refused
  assert step.plan.elements("host") == moves[2]
  step.close()


def test_stream_slots_change_no_number_and_a_dropped_step_ends_its_threads():
  """One slot or many (the stream worker tops each up as it frees): optax's numbers. A step dropped without close()
  is collected and its threads end: the stream worker's idle top-up holds it only weakly."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  for slots in (1, 8):
    step, _ = overlapped_run(groups, batches, FIRES, 2, "stream", stream_slots=slots)
    check_against_reference(step, groups, batches, FIRES, 2)
    step.close()
  step, _ = overlapped_run(groups, batches[:1], NEVER, 1, "stream")
  step.settle()
  threads = [w._thread for w in step._workers.threads]
  collected = weakref.ref(step)
  del step
  gc.collect()
  assert collected() is None
  for thread in threads:
    thread.join(timeout=10)
    assert not thread.is_alive(), thread.name


def test_a_workers_results_come_back_through_futures_and_its_failure_skips_the_rest():
  """A worker thread's job gives its result through a future; its first error fails that future, sets the owner's
  one failure event and skips the jobs queued behind it; once the thread has ended its owner runs a job itself."""
  failure = Failure()
  worker = JobThread("test-worker", failure)
  x = int(np.random.default_rng().integers(1000))
  assert worker.submit(lambda a: a + 1, x).result(timeout=60) == x + 1
  assert failure.error() is None
  failing, later = worker.submit(lambda: 1 / 0), worker.submit(lambda: x)
  with pytest.raises(ZeroDivisionError):
    failing.result(timeout=60)
  worker.join()
  assert later.cancelled() and isinstance(failure.error(), ZeroDivisionError)
  failure.report(ValueError("later"))  # the first error is the one kept
  assert isinstance(failure.error(), ZeroDivisionError)
  worker.stop()
  assert worker.ask(lambda: x) == x


def test_a_wait_on_another_threads_future_ends_when_any_thread_fails():
  """``result_of`` waits on the future and on the failure event at once: a result that will never come ends the wait
  as soon as another thread fails (no polling interval to sit out), with that error as the cause."""
  failure, never = Failure(), Future()
  ready = Future()
  ready.set_result(7)
  assert result_of(ready, failure, "a result") == 7
  other = JobThread("test-other", failure)
  other.submit(time.sleep, 0.2)
  other.submit(lambda: {}["missing"])
  t = time.perf_counter()
  with pytest.raises(RuntimeError, match="waited for new parameters") as raised:
    result_of(never, failure, "new parameters")
  assert isinstance(raised.value.__cause__, KeyError) and time.perf_counter() - t < 30
  other.stop()


def test_one_micro_batch_runs_one_stage_ahead_by_default_and_a_given_value_is_kept():
  from jax_dos.overlap.plan import StepOptions

  assert StepOptions(1).run_ahead_stages == 1
  assert StepOptions(int(np.random.default_rng().integers(2, 9))).run_ahead_stages == 2
  assert StepOptions(1, run_ahead_stages=3).run_ahead_stages == 3
  with pytest.raises(ValueError, match="run_ahead_stages"):
    StepOptions(1, run_ahead_stages=0)


def test_the_fired_redos_share_counts_the_host_kernel_alone_where_the_calibration_measured_it():
  """After a fired clip's decision the host worker only runs the kernel: where the calibration measured it alone, the
  stream path's share of the host subgroups is sized from that rate (at the host path's concurrent slowdown), so a
  faster kernel keeps more of them; unmeasured (0), the host path's concurrent rate sizes it."""
  from jax_dos.overlap import plan as overlap_plan
  from jax_dos.overlap import routes as overlap_routes
  from jax_dos.staged.stages import StagedModel

  rng = np.random.default_rng()
  groups = make_groups(rng)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan="host")
  users = jax_dos.overlapped_plan(tx, STAGES, groups, micro_batches=2)
  layout = overlap_plan.step_layout(StagedModel(STAGES, len(groups)), groups, 40)
  rate = float(rng.uniform(1e8, 1e10))
  cal = {"host_rate": rate, "host_rate_concurrent": rate, "stream_rate_concurrent": rate}

  def share(kernel: float) -> int:  # the stream path's parameters
    measured = {**cal, "host_kernel_rate": kernel}
    plan = users.with_placements(users.placements, source="model+timeline", calibration=measured)
    return sum(layout.sizes[s] for s in overlap_routes.stream_share_of_host(plan, layout))

  assert share(0.0) == share(rate) and share(rate)
  assert share(3 * rate) < share(rate)  # spread through the forward order, fewer parameters


def test_the_fired_redo_switch_leaves_every_host_subgroup_to_the_host_kernel(monkeypatch):
  """``JAX_DOS_FIRED_REDO_ON_STREAM=0`` (a measurement's switch, ``bench/fired_redo.sh``): no host subgroup is shared
  with the stream path after a decision; any other value keeps the plan's share."""
  from jax_dos.overlap import plan as overlap_plan
  from jax_dos.overlap import routes as overlap_routes
  from jax_dos.staged.stages import StagedModel

  rng = np.random.default_rng()
  groups = make_groups(rng)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan="host")
  users = jax_dos.overlapped_plan(tx, STAGES, groups, micro_batches=2)
  layout = overlap_plan.step_layout(StagedModel(STAGES, len(groups)), groups, 40)
  cal = {"host_rate": 1e9, "host_rate_concurrent": 1e9, "stream_rate_concurrent": 1e9}
  plan = users.with_placements(users.placements, source="model+timeline", calibration=cal)
  monkeypatch.setenv("JAX_DOS_FIRED_REDO_ON_STREAM", "1")
  assert overlap_routes.stream_share_of_host(plan, layout)
  monkeypatch.setenv("JAX_DOS_FIRED_REDO_ON_STREAM", "0")
  assert overlap_routes.stream_share_of_host(plan, layout) == set()
