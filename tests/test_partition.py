"""Partitioned state on 4 (fake) CPU devices: replicated parameters' state split over the mesh, by default.

The default (``partition_replicated="auto"``) and ``True`` partition alike.

Each device must hold only its share of a replicated leaf's master, mu and nu,
the parameters must come back replicated, and the numbers must be optax's.
Runs in a fresh interpreter with 4 host devices (set before jax starts).
"""

import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, optax, sys
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    from helpers import max_rel_diff, run_pair
    import jax_dos

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    rng = np.random.default_rng()
    specs = {"fsdp": P("data", "model"), "rows": P("data"), "replicated": P(), "vec": P("model"), "odd": P()}
    shapes = {"fsdp": (8, 6), "rows": (4, 3), "replicated": (8, 5), "vec": (8,), "odd": (3,)}
    # devices holding one leaf's state among them: 4 where partitioned, else as the parameter is laid out
    share = {"fsdp": 4, "rows": 4, "replicated": 4, "vec": 4, "odd": 1}
    params = {k: jax.device_put(jnp.asarray(rng.standard_normal(shapes[k]), jnp.float32), NamedSharding(mesh, specs[k]))
              for k in shapes}

    # From shapes alone (a plan, a program compiled for its memory), each leaf's state takes the layout its array's
    # would: a leaf sharded over every axis of the mesh keeps its own sharding, not the default device's.
    abstract = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for k, x in params.items()}
    for k, (want, got) in enumerate(zip(jax_dos.state_shardings(params).values(),
                                        jax_dos.state_shardings(abstract).values())):
      assert got.is_equivalent_to(want, len(shapes[list(shapes)[k]])), (list(shapes)[k], got, want)
    print("ok from shapes")

    def check_layout(state, p, what, params_layout=True):
      for k in shapes:
        for tree in (state.master, state.mu, state.nu):
          for shard in tree[k].addressable_shards:
            assert shard.data.size * share[k] == np.prod(shapes[k]), (what, k, shard.data.shape)
        if params_layout:
          assert p[k].sharding.is_equivalent_to(params[k].sharding, len(shapes[k])), (what, k, p[k].sharding)

    plans = ["device", "stream", "host", ["host", "stream", "device", "host", "stream"]]
    for plan in plans:
      for jit in (False, True):
        tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan=plan)  # partitioned by default
        p, state, ref_p, _ = run_pair(tx, optax.adamw(1e-2, weight_decay=0.1), params, 6, rng, jit=jit)
        err = max_rel_diff(p, ref_p)
        assert err <= 1e-6 and max_rel_diff(state.master, ref_p) <= 1e-6, (plan, jit, err)
        check_layout(state, p, plan, params_layout=not jit)  # inside jit the caller's out_shardings decide
        print("ok", plan, "jit" if jit else "eager", err)

    ref = optax.adamw(1e-2, weight_decay=0.1)
    for name, kw in [("update_params", {}), ("write_behind", dict(write_behind=True)),
                     ("delay_predict=gradient", dict(delay=1, delay_warmup=2, delay_predict="gradient"))]:
      tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan=plans[-1],
                                    partition_replicated=True, **kw)
      # Gradients flushed in the state's layout: each device receives its share of a replicated leaf's gradient.
      shardings = jax_dos.gradient_shardings(tx, params)
      assert shardings["replicated"].spec[0] == ("data", "model"), shardings["replicated"]
      grad_fn = jax.jit(lambda g: g, out_shardings=shardings)
      p = {k: jax.device_put(x, x.sharding, may_alias=False) for k, x in params.items()}  # update_params consumes
      state, ref_p, ref_state = tx.init(p), params, ref.init(params)
      for _ in range(6):
        g = {k: jax.device_put(jnp.asarray(rng.standard_normal(shapes[k]), jnp.float32), params[k].sharding)
             for k in shapes}
        if name == "update_params":
          old = p
          p, state = jax_dos.update_params(tx, grad_fn(g), state, p)
          # consumed, the replicated ones too: their gathered new weights take the old ones' place on the devices
          assert all(x.is_deleted() for x in old.values()), {k: x.is_deleted() for k, x in old.items()}
        else:
          u, state = tx.update(grad_fn(g), state, p)
          p = optax.apply_updates(p, u)
        ref_u, ref_state = ref.update(g, ref_state, ref_p)
        ref_p = optax.apply_updates(ref_p, ref_u)
      jax_dos.wait_for_host_updates()
      assert max_rel_diff(p, ref_p) <= 1e-6 and max_rel_diff(state.master, ref_p) <= 1e-6, name
      check_layout(state, p, name)
      print("ok", name)

    # The planner is told what a partitioned state's update holds on each device beside it: the relaid leaves'
    # elements in the state's layout and in the parameters' (planning/budgets.py's R).
    seen = []
    def planner(planned, subgroup_size, relayout_elements=(0, 0)):
      seen.append(relayout_elements)
      return jax_dos.resolve_plan(plans[-1], planned, subgroup_size)
    planner.counts_relayout = True
    jax_dos.interleaved_adam(1e-2, subgroup_size=1, plan="auto", planner=planner).init(params)
    held = {k: params[k].addressable_shards[0].data.size for k in shapes}  # a device's elements of the parameter
    relaid = [k for k in shapes if share[k] == 4 and held[k] * 4 != np.prod(shapes[k])]
    assert sorted(relaid) == ["replicated", "rows", "vec"], relaid
    want = (sum(np.prod(shapes[k]) // 4 for k in relaid), sum(held[k] for k in relaid))
    assert seen == [want], (seen, want)
    print("ok relayout")
    """
)

ROOT = Path(__file__).resolve().parents[1]


def test_partitioned_state_matches_optax_and_holds_shares(four_devices):
  result = four_devices.run(SCRIPT)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("ok ") == 13, result.stdout


SHARE_SCRIPT = textwrap.dedent(
  """
    import jax, numpy as np, sys
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    from overlap_model import STAGES, make_groups
    import jax_dos
    from jax_dos.overlap import plan as overlap_plan

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))  # 2 of the interpreter's 4
    groups = jax.device_put(make_groups(np.random.default_rng()), NamedSharding(mesh, P()))  # replicated parameters
    model = jax_dos.StagedModel(STAGES, len(groups))
    split = overlap_plan.step_layout(model, groups, 8, partitioned=True)
    whole = overlap_plan.step_layout(model, groups, 8, partitioned=False)
    assert whole.device_share == 1.0 and split.device_share == 0.5, (whole.device_share, split.device_share)
    total = sum(split.sizes)
    room = int(0.6 * jax_dos.planning.plan.STATE_BYTES * total)  # a device holds half the state, not all of it
    plan = jax_dos.Plan(split.subgroups, ("device",) * len(split.sizes), split.sizes, 4, step_room_bytes=room)
    kept = {name: overlap_plan.room_beside_step(plan, layout.device_share, layout.sizes, layout.forward_order, 4)[0]
            for name, layout in (("split", split), ("whole", whole))}
    assert kept["split"] == total and kept["whole"] < total, (kept, total)
    print("ok")
    """
)


def test_the_overlapped_plan_counts_a_device_its_share_of_the_partitioned_state(four_devices):
  """On a mesh of 2, each device holds half of a replicated parameter's state: the overlapped plan keeps resident
  what fits that half (it counted the whole state on each device, and kept half of the 6.7B state off two H100s
  that hold all of it)."""
  result = four_devices.run(SHARE_SCRIPT, timeout=300)
  assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr
