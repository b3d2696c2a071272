"""The overlapped step's numbers (``jax_dos.OverlappedStep``) against ``optax.chain(clip_by_global_norm, adamw)``.

Every placement plan, both micro-batch orders, one micro-batch or several, float32 and bfloat16 parameters, the clip
firing and silent with the speculation on its decision and the redo of a fired one (on the host, or shared with the
stream path, and the redo's kernel against the in-place one), non-finite gradients, a resume from a checkpoint, and
a mesh of four devices. The model and the reference are ``overlap_model``'s.
"""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from overlap_model import (
  B1,
  B2,
  D_IN,
  FIRES,
  LR,
  MIXED,
  NEVER,
  STAGES,
  WD,
  _subgroup_count,
  check_against_reference,
  make_batch,
  make_groups,
  overlapped_run,
  reference_run,
)

import jax_dos
from jax_dos.overlap import routes as overlap_routes


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


@pytest.mark.parametrize("order", ["stage", "batch"])
@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
def test_both_micro_batch_orders_equal_optax_chain(order, clip_norm):
  rng = np.random.default_rng()
  groups = make_groups(rng)
  batches = [tuple(jnp.asarray(rng.standard_normal((12, D_IN)), jnp.float32) for _ in range(2)) for _ in range(3)]
  step, _ = overlapped_run(groups, batches, clip_norm, 3, MIXED[: _subgroup_count(groups)], micro_batch_order=order)
  assert step.micro_batch_order == order
  check_against_reference(step, groups, batches, clip_norm, 3)


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
    if not redone:  # a silent clip keeps what was speculated
      assert "host.redo" not in names
    elif any(s.name == "host.kernel" and s.start < decided for s in spans):  # speculated before the decision existed
      assert "host.redo" in names
    # (a kernel started after the decision was read may still have speculated: the worker learns it a moment later)
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


