"""The overlapped step (``jax_dos.OverlappedStep``) against ``optax.chain(clip_by_global_norm, adamw)``.

The model is a small staged network with a head tied to the first stage's
weights, every gradient well away from zero (a GPT's key biases have none
mathematically, and Adam turns their rounding noise into whole steps, so two
exact implementations part there after a step). The reference gets the
gradients of the same stage programs (``StagedModel.loss_and_grads``) at its
own parameters, summed over the micro-batches in the gradients' dtype and in
the step's order, then takes their mean.
"""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import cpu_devices_env, max_rel_diff

import jax_dos
from jax_dos.job_thread import JobThread
from jax_dos.overlap import STREAM_SLOTS

D_IN, D_H, BLOCKS, ROWS = 6, 8, 3, 8
LR, WD, B1, B2 = 1e-2, 0.1, 0.9, 0.95
FIRES, NEVER = 1e-3, 1e6  # clip norms: one every step's gradient exceeds, one none does


def _embed(params, x, batch):
  (g,) = params
  return jnp.tanh(batch[0].astype(g["w"].dtype) @ g["w"] + g["b"])


def _block(params, x, batch):
  (g,) = params
  return x + jnp.tanh(x @ g["w"] + g["b"])


def _head(params, x, batch):
  head, embed = params
  out = (x * head["scale"]).astype(jnp.float32) @ embed["w"].astype(jnp.float32).T
  return jnp.mean((out - batch[1]) ** 2)


STAGES = [jax_dos.Stage(_embed, (0,)), *(jax_dos.Stage(_block, (1 + i,)) for i in range(BLOCKS))]
STAGES.append(jax_dos.Stage(_head, (BLOCKS + 1, 0)))


def make_groups(rng: np.random.Generator, dtype=jnp.float32) -> list:
  def normal(*shape):
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0] if shape else 1), dtype)

  blocks = [{"b": normal(D_H), "w": normal(D_H, D_H)} for _ in range(BLOCKS)]
  return [{"b": normal(D_H), "w": normal(D_IN, D_H)}, *blocks, {"scale": 1 + normal(D_H)}]


def make_batch(rng: np.random.Generator) -> tuple[jax.Array, jax.Array]:
  return tuple(jnp.asarray(rng.standard_normal((ROWS, D_IN)), jnp.float32) for _ in range(2))


def reference_run(groups, batches, clip_norm, micro_batches, order="stage"):
  """``optax.chain(clip_by_global_norm, adamw)`` on float32 masters; returns ``(masters, optax state)``."""
  model = jax_dos.StagedModel(STAGES, len(groups))
  ref = optax.chain(
    optax.clip_by_global_norm(clip_norm) if clip_norm else optax.identity(),
    optax.adamw(LR, b1=B1, b2=B2, weight_decay=WD),
  )
  masters = jax.tree.map(lambda p: p.astype(jnp.float32), groups)
  state = ref.init(masters)
  for batch in batches:
    params = jax.tree.map(lambda m, p: m.astype(p.dtype), masters, groups)
    _, total = model.loss_and_grads(params, batch, micro_batches, order)  # the step's programs, in its order
    mean = jax.tree.map(lambda g: g.astype(jnp.float32) * jnp.float32(1 / micro_batches), total)
    updates, state = ref.update(mean, state, masters)
    masters = optax.apply_updates(masters, updates)
  return masters, state


def overlapped_run(groups, batches, clip_norm, micro_batches, plan, tx_kw=None, **step_kw):
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan=plan, **(tx_kw or {}))
  step = jax_dos.OverlappedStep(
    tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=clip_norm, micro_batches=micro_batches,
    **step_kw,
  )  # fmt: skip
  losses = [float(step(batch)) for batch in batches]
  return step, losses


