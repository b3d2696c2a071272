"""The overlapped step's room where the parameters are sharded: sized from its stage programs
(``jax_dos.overlap.room``), not from the plain program's peak; unchanged on one device and where the parameters are
whole (``data`` only).

The mesh checks run in fresh interpreters of 4 CPU devices: the CPU backend gives compiled programs' memory analysis
(the stage programs' temporaries, the plain program's peak) though it reports no device memory, whose free bytes come
from the calibration here (``Calibration.device_free_bytes``, as ``planning.budgets`` reads it on a CPU).
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

import jax_dos
from jax_dos.overlap import plan as overlap_plan
from jax_dos.overlap.room import TEMP_MARGIN, stage_room
from jax_dos.planning.budgets import STEP_MARGIN, BudgetInputs, StepMemory, resolve_budgets
from jax_dos.planning.timeline import RematCosts, StageTimes

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _times(temp=3 * MIB, inputs=(0, MIB, MIB, MIB // 2)) -> StageTimes:
  return StageTimes((0.1,) * 4, (0.2,) * 4, sum(inputs), temp_bytes=temp, input_bytes=inputs)


# Four subgroups: the first's group is used by stages 0 and 3 (a tied head), the others by one stage each.
GRADS, LAST = (4 * MIB, MIB, 2 * MIB, MIB), (3, 1, 2, 3)


def test_the_room_is_the_usable_bytes_less_the_stage_programs_peak():
  """``U - ((1 + TEMP_MARGIN) T + k' c + max_i (k x_<=i + g_>=i))``: the stage inputs alive up to stage ``i`` (every
  micro-batch's in the ``"stage"`` order) beside the gradients of the groups a stage ``>= i`` uses; in the
  ``"batch"`` order every gradient beside one micro-batch's inputs. The terms, the usable bytes first, are what a plan
  prints."""
  times, usable = _times(), 100 * MIB
  alive = [3 * 0 + 8 * MIB, 3 * MIB + 8 * MIB, 3 * 2 * MIB + 7 * MIB, 3 * (5 * MIB // 2) + 5 * MIB]  # k = 3
  own = stage_room(usable, times, GRADS, LAST, True, 3, "stage")
  assert own.peak == (1 + TEMP_MARGIN) * times.temp_bytes + 3 * MIB + max(alive) and own.at == 2
  assert own.room == usable - own.peak and own.terms()[0] == ("usable", usable)
  assert sum(n for _, n in own.terms()[1:]) == own.peak
  assert own.cotangents == 3 * times.cotangent_bytes == 3 * MIB
  batch = stage_room(usable, times, GRADS, LAST, True, 3, "batch")
  assert batch.peak == (1 + TEMP_MARGIN) * times.temp_bytes + MIB + times.boundary_bytes + sum(GRADS)
  one = stage_room(usable, times, GRADS, LAST, True, 1, "batch")  # one micro-batch: both orders alike
  assert one.peak == stage_room(usable, times, GRADS, LAST, True, 1, "stage").peak < batch.peak
  # Without each stage's input measured, every stage input at every stage.
  whole = dataclasses.replace(times, input_bytes=())
  assert stage_room(usable, whole, GRADS, LAST, True, 3, "stage").stage_inputs == 3 * times.boundary_bytes
  assert stage_room(MIB, times, GRADS, LAST, True, 1, "stage").room == 0  # never below 0
  # The plain program's peak stands: parameters whole on every device, no usable bytes known, no temporaries.
  assert stage_room(usable, times, GRADS, LAST, False, 1, "stage") is None
  assert stage_room(None, times, GRADS, LAST, True, 1, "stage") is None
  assert stage_room(usable, _times(temp=0), GRADS, LAST, True, 1, "stage") is None
  assert stage_room(usable, None, GRADS, LAST, True, 1, "stage") is None
  # The derived stage times keep the measured bytes.
  costs = RematCosts(times.forward, times.backward, (0,) * 4, (times.temp_bytes, 0, 0, 0))
  measured = dataclasses.replace(times, remat={"full": costs}, remat_choices=("full",))
  for derived in (times.per_window(2, "stage"), measured.assigned(("full",) * 4)):
    assert (derived.temp_bytes, derived.input_bytes) == (times.temp_bytes, times.input_bytes)
  with pytest.raises(ValueError, match="input_bytes has 2 stages"):
    StageTimes((0.1,) * 4, (0.2,) * 4, input_bytes=(1, 2))


def test_the_budgets_say_what_the_step_may_use_unless_a_resident_budget_binds():
  free, n = 1000 * MIB, 10**6
  got = resolve_budgets(BudgetInputs(device_elements=n, step_memory=StepMemory(900 * MIB), free_bytes=free))
  assert got.usable == int((1 - STEP_MARGIN) * free) and got.step_room == got.usable - 900 * MIB
  kept = BudgetInputs(device_elements=n, step_memory=StepMemory(900 * MIB), free_bytes=free, resident_budget_bytes=0)
  assert resolve_budgets(kept).usable is None
  assert resolve_budgets(BudgetInputs(device_elements=n, free_bytes=free)).usable is None  # the needs unknown


def test_a_plan_prints_what_its_room_came_from():
  base = jax_dos.Plan(((0,),), ("device",), (10,), step_room_bytes=3 * 2**30)
  assert "room beside the training step's peak: 3.00 GiB per device\n" in str(base) + "\n"
  gib = 2**30
  own = stage_room(60 * gib, _times(temp=4 * gib, inputs=(0, gib, gib, gib // 2)), (14 * gib,), (3,), True, 2,
                   "stage")  # fmt: skip
  plan = dataclasses.replace(base, step_room_bytes=own.room, step_room_terms=own.terms())
  line = next(x for x in str(plan).splitlines() if "room beside" in x)
  assert line.endswith(
    "31.00 GiB per device (usable 60.00 GiB less stage temporaries x2 8.00, cotangents 2.00,"
    " stage inputs at stage 3 5.00, gradients 14.00)"
  ), line


def test_beside_the_stage_programs_peak_the_resident_share_is_not_the_plain_plans():
  """``room_beside_step`` keeps at most the plain plan's resident share, unless told more (``most``): the share
  sized beside the plain program's peak does not bound a room sized beside the stage programs'."""
  sizes, order = (100, 100, 100), [0, 1, 2]
  whole = jax_dos.Plan(((0,), (1,), (2,)), ("host",) * 3, sizes, step_room_bytes=10**6)
  assert overlap_plan.room_beside_step(whole, 1.0, sizes, order, 4) == (0, 4)
  assert overlap_plan.room_beside_step(whole, 1.0, sizes, order, 4, most=300)[0] == 300
  exact = dataclasses.replace(whole, step_room_bytes=12 * 300)  # every parameter's state, no slot needed
  assert overlap_plan.room_beside_step(exact, 1.0, sizes, order, 4, most=300) == (300, 4)
  tight = dataclasses.replace(whole, step_room_bytes=12 * 300 - 1)  # less: the share and its slots fit the room
  resident, slots = overlap_plan.room_beside_step(tight, 1.0, sizes, order, 4, most=300)
  assert resident < 300 and 12 * resident + slots * 16 * 100 <= tight.step_room_bytes, (resident, slots)


# The GPU-only setup path of train.gpt (train/gpt.py, _build_step) on a CPU mesh, its functions called directly: the
# plain program compiled for its memory, the stages measured under their remat choices, the mesh's collectives (at a
# given link rate), the optimizer planned from the plain program's needs, the overlapped plan. Free memory from the
# calibration, chosen so that the plain program's peak leaves room for half of a device's state.
GPT_PATH = textwrap.dedent(
  """
    import dataclasses, json, math, os, sys
    import jax, numpy as np
    import jax_dos
    from models import gpt
    from train import gradients, optimizer, overlapped, parallel
    from train.flags import parse_args

    mesh_axes = json.loads(sys.argv[1])
    spec = ",".join(f"{k}={v}" for k, v in mesh_axes.items())
    args = parse_args(["--devices", "4", "--mesh", spec, "--moments", "bfloat16", "--batch", "2", "--grad-accum",
                       "2", "--overlap", "on", "--remat", "auto", "--no-ckpt", "--out", sys.argv[2], "--overwrite"])
    cfg = gpt.get_config("tiny", vocab_size=256, dtype="float32", param_dtype="bfloat16", remat="full")
    mesh = parallel.make_mesh(mesh_axes)
    graphdef, params = gpt.init_params(cfg, seed=0)
    params = jax.device_put(params, parallel.param_shardings(mesh, params))
    layout = parallel.batch_sharding(mesh)
    rows, seq = 8, 128
    need = gradients.gradient_step_memory(graphdef, params, (2 * rows, seq), 1.0, "none", 2, batch_sharding=layout)
    staged = gpt.staged(cfg)
    tokens = np.random.default_rng(0).integers(0, 256, (rows, seq)).astype(np.int32)
    part = parallel.global_batch(lambda mine: (tokens[mine], tokens[mine]), layout, rows)
    times = overlapped.stage_times(staged, params, part, "auto")
    collectives = jax_dos.mesh_collectives(mesh, link=1e9)  # the link's measurement: test_devices.py's (40 s here)
    assert times.temp_bytes > 0 and times.cotangent_bytes > 0, times

    leaves = jax.tree.leaves(params)
    total = sum(x.size for x in leaves)
    shards = lambda tree: [math.prod(s.shard_shape(x.shape)) for s, x in  # each leaf's state shard: a device's
                           zip(jax.tree.leaves(jax_dos.state_shardings(tree)), jax.tree.leaves(tree))]
    state = jax_dos.state_bytes_per_param("bfloat16") * sum(shards(params))
    groups = staged.split(params)
    grads = [2 * sum(shards(g)) for g in groups]  # each group's gradient shard, bfloat16
    n = len(staged.stages)
    last = [max(i for i, st in enumerate(staged.stages) if g in st.groups) for g in range(len(groups))]
    act = (rows // 4) * seq * cfg.d_model * 4  # a stage input on a device: 2 of the 8 rows, float32
    assert times.input_bytes == (0,) + (act,) * (n - 1), times.input_bytes
    usable = need.peak_bytes + state // 2
    free = math.ceil(usable / (1 - 0.08)) + 1
    path = os.path.join(sys.argv[2], "calibration.json")
    os.makedirs(sys.argv[2], exist_ok=True)
    with open(path, "w") as f:
      json.dump({"host_rate": 2e9, "stream_rate": 3e9, "device_rate": 50e9, "host_rate_concurrent": 1.8e9,
                 "stream_rate_concurrent": 2e9, "device_free_bytes": free}, f)
    os.environ["JAX_DOS_CALIBRATION"] = path

    tx, _ = optimizer.make_optimizer(args, need)
    plain = jax_dos.get_plan(tx, params)
    over = overlapped.plan(args, tx, staged, params, times, collectives)
    usable = plain.step_usable_bytes
    assert usable is not None and plain.step_room_bytes == max(0, usable - need.peak_bytes), (plain, need)
    assert plain.step_room_terms == () and plain.elements("device") < total, plain
    print("plain", plain.step_room_bytes, plain.elements("device"), total)
    print("stage", times.temp_bytes, times.input_bytes, grads, last)
    print(over)
    sharded = mesh_axes.get("fsdp", 1) > 1
    if sharded:
      alive = max(2 * i * act + sum(b for b, l in zip(grads, last) if l >= i) for i in range(n))  # 2 micro-batches
      # the largest stage's weights gathered whole ahead of its backward programs (the last stage's never are)
      # (where the stage times were measured faster so: both ways were timed)
      assert times.gather_ahead is not None and len(times.gather_ahead_s) == 2, times
      whole = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree) if x.addressable_shards[0].data.size < x.size)
      ahead = max(sum(whole(groups[g]) for g in st.groups) for st in staged.stages[:-1]) if times.gather_ahead else 0
      assert ("weights gathered ahead", ahead) in over.step_room_terms or not ahead, over.step_room_terms
      peak = 2 * times.temp_bytes + ahead + 2 * act + alive
      assert over.step_room_bytes == usable - peak, (over.step_room_bytes, usable, peak)
      assert peak < need.peak_bytes, (peak, need)  # XLA holds more at once in the plain program than in a stage's
      assert over.step_room_bytes > plain.step_room_bytes
      assert "(usable" in str(over) and "gradients" in str(over)
      # The remat choice rests on CPU timings (a policy that saves activations takes them out of the room): with
      # every stage "full", every parameter is resident, beside no stream slot.
      full = overlapped.plan(args, tx, staged, params, dataclasses.replace(times, remat_choices=()), collectives)
      assert full.step_room_bytes == over.step_room_bytes and full.remat is None, full
      assert full.elements("device") == total > plain.elements("device"), full
    else:  # the parameters whole on every device: the plain program's peak stands, and the plain plan's share
      assert times.gather_ahead is None and times.gather_ahead_s == (), times  # nothing to gather
      assert over.step_room_terms == () and over.step_room_bytes == plain.step_room_bytes, over
      assert over.elements("device") <= tx.interleaved.plan_for(staged.split(params)).elements("device"), over
      assert "(usable" not in str(over)
    print("gpt path ok")
  """
)


@pytest.mark.parametrize("mesh", [{"data": 1, "fsdp": 4}, {"data": 4, "fsdp": 1}], ids=["fsdp4", "data4"])
def test_the_gpu_setup_path_on_a_cpu_mesh(tmp_path, mesh, four_devices):
  """``train.gpt``'s setup on a GPU, on 4 CPU devices: with the parameters sharded (``fsdp=4``) the overlapped plan's
  room is the stage programs' (the module's formula from the measured temporaries and stage inputs, each stage's
  input checked against its shape, and the groups' gradient shards), larger than the plain program's, and every
  parameter stays resident where the plain plan keeps at most half; data-parallel (``data=4``), parameters whole on
  every device, the plain program's room stands."""
  import json

  import conftest

  if not conftest._on_cpu():  # the CPU devices' programs compiled without them hold more at once in a stage's
    pytest.skip("sized for the CPU compiler's flags (conftest.COMPILE_FLAGS), which a CUDA plugin's XLA refuses")
  out = four_devices.run(GPT_PATH, json.dumps(mesh), str(tmp_path / "out"))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "gpt path ok" in out.stdout, out.stdout