def test_a_fired_clips_redo_is_shared_by_both_paths_and_deterministic():
  """With the clip firing, the stream path steps a fixed share of the host subgroups (spread through the forward
  order, ``jax_dos.planning.fired.fired_share``) on the accelerator while the host kernel redoes the others: optax's
  numbers, and the same bits in two runs."""
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
    assert shared == overlap_routes.stream_share_of_host(step.plan, step._layout) and 0 < len(shared) < len(hosts)
    assert "stream.redo_host" in {s.name for s in spans}
    check_against_reference(step, groups, batches, FIRES, 2)
    runs.append(jax.tree.leaves((step.params, step.opt_state)))
    step.close()
  for a, b in zip(*runs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_fired_clip_is_shared_with_the_stream_path_where_the_models_plan_streams_nothing():
  """A plan of the model's that keeps nothing on the stream path still steps a share of the host subgroups on the
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
  jax_dos.kernels.host_kernels.adam_many_into([(g, p, m, v, *outs, low)], [True], **kw)
  for a, b in zip((p, m, v), old):
    np.testing.assert_array_equal(a, b)  # the state is left as it was
  jax_dos.kernels.host_kernels.adam_many([(g, p, m, v, low_ref)], [True], **kw)
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
    # Into ordinary host memory (each offloaded leaf whole on the CPU device), which the step moves into its arena.
    staged_t = jax_dos.abstract_state(first.plan, template, host_kind="unpinned_host")
    assert jax_dos.abstract_state(first.plan, template, host_kind="auto") == staged_t  # a process of its own
    with pytest.raises(ValueError, match="host_kind must be one of"):
      jax_dos.abstract_state(first.plan, template, host_kind="pinned")
    params2, staged, _ = mgr.restore(2, params=template, opt_state=staged_t)
    _, wrong, _ = mgr.restore(2, params=template, opt_state=staged_t)
  tx16 = jax_dos.interleaved_adamw(LR, subgroup_size=40, plan=plan, moments="bfloat16")
  with pytest.raises(ValueError, match="restore into jax_dos.abstract_state"):  # float32 moments, bfloat16 kept
    jax_dos.OverlappedStep(tx16, STAGES, params2, wrong, clip_norm=FIRES, micro_batches=2)
  assert not any(x.is_deleted() for x in jax.tree.leaves(wrong)), "a refused state is left as it was given"
  offloaded = [x for x in jax.tree.leaves(staged[1:]) if x.sharding.memory_kind == "unpinned_host"]
  assert offloaded and len(offloaded) < len(jax.tree.leaves(staged[1:])), "the plan mixes placements"
  resumed = jax_dos.OverlappedStep(tx, STAGES, params, state, clip_norm=FIRES, micro_batches=2)
  moved = jax_dos.OverlappedStep(tx, STAGES, params2, staged, clip_norm=FIRES, micro_batches=2, pinned_memory="arena")
  assert all(x.is_deleted() for x in offloaded), "each leaf given in unpinned_host memory is freed as it lands"
  host = [x for x in jax.tree.leaves(moved.opt_state[1:]) if x.sharding.memory_kind == "pinned_host"]
  assert len(host) == len(offloaded) and all(moved.arena.owns(x) for x in host)
  for batch in batches[2:]:
    resumed(batch)
    moved(batch)
  theirs = jax.tree.leaves((whole.params, whole.opt_state))
  for step in (resumed, moved):
    for a, b in zip(jax.tree.leaves((step.params, step.opt_state)), theirs):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


SHARDED = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, sys
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    import dataclasses
    import jax_dos
    from jax_dos.core import partition
    from jax_dos.overlap import memory as overlap_memory
    from jax_dos.overlap import plan as overlap_plan
    import overlap_model as t

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
    # Restored into ordinary host memory (each offloaded leaf whole on one CPU device), the state is moved into the
    # new step's arena in the same layout, partitioned over "data", each given leaf freed.
    import tempfile
    with jax_dos.CheckpointManager(tempfile.mkdtemp(), save_interval_steps=1) as mgr:
        mgr.save(1, params=step.params, opt_state=step.opt_state, force=True)
        mgr.wait_until_finished()
        staged_t = jax_dos.abstract_state(step.plan, groups, host_kind="unpinned_host")
        params, staged, _ = mgr.restore(1, params=groups, opt_state=staged_t)
    given = [x for x in jax.tree.leaves(staged[1:]) if x.sharding.memory_kind == "unpinned_host"]
    assert given and all(len(x.sharding.device_set) == 1 for x in given)
    tx = jax_dos.interleaved_adamw(t.LR, b1=t.B1, b2=t.B2, weight_decay=t.WD, subgroup_size=40, plan=step.plan)
    moved = jax_dos.OverlappedStep(tx, t.STAGES, params, staged, clip_norm=t.NEVER, micro_batches=2,
                                   pinned_memory="arena")
    assert all(x.is_deleted() for x in given)
    for x, y in zip(jax.tree.leaves(moved.opt_state), jax.tree.leaves(step.opt_state)):
        assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(moved.arena.owns(x) for x in jax.tree.leaves(moved.opt_state.master))
    moved.close()
    # Each stage's backward program reduce-scatters a replicated parameter's gradients into its state's layout: the
    # running sums hold each device's share. Without partitioning they keep the parameters' layout (all-reduced).
    for partitioned in (True, False):
        model = jax_dos.StagedModel(t.STAGES, len(groups), partition_gradients=partitioned)
        _, sums = model.loss_and_grads(groups, batches[0], micro_batches=2)
        for s, p in zip(jax.tree.leaves(sums), jax.tree.leaves(groups)):
            want = (partition.state_sharding(p) if partitioned else None) or p.sharding
            assert s.sharding.is_equivalent_to(want.with_memory_kind("device"), p.ndim), (partitioned, s.sharding)
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
    assert step.host_bytes() == 2 * overlap_memory.host_bytes(step.plan, whole, 0)
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


def test_sharded_on_four_devices(four_devices):
  out = four_devices.run(SHARDED)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "sharded ok" in out.stdout