def adam_state(ref_state):
  return next(s for s in jax.tree.leaves(ref_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
              if isinstance(s, optax.ScaleByAdamState))  # fmt: skip


def check_against_reference(step, groups, batches, clip_norm, micro_batches, tol=1e-5):
  masters, ref_state = reference_run(groups, batches, clip_norm, micro_batches, step.micro_batch_order)
  state = step.opt_state
  assert int(state.count) == len(batches)
  adam = adam_state(ref_state)
  for ours, theirs in ((state.master, masters), (state.mu, adam.mu), (state.nu, adam.nu)):
    assert max_rel_diff(ours, theirs) < tol
  params = step.params
  for p, m, g in zip(jax.tree.leaves(params), jax.tree.leaves(state.master), jax.tree.leaves(groups)):
    assert p.dtype == g.dtype
    np.testing.assert_array_equal(np.asarray(p), np.asarray(m).astype(p.dtype))  # params are the masters, cast


MIXED = ["device", "host", "stream", "host", "device", "stream"] * 3


@pytest.mark.parametrize("plan", ["device", "stream", "host", "mixed", "auto"])
@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
def test_equals_optax_chain(plan, clip_norm):
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(4)]
  spec = plan if plan != "mixed" else MIXED[: _subgroup_count(groups)]
  step, _ = overlapped_run(groups, batches, clip_norm, 2, spec)
  if plan != "auto":
    assert set(step.plan.placements) == ({plan} if plan != "mixed" else {"device", "stream", "host"})
  check_against_reference(step, groups, batches, clip_norm, 2)


def _subgroup_count(groups) -> int:
  return len(jax_dos.plan.partition_groups(groups, 40)[0])


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
    programs = jax_dos.stages.schedule(n, k, order)
    assert sorted(programs) == sorted([("forward", i, m) for i in range(n - 1) for m in range(k)]
                                      + [("backward", i, m) for i in range(n) for m in range(k)])  # fmt: skip
    for m in range(k):  # each micro-batch: its forward pass, then its backward pass from the last stage
      mine = [(kind, i) for kind, i, mm in programs if mm == m]
      assert mine == [("forward", i) for i in range(n - 1)] + [("backward", i) for i in reversed(range(n))]
  stage = jax_dos.stages.schedule(n, k, "stage")
  assert stage[:k] == [("forward", 0, m) for m in range(k)]
  assert all(kind == "backward" for kind, _, _ in stage[(n - 1) * k :])  # one backward pass of every micro-batch
  with pytest.raises(ValueError, match="micro_batch_order"):
    jax_dos.stages.schedule(n, k, "interleaved")


@pytest.mark.parametrize("order", ["stage", "batch"])
@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
def test_both_micro_batch_orders_equal_optax_chain(order, clip_norm):
  rng = np.random.default_rng()
  groups = make_groups(rng)
  batches = [tuple(jnp.asarray(rng.standard_normal((12, D_IN)), jnp.float32) for _ in range(2)) for _ in range(3)]
  step, _ = overlapped_run(groups, batches, clip_norm, 3, MIXED[: _subgroup_count(groups)], micro_batch_order=order)
  assert step.micro_batch_order == order
  check_against_reference(step, groups, batches, clip_norm, 3)


@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
def test_streamed_speculation_is_held_to_the_host_budget(clip_norm):
  """A budget that holds the state but speculation on one subgroup (or none): the stream worker waits for the
  decision past it, the host bytes stay within the budget, and the numbers are optax's."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan="stream")
  sizes = jax_dos.plan.partition_groups(groups, 40)[1]
  state_bytes = 12 * sum(sizes)
  for speculated in (0, max(sizes)):
    budget = state_bytes + 12 * speculated
    step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=clip_norm,
                                  micro_batches=2, host_budget_bytes=budget)  # fmt: skip
    assert step.stream_speculation == speculated and step.host_bytes() <= budget
    for batch in batches:
      step(batch)
      assert step._last_record.stream.speculated_elements <= speculated
    check_against_reference(step, groups, batches, clip_norm, 2)
    step.close()
  with pytest.raises(MemoryError, match="plain path"):
    jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups), host_budget_bytes=state_bytes - 1)


def test_one_micro_batch_and_no_clip():
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  step, _ = overlapped_run(groups, batches, None, 1, "host")
  check_against_reference(step, groups, batches, None, 1)


@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
@pytest.mark.parametrize("steps", [1, 3])
def test_bfloat16_parameters(clip_norm, steps):
  """One step: optax's numbers. Later steps' gradients are taken at bfloat16 weights, where a master one float32
  rounding apart can round to a neighbouring bfloat16, so the trajectories part by more than rounding."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng, jnp.bfloat16), [make_batch(rng) for _ in range(steps)]
  step, _ = overlapped_run(groups, batches, clip_norm, 2, MIXED[: _subgroup_count(groups)])
  check_against_reference(step, groups, batches, clip_norm, 2, tol=1e-5 if steps == 1 else 1e-3)