# The test model (tests/overlap_model.py) with its parameters sharded over 4 devices, the plain program's peak given
# as more than the free memory (no room beside it: the plain plan keeps nothing resident, as the 30B GPT on four
# H100s got), the stages measured: the overlapped plan keeps state resident beside the stage programs' peak, and the
# step's numbers are optax's, with the clip firing and silent.
NUMBERS = textwrap.dedent(
  """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    import jax_dos
    import overlap_model as t

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    spec = lambda x: P(None, "fsdp") if x.ndim == 2 else P("fsdp")
    rng = np.random.default_rng()
    groups = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), t.make_groups(rng))
    batches = [t.make_batch(rng) for _ in range(3)]
    times = jax_dos.StagedModel(t.STAGES, len(groups)).measure_times(groups, jax.tree.map(lambda x: x[:4], batches[0]))
    assert times.temp_bytes > 0, times
    free = 2**24
    cal = jax_dos.Calibration(2e9, 3e9, 50e9, 1.8e9, 2e9, device_free_bytes=free)
    planner = jax_dos.auto_planner(cal, step_memory=jax_dos.StepMemory(2 * free), params_in_place=True)
    for clip in (t.FIRES, t.NEVER):
      tx = jax_dos.interleaved_adamw(t.LR, b1=t.B1, b2=t.B2, weight_decay=t.WD, subgroup_size=40, planner=planner)
      assert tx.interleaved.plan_for(groups).elements("device") == 0  # no room beside the plain program's peak
      plan = jax_dos.overlapped_plan(tx, t.STAGES, groups, stage_times=times, micro_batches=2)
      assert plan.step_room_bytes > 0 and plan.step_room_terms and plan.elements("device") > 0, plan
      step = jax_dos.OverlappedStep(tx, t.STAGES, jax.tree.map(jnp.copy, groups), clip_norm=clip, micro_batches=2,
                                    plan=plan)
      for batch in batches:
        step(batch)
      assert bool(step.grad_norm > clip) == (clip == t.FIRES)
      t.check_against_reference(step, groups, batches, clip, 2)
      step.close()
    print("numbers ok")
  """
)


def test_the_steps_numbers_with_state_resident_beside_the_stage_programs(four_devices):
  out = four_devices.run(NUMBERS)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "numbers ok" in out.stdout, out.stdout
