"""Sharded weights gathered one stage ahead (``jax_dos.staged.gather_ahead``): which program gathers which stage's
weights, how long they are held, what the programs gather, the room, and optax's numbers on meshes of 4 CPU devices."""

import textwrap

import pytest

from jax_dos.overlap.room import stage_room
from jax_dos.planning.timeline import StageTimes
from jax_dos.staged import gather_ahead
from jax_dos.staged.micro_batches import schedule


@pytest.mark.parametrize("order", ["stage", "batch"])
def test_each_backward_program_gathers_the_next_stages_weights(order):
  programs = schedule(4, 2, order)
  ahead = gather_ahead.ahead_stages(programs, [True, True, False, True])
  got = {p: a for p, a in zip(programs, ahead) if a is not None}
  if order == "stage":  # the last micro-batch's program of a stage gathers the next stage's, for all its programs
    want = {("backward", 3, 1): None, ("backward", 2, 1): 1, ("backward", 1, 1): 0}
  else:  # each micro-batch's programs gather for the next one of the same micro-batch
    want = {("backward", 3, m): None for m in range(2)} | {("backward", 2, m): 1 for m in range(2)}
    want |= {("backward", 1, m): 0 for m in range(2)}
  assert got == {p: a for p, a in want.items() if a is not None}, got  # stage 2 has nothing to gather
  assert all(a is None for (kind, _, _), a in zip(programs, ahead) if kind == "forward")


def test_gathered_weights_are_held_through_their_stages_programs_then_dropped():
  programs = schedule(3, 2, "stage")  # forward 0, 0, 1, 1; backward 2, 2, 1, 1, 0, 0
  held = gather_ahead.HeldWeights(programs, [True, True, True])
  seen = []
  for j in range(len(programs)):
    seen.append(held.mine(j))
    held.ran(j, f"whole {held.ahead(j)}" if held.ahead(j) is not None else None)
  assert seen == [None] * 4 + [None, None, "whole 1", "whole 1", "whole 0", "whole 0"], seen
  assert held.mine(len(programs) - 1) is None  # dropped after the last program of its stage
  programs = schedule(3, 2, "batch")  # per micro-batch: forward 0, 1; backward 2, 1, 0
  held = gather_ahead.HeldWeights(programs, [True, True, True])
  seen = []
  for j in range(len(programs)):
    seen.append(held.mine(j))
    held.ran(j, f"whole {held.ahead(j)}" if held.ahead(j) is not None else None)
  assert seen == [None, None, None, "whole 1", "whole 0"] * 2, seen


def test_the_room_counts_one_stages_weights_gathered_ahead():
  times = StageTimes((0.1,) * 3, (0.2,) * 3, 64, input_bytes=(0, 32, 32), temp_bytes=1000)
  args = (10_000, times, (100, 100), (2, 1), True, 2, "stage")
  without, with_ahead = stage_room(*args), stage_room(*args, ahead_bytes=300)
  assert with_ahead.peak == without.peak + 300 and with_ahead.room == without.room - 300
  assert ("weights gathered ahead", 300) in with_ahead.terms()
  assert all(name != "weights gathered ahead" for name, _ in without.terms())


def test_a_gather_ahead_that_is_not_a_choice_is_refused_with_the_choices():
  from jax_dos.overlap.plan import StepOptions

  for bad in ("yes", 1, None):
    with pytest.raises(ValueError, match="gather_ahead must be 'auto', True or False"):
      StepOptions(gather_ahead=bad)
  times = StageTimes((0.1,) * 3, (0.2,) * 3, gather_ahead=True)
  assert StepOptions().gathers_ahead(times) and not StepOptions().gathers_ahead(None)
  assert not StepOptions(gather_ahead=False).gathers_ahead(times) and StepOptions(gather_ahead=True).gathers_ahead(None)