def test_clip_decision_is_speculated_and_redone():
  """A firing clip redoes the speculated host weights; a silent one keeps them (the trace of the second step says
  which: the first step's workers start only once its last program is dispatched, maybe after the decision)."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  for clip_norm, redone in ((FIRES, True), (NEVER, False)):
    step, _ = overlapped_run(groups, batches[:1], clip_norm, 1, "host", speculation="always")
    step.settle()
    with jax_dos.trace.recording() as spans:
      step(batches[1])
      step.settle()
    names = {s.name for s in spans}
    (decided,) = [s.end for s in spans if s.name == "decide.read"]
    if any(s.name == "host.kernel" and s.start < decided for s in spans):  # it speculated (else: one true step)
      assert ("host.redo" in names) == redone
    else:
      assert "host.redo" not in names
    assert {"host.kernel", "decide.read"} <= names
    assert any(s.thread == "accelerator" and s.name.startswith("backward") for s in spans)


@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
def test_speculation_follows_the_last_steps_clip(clip_norm):
  """By default a step speculates only where the last step's clip was silent; after a fired one the host kernel runs
  once, after the decision. Every mode gives optax's numbers, and the same bits."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  plan = MIXED[: _subgroup_count(groups)]
  runs = []
  for mode in ("silent", "always", "never"):
    step, _ = overlapped_run(groups, batches[:2], clip_norm, 2, plan, speculation=mode)
    step.settle()
    with jax_dos.trace.recording() as spans:
      step(batches[2])
      step.settle()
    names = {s.name for s in spans}
    waited = mode == "never" or (mode == "silent" and clip_norm == FIRES)
    (decided,) = [s.end for s in spans if s.name == "decide.read"]
    if waited:  # every host kernel after the decision (a subgroup whose gradients came after it never waited)
      assert min(s.start for s in spans if s.name == "host.kernel") >= decided
    else:
      assert "host.kernel_after_decision" not in names
    # A kernel that ran before the decision speculated; a fired clip redoes it, on the host or in the stream path's
    # share. (A host worker that comes to its subgroups after the decision steps them once, with the true scale.)
    speculated = any(s.name == "host.kernel" and s.start < decided for s in spans)
    if clip_norm == FIRES and speculated:
      assert {"host.redo", "stream.redo_host"} & names, names
    if waited or clip_norm != FIRES:
      assert "host.redo" not in names
    check_against_reference(step, groups, batches, clip_norm, 2)
    runs.append(jax.tree.leaves((step.params, step.opt_state)))
    step.close()
  for other in runs[1:]:
    for a, b in zip(runs[0], other):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
  programs = (jax_dos.stages._jit_forward._cache_size(), jax_dos.stages._jit_backward._cache_size())
  for batch in batches[1:]:
    step(batch)
  step.settle()
  assert (jax_dos.stages._jit_forward._cache_size(), jax_dos.stages._jit_backward._cache_size()) == programs
  check_against_reference(step, groups, batches, FIRES, 2)


def test_a_fired_clips_redo_is_shared_by_both_paths_and_deterministic():
  """With the clip firing, the stream path steps a fixed share of the host subgroups (the last ones) on the
  accelerator while the host kernel redoes the others: optax's numbers, and the same bits in two runs."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  plan = ["device", "stream"] + ["host"] * (_subgroup_count(groups) - 2)
  runs = []
  for _ in range(2):
    with jax_dos.trace.recording() as spans:
      step, _ = overlapped_run(groups, batches, FIRES, 2, plan)
      step.settle()
    shared = step.routes.redo_on_stream
    hosts = [s for s in step._forward_order if step.plan.placements[s] == "host"]
    assert shared and shared == set(hosts[len(hosts) - len(shared) :]) and len(shared) < len(hosts)
    assert "stream.redo_host" in {s.name for s in spans}
    check_against_reference(step, groups, batches, FIRES, 2)
    runs.append(jax.tree.leaves((step.params, step.opt_state)))
    step.close()
  for a, b in zip(*runs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_fired_clip_is_shared_with_the_stream_path_where_the_models_plan_streams_nothing():
  """A plan of the model's that keeps nothing on the stream path still steps the last host subgroups on the
  accelerator when the clip fires (its stream slots are budgeted beside the step's peak): optax's numbers. A user's
  all-host plan keeps the host kernel alone."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan="host")
  users = jax_dos.overlapped_plan(tx, STAGES, groups, micro_batches=2)
  models = users.with_placements(users.placements, source="model+timeline", predicted={})
  for planned, shared in ((users, False), (models, True)):
    with jax_dos.trace.recording() as spans:
      step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), clip_norm=FIRES, micro_batches=2,
                                    plan=planned)  # fmt: skip
      for batch in batches:
        step(batch)
      step.settle()
    assert bool(step.routes.redo_on_stream) == shared
    assert ("stream.redo_host" in {s.name for s in spans}) == shared
    check_against_reference(step, groups, batches, FIRES, 2)
    step.close()


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("low_dtype", ["float32", "bfloat16"])
def test_kernel_into_spare_buffers_is_the_in_place_kernel(grad_dtype, low_dtype):
  rng = np.random.default_rng()
  n = 1000
  g = np.asarray(jnp.asarray(rng.standard_normal(n), grad_dtype))
  p, m, v = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
  v = np.abs(v)
  old = (p.copy(), m.copy(), v.copy())
  outs = [np.full(n, np.nan, np.float32) for _ in range(3)]
  low, low_ref = (np.zeros(n, jnp.dtype(low_dtype)) for _ in range(2))
  kw = dict(b1=0.9, b2=0.95, eps=1e-8, eps_root=0.0, weight_decay=0.1, scalars=np.float32([-1e-2, 0.1, 0.05, 0.5]))
  jax_dos.host_kernels.adam_many_into([(g, p, m, v, *outs, low)], [True], **kw)
  for a, b in zip((p, m, v), old):
    np.testing.assert_array_equal(a, b)  # the state is left as it was
  jax_dos.host_kernels.adam_many([(g, p, m, v, low_ref)], [True], **kw)
  for a, b in zip(outs + [low], (p, m, v, low_ref)):
    np.testing.assert_array_equal(a, b)


def test_non_finite_gradients_propagate_as_in_optax():
  rng = np.random.default_rng()
  groups = make_groups(rng)
  x, y = make_batch(rng)
  batches = [(x.at[0, 0].set(jnp.inf), y)]
  step, losses = overlapped_run(groups, batches, 1.0, 1, MIXED[: _subgroup_count(groups)])
  masters, _ = reference_run(groups, batches, 1.0, 1)
  for ours, theirs in zip(jax.tree.leaves(step.opt_state.master), jax.tree.leaves(masters)):
    np.testing.assert_array_equal(np.isnan(np.asarray(ours)), np.isnan(np.asarray(theirs)))


def test_resume_from_checkpoint_is_bit_exact(tmp_path):
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(4)]
  plan = MIXED[: _subgroup_count(groups)]
  whole, _ = overlapped_run(groups, batches, FIRES, 2, plan)

  first, _ = overlapped_run(groups, batches[:2], FIRES, 2, plan)
  with jax_dos.CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    mgr.save(2, params=first.params, opt_state=first.opt_state, force=True)
    mgr.wait_until_finished()
    tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan=plan)
    template = make_groups(rng)
    params, state, _ = mgr.restore(2, params=template, opt_state=tx.init(template))
  resumed = jax_dos.OverlappedStep(tx, STAGES, params, state, clip_norm=FIRES, micro_batches=2)
  for batch in batches[2:]:
    resumed(batch)
  ours, theirs = (resumed.params, resumed.opt_state), (whole.params, whole.opt_state)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
  times = jax_dos.StageTimes((0.1,) * 3, (0.2,) * 3)
  with pytest.raises(ValueError, match="stage_times has 3 stages, the model 5"):
    jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups), stage_times=times)
  step = jax_dos.OverlappedStep(tx, STAGES, groups, tx.init(groups), micro_batches=3)
  with pytest.raises(ValueError, match="divisible by micro_batches=3"):
    step(make_batch(rng))
  step.close()
  with pytest.raises(RuntimeError, match="closed"):
    step(make_batch(rng))