SCRIPT = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, sys
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    import jax_dos
    from jax_dos.staged import gather_ahead, stage_programs
    from helpers import max_rel_diff
    import overlap_model as t

    rng = np.random.default_rng()
    for shape in ((4,), (2, 2)):  # fsdp=4, and data=2 x fsdp=2
        axes = ("fsdp",) if len(shape) == 1 else ("data", "fsdp")
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(shape), axes)
        spec = lambda x: P("fsdp") if x.shape[0] % mesh.shape["fsdp"] == 0 else P()  # the embedding's w stays whole
        groups = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), t.make_groups(rng))
        rows = NamedSharding(mesh, P(axes))
        batches = [jax.device_put(t.make_batch(rng), rows) for _ in range(3)]
        for order in ("stage", "batch"):
            for clip in (t.FIRES, t.NEVER):
                runs = {}
                for ahead in (True, False):
                    step, _ = t.overlapped_run(groups, batches, clip, 2, t.MIXED[: t._subgroup_count(groups)],
                                               micro_batch_order=order, gather_ahead=ahead)
                    assert bool(step.grad_norm > clip) == (clip == t.FIRES)
                    assert step._gathers == [ahead] * len(t.STAGES), step._gathers
                    if ahead:  # optax's numbers, on the gradients of the programs that gather ahead
                        t.check_against_reference(step, groups, batches, clip, 2)
                    runs[ahead] = step.opt_state.master
                    for p, g in zip(jax.tree.leaves(step.params), jax.tree.leaves(groups)):
                        assert p.sharding.is_equivalent_to(g.sharding, p.ndim), (p.sharding, g.sharding)
                    step.close()
                assert max_rel_diff(runs[True], runs[False]) <= 1e-6, (shape, order, clip)
        print("ok numbers", shape)

    # The programs: a backward program given its weights whole gathers none; one gathering ahead gathers more than
    # its own stage's program alone.
    model = jax_dos.StagedModel(t.STAGES, len(groups))
    block, before = (tuple(groups[g] for g in model.stages[i].groups) for i in (2, 1))
    x = jax.device_put(jnp.zeros((t.ROWS, t.D_H)), rows)

    def gathers(params, layouts, ahead=()):
        targets = gather_ahead.gather_targets(ahead)
        leaves = jax.tree.leaves(ahead)
        program, args = stage_programs.backward_call(model.stages[2], (False,), params, x, batches[0],
                                                     jnp.ones_like(x), (None,), None, layouts, None,
                                                     tuple(leaves[j] for j, _ in targets), tuple(s for _, s in targets))
        return program.lower(*args).compile().as_text().count("all-gather")

    targets = gather_ahead.gather_targets(block)
    whole = gather_ahead.with_gathered(block, targets, [jax.device_put(jax.tree.leaves(block)[j], s)
                                                        for j, s in targets])
    own, given, ahead = gathers(block, model.layouts(2, block)), gathers(whole, model.layouts(2, block)), \\
        gathers(block, model.layouts(2, block), before)
    assert given == 0 < own < ahead, (given, own, ahead)
    # The gradients of sharded weights keep their layout whether the program gathers them or takes them whole:
    # reduce-scattered into the partitioned state's, or into the parameters' own without partitioning.
    from jax_dos.core import partition
    for partitioned, ahead in ((True, True), (True, False), (False, True), (False, False)):
        _, sums = jax_dos.StagedModel(t.STAGES, len(groups), partition_gradients=partitioned,
                                      gather_ahead=ahead).loss_and_grads(groups, batches[0], 2)
        for s, p in zip(jax.tree.leaves(sums), jax.tree.leaves(groups)):
            want = (partition.state_sharding(p) if partitioned else None) or p.sharding
            assert s.sharding.is_equivalent_to(want.with_memory_kind("device"), p.ndim), (partitioned, s.sharding)
    print("ok programs")

    # "auto": the step gathers ahead as the stage times were measured faster (a block's backward program both ways,
    # AHEAD_MARGIN deciding; set here to force each answer), and its programs are then timed that way.
    margin = gather_ahead.AHEAD_MARGIN
    try:
        for gather_ahead.AHEAD_MARGIN, want in ((-10.0, True), (1.0, False)):
            times = model.measure_times(groups, batches[0])
            assert times.gather_ahead is want and len(times.gather_ahead_s) == 2 and min(times.gather_ahead_s) > 0
            tx = jax_dos.interleaved_adamw(t.LR, subgroup_size=40, plan="host")
            step = jax_dos.OverlappedStep(tx, t.STAGES, jax.tree.map(jnp.copy, groups), micro_batches=2,
                                          stage_times=times)
            assert step.gather_ahead is want and step._gathers == [want] * len(t.STAGES), step._gathers
            step(batches[0])
            step.close()
    finally:
        gather_ahead.AHEAD_MARGIN = margin
    replicated = jax.device_put(groups, NamedSharding(mesh, P()))  # nothing to gather: nothing measured
    times = model.measure_times(replicated, batches[0])
    assert times.gather_ahead is None and times.gather_ahead_s == (), times
    print("ok auto")

    # The room: the largest stage's weights gathered whole, on each device (the head's stage, last, is never
    # gathered ahead); none without gather_ahead.
    from jax_dos.overlap import plan as overlap_plan
    layout = lambda **kw: overlap_plan.step_layout(jax_dos.StagedModel(t.STAGES, len(groups), **kw), groups, 40)
    block_bytes = (t.D_H * t.D_H + t.D_H) * 4
    assert layout(gather_ahead=True).ahead_bytes == block_bytes and layout().ahead_bytes == 0, layout()
    print("ok room")
  """
)


def test_gathered_ahead_on_four_devices_keeps_optaxs_numbers(four_devices):
  """fsdp=4 and data=2 x fsdp=2, both micro-batch orders, the clip firing and silent: optax's numbers with the
  weights gathered ahead, the same as without to float32 rounding, each program gathering what it should."""
  out = four_devices.run(SCRIPT, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert out.stdout.count("ok ") == 5, out.stdout


USER_MODEL_SCRIPT = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, sys
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    import jax_dos
    from helpers import max_rel_diff
    import test_nnx_stages as u

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))

    def shard(x):  # over fsdp along the first dimension it divides, as train.parallel lays the GPT out
        spec = [None] * x.ndim
        d = next((d for d in range(x.ndim) if x.shape[d] % 4 == 0), None)
        if d is not None:
            spec[d] = "fsdp"
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    rng = np.random.default_rng()
    for stacked in (False, True):
        model, batches = u.make_model(rng, stacked), u.make_batches(rng, 3)
        expected = u.reference(model, batches, u.FIRES)
        nnx.update(model, jax.tree.map(shard, nnx.state(model, nnx.Param)))
        batches = jax.device_put(batches, NamedSharding(mesh, P()))
        layer = u.run_layer if stacked else None
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        laid = [x.sharding for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
        staged = jax_dos.nnx_stages(model, batches[0], embed=u.embed, blocks="blocks", head=u.head, block=layer)
        tx = jax_dos.interleaved_adamw(u.LR, b1=u.B1, b2=u.B2, weight_decay=u.WD, plan="host")
        with jax_dos.OverlappedStep(tx, staged.stages, staged.give(model), clip_norm=u.FIRES, micro_batches=2,
                                    gather_ahead=True) as step:
            for batch in batches:
                step(batch)
            assert step.gather_ahead and any(step._gathers), step._gathers
            staged.update(model, step.params)
        got = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        for leaf, want in zip(jax.tree.leaves(got), laid):
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)
        assert max_rel_diff(got, expected) < 2e-5, (stacked, max_rel_diff(got, expected))
        print("ok user model", "stack" if stacked else "list")
  """
)


def test_a_users_nnx_model_sharded_over_four_devices_gathers_ahead_with_optaxs_numbers(four_devices):
  """A user's own NNX transformer (``tests/test_nnx_stages.py``'s, its blocks a list or one scanned stack), its
  weights sharded over ``fsdp=4``, trained through ``jax_dos.nnx_stages`` with the weights gathered ahead: optax's
  numbers on the unsharded model (2e-5, as the NNX tests), each parameter back in its own layout. (Gathered ahead
  and not give the same numbers: ``test_gathered_ahead_on_four_devices_keeps_optaxs_numbers``.)"""
  out = four_devices.run(USER_MODEL_SCRIPT, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert out.stdout.count("ok user model") == 2, out.stdout