SHARDED = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, sys
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    import dataclasses
    import jax_dos
    from jax_dos import overlap_plan, partition
    import test_overlap as t

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng()
    spec = lambda x: P("data", "model") if x.ndim == 2 else P("model")
    for dtype in (jnp.float32, jnp.bfloat16):  # bfloat16 over 3 steps: trajectories part (test_bfloat16_parameters)
        groups = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), t.make_groups(rng, dtype))
        batches = [t.make_batch(rng) for _ in range(3)]
        for clip in (t.FIRES, t.NEVER):
            step, _ = t.overlapped_run(groups, batches, clip, 2, t.MIXED[: t._subgroup_count(groups)])
            t.check_against_reference(step, groups, batches, clip, 2, tol=1e-5 if dtype == jnp.float32 else 1e-3)
            # The vectors (replicated over "data") have their state partitioned over it (the default), as tx.init's.
            for m, p in zip(jax.tree.leaves(step.opt_state.master), jax.tree.leaves(groups)):
                want = partition.state_sharding(p) or p.sharding
                assert m.sharding.is_equivalent_to(want.with_memory_kind(m.sharding.memory_kind), p.ndim), m
    # Data-parallel: parameters replicated over "data" (sharded over "model"), batch rows over "data". Each stage's
    # backward program reduces its gradients over "data"; the norm is the whole batch's, so the clip is exact. The
    # state is partitioned over "data": each device holds and updates half of it.
    rows = NamedSharding(mesh, P("data"))
    replicated = lambda x: P(None, "model") if x.ndim == 2 else P("model")
    groups = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, replicated(x))), t.make_groups(rng))
    batches = [jax.device_put(t.make_batch(rng), rows) for _ in range(3)]
    for clip in (t.FIRES, t.NEVER):
        step, _ = t.overlapped_run(groups, batches, clip, 2, t.MIXED[: t._subgroup_count(groups)])
        assert bool(step.grad_norm > clip) == (clip == t.FIRES)
        t.check_against_reference(step, groups, batches, clip, 2)
        for m, p in zip(jax.tree.leaves(step.opt_state.master), jax.tree.leaves(groups)):
            want = partition.state_sharding(p)
            assert want is not None, p.sharding
            assert m.sharding.is_equivalent_to(want.with_memory_kind(m.sharding.memory_kind), p.ndim), m
        # The restore template is the state's layout: partitioned, in the plan's memory kinds.
        for tree, want in zip(step.opt_state[1:], jax_dos.abstract_state(step.plan, groups)[1:]):
            for x, a in zip(jax.tree.leaves(tree), jax.tree.leaves(want)):
                assert (x.shape, x.dtype) == (a.shape, a.dtype) and x.sharding.is_equivalent_to(a.sharding, x.ndim), a
    # partition_replicated=False: a whole copy of the state per device, in the parameters' layout.
    step, _ = t.overlapped_run(groups, batches, t.FIRES, 2, "host", tx_kw={"partition_replicated": False})
    t.check_against_reference(step, groups, batches, t.FIRES, 2)
    for m, p in zip(jax.tree.leaves(step.opt_state.master), jax.tree.leaves(groups)):
        assert m.sharding.is_equivalent_to(p.sharding.with_memory_kind(m.sharding.memory_kind), p.ndim), m
    # Its host bytes count both copies this process holds (the pinned state's shards on its 4 devices: twice the
    # arrays), where partitioned it holds each element once.
    state = [a for a in jax.tree.leaves(step.opt_state) if a.sharding.memory_kind == "pinned_host"]
    held = sum(shard.data.nbytes for a in state for shard in a.addressable_shards)
    assert held == 2 * sum(a.nbytes for a in state) == 12 * sum(step._layout.held), held
    whole = dataclasses.replace(step._layout, leaf_held=())  # each element once
    assert step.host_bytes() == 2 * overlap_plan.host_bytes(step.plan, whole, 0)
    template = jax_dos.abstract_state(step.plan, groups, partition_replicated=False)
    for x, a in zip(jax.tree.leaves(step.opt_state.master), jax.tree.leaves(template.master)):
        assert x.sharding.is_equivalent_to(a.sharding, x.ndim), a
    # plan="auto": the step sizes its placements from the plan tx.init made (partitioned), and plans nothing again.
    calls = []
    planner = jax_dos.auto_planner(jax_dos.Calibration(2e9, 3e9, 50e9, 1.8e9, 2e9))
    counting = lambda params, size: calls.append(size) or planner(params, size)
    tx = jax_dos.interleaved_adamw(t.LR, b1=t.B1, b2=t.B2, weight_decay=t.WD, subgroup_size=40, planner=counting)
    step = jax_dos.OverlappedStep(tx, t.STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), micro_batches=2)
    for batch in batches:
        step(batch)
    t.check_against_reference(step, groups, batches, None, 2, tol=1e-3)
    assert len(calls) == 1, calls
    print("sharded ok")
  """
)


def test_sharded_on_four_devices():
  env = cpu_devices_env(4)
  root = Path(__file__).resolve().parent.parent
  out = subprocess.run([sys.executable, "-c", SHARDED], cwd=root, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "sharded ok" in out.stdout


EXIT_PENDING = textwrap.dedent(
  """
    import sys
    import numpy as np
    sys.path.insert(0, "tests")
    import test_overlap as t

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
    import jax_dos.overlap_process
    import test_overlap as t

    jax_dos.overlap_process.EXIT_SETTLE_S = 1.0
    rng = np.random.default_rng()
    groups = t.make_groups(rng)
    step, _ = t.overlapped_run(groups, [t.make_batch(rng)], t.NEVER, 2, "host")
    step._host.submit(threading.Event().wait)  # a worker that never comes back (a fault would leave it so)
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
  monkeypatch.setattr(jax_dos.memory, "device_free_bytes", lambda: None)  # the calibration's figure, on a GPU too
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(2)]
  elements = sum(x.size for x in jax.tree.leaves(groups))
  largest = max(jax_dos.plan.partition_groups(groups, 40)[1])
  free = 10 * jax_dos.plan.STATE_BYTES * elements  # the peak leaves room for half the state and one slot
  cal = jax_dos.Calibration(2e9, 3e9, 50e9, 1.8e9, 2e9, device_free_bytes=free)
  peak = int(free * (1 - 0.08)) - jax_dos.plan.STATE_BYTES * elements // 2 - jax_dos.plan.STAGING_BYTES * largest
  planner = jax_dos.auto_planner(cal, step_memory=jax_dos.StepMemory(peak, 0), params_in_place=True)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, planner=planner)
  whole = tx.interleaved.plan_for(groups)
  assert whole.step_room_bytes is not None and 0 < whole.elements("device") < elements
  step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=NEVER,
                                micro_batches=2)  # fmt: skip
  largest_not_resident = max(n for n, p in zip(step.plan.sizes, step.plan.placements) if p != "device")
  slots = step.plan.stream_slots * jax_dos.plan.STAGING_BYTES * largest_not_resident
  assert jax_dos.plan.STATE_BYTES * step.plan.elements("device") + slots <= whole.step_room_bytes
  assert step.plan.elements("device") < whole.elements("device") or step.plan.stream_slots < STREAM_SLOTS
  for batch in batches:
    step(batch)
  check_against_reference(step, groups, batches, NEVER, 2)
  # With measured stages, the "stage" order's extra micro-batches' stage inputs come out of that room too.
  times = jax_dos.StagedModel(STAGES, len(groups)).measure_times(groups, jax.tree.map(lambda x: x[: ROWS // 3],
                                                                                      batches[0]))  # fmt: skip
  assert times.boundary_bytes == BLOCKS * (ROWS // 3) * D_H * 4 + (ROWS // 3) * D_H * 4  # the inputs of stages 1..4
  times = dataclasses.replace(times, boundary_bytes=jax_dos.plan.STATE_BYTES * elements // 8)
  for order in ("batch", "stage"):
    ordered = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=NEVER,
                                     micro_batches=3, micro_batch_order=order, stage_times=times)  # fmt: skip
    extra = 2 * times.boundary_bytes if order == "stage" else 0
    largest_not_resident = max(n for n, p in zip(ordered.plan.sizes, ordered.plan.placements) if p != "device")
    slots = ordered.plan.stream_slots * jax_dos.plan.STAGING_BYTES * largest_not_resident
    assert jax_dos.plan.STATE_BYTES * ordered.plan.elements("device") + slots + extra <= whole.step_room_bytes
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
  import jax_dos.overlap as overlap

  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(5 + overlap.REBALANCE_AFTER_STEPS)]
  plan = MIXED[: _subgroup_count(groups)]
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan=plan)
  step = jax_dos.OverlappedStep(tx, STAGES, jax.tree.map(jnp.copy, groups), tx.init(groups), clip_norm=FIRES,
                                micro_batches=2, rebalance=True)  # fmt: skip
  hosts = step.plan.elements("host")
  real = overlap.OverlappedStep._move_boundary

  def seen_late(self, ends):  # the late path finishes a second after the other in the first two steps, then early
    moves.append(self.plan.elements("host"))
    first, then = {late: 1.0, other: 0.0}, {late: 0.0, other: 1.0}
    real(self, first if len(moves) <= 2 else then)

  other = "stream" if late == "host" else "host"
  moves: list[int] = []
  monkeypatch.setattr(overlap.OverlappedStep, "_move_boundary", seen_late)
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
  threads = [w._thread for w in (step._host, step._streamer, step._decider)]
  collected = weakref.ref(step)
  del step
  gc.collect()
  assert collected() is None
  for thread in threads:
    thread.join(timeout=10)
    assert not thread.is_alive(), thread.name


def test_a_workers_results_come_back_through_futures_and_its_failure_skips_the_rest():
  """A worker thread's job gives its result through a future; its first error is kept on its own list, fails its
  future and skips the jobs queued behind it; once the thread has ended its owner runs a job itself."""
  worker = JobThread("test-worker", threading.Condition())
  x = int(np.random.default_rng().integers(1000))
  assert worker.submit(lambda a: a + 1, x).result(timeout=60) == x + 1
  failing, later = worker.submit(lambda: 1 / 0), worker.submit(lambda: x)
  with pytest.raises(ZeroDivisionError):
    failing.result(timeout=60)
  worker.join()
  assert later.cancelled() and isinstance(worker.errors[0], ZeroDivisionError)
  worker.stop()
  assert worker.ask(lambda: x) == x


def test_one_micro_batch_runs_one_stage_ahead_by_default_and_a_given_value_is_kept():
  from jax_dos import overlap_plan

  assert overlap_plan.StepOptions(1).run_ahead_stages == 1
  assert overlap_plan.StepOptions(int(np.random.default_rng().integers(2, 9))).run_ahead_stages == 2
  assert overlap_plan.StepOptions(1, run_ahead_stages=3).run_ahead_stages == 3
  with pytest.raises(ValueError, match="run_ahead_stages"):
    overlap_plan.StepOptions(1, run_ahead_stages=0)


def test_the_fired_redos_share_counts_the_host_kernel_alone_where_the_calibration_measured_it():
  """After a fired clip's decision the host worker only runs the kernel: where the calibration measured it alone, the
  stream path's share of the host subgroups is sized from that rate (at the host path's concurrent slowdown), so a
  faster kernel keeps more of them; unmeasured (0), the host path's concurrent rate sizes it."""
  from jax_dos import overlap_plan
  from jax_dos.stages import StagedModel

  rng = np.random.default_rng()
  groups = make_groups(rng)
  tx = jax_dos.interleaved_adamw(LR, b1=B1, b2=B2, weight_decay=WD, subgroup_size=40, plan="host")
  users = jax_dos.overlapped_plan(tx, STAGES, groups, micro_batches=2)
  layout = overlap_plan.step_layout(StagedModel(STAGES, len(groups)), groups, 40)
  rate = float(rng.uniform(1e8, 1e10))
  cal = {"host_rate": rate, "host_rate_concurrent": rate, "stream_rate_concurrent": rate}

  def share(kernel: float) -> set:
    measured = {**cal, "host_kernel_rate": kernel}
    plan = users.with_placements(users.placements, source="model+timeline", calibration=measured)
    return overlap_plan.stream_share_of_host(plan, layout)

  assert share(0.0) == share(rate) and share(rate)
  assert share(3 * rate) < share(rate)  # the last ones in forward order, fewer of them
