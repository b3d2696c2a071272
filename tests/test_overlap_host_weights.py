"""Weights on the host (``jax_dos.OverlappedStep(weights=...)``): the groups whose weights live in pinned host memory
are copied in ahead of the programs that use them and written by the host kernel in place, with
``optax.chain(clip_by_global_norm, adamw)``'s numbers, beside groups in every other placement; the accelerator holds
only the copies of the stages in flight. The model and the reference are ``overlap_model``'s."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from overlap_model import FIRES, MIXED, NEVER, check_against_reference, make_batch, make_groups, overlapped_run

import jax_dos


def _placements(groups, host_groups):
  """Per subgroup: ``"host"`` in the groups whose weights are on the host, the mixed placements elsewhere."""
  _, _, subgroup_group = jax_dos.planning.plan.partition_groups(groups, 40)
  return [("host" if g in host_groups else MIXED[s]) for s, g in enumerate(subgroup_group)]


@pytest.mark.parametrize("clip_norm", [FIRES, NEVER], ids=["clip_fires", "clip_silent"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("run_ahead", [1, 3])
def test_weights_on_the_host_beside_every_placement_equal_optax(clip_norm, dtype, run_ahead):
  """The embeddings (tied to the head) and the second block on the host, the other groups device, stream or host:
  two micro-batches, the clip firing (a speculation redone) or silent, bfloat16 or float32 weights."""
  rng = np.random.default_rng()
  groups, batches = make_groups(rng, dtype), [make_batch(rng) for _ in range(4)]
  host_groups = {0, 2}
  weights = ["host" if g in host_groups else "device" for g in range(len(groups))]
  step, _ = overlapped_run(groups, batches, clip_norm, 2, _placements(groups, host_groups), weights=weights,
                           run_ahead_stages=run_ahead)  # fmt: skip
  assert {"device", "stream", "host"} <= set(step.plan.placements)
  params = step.params
  kinds = [{x.sharding.memory_kind for x in jax.tree.leaves(t)} for t in params]
  assert [k == {"pinned_host"} for k in kinds] == [g in host_groups for g in range(len(groups))], kinds
  check_against_reference(step, groups, batches, clip_norm, 2, tol=1e-5 if dtype == jnp.float32 else 1e-3)
  step.close()


def test_every_weight_on_the_host_with_every_subgroup_on_the_host():
  rng = np.random.default_rng()
  groups, batches = make_groups(rng), [make_batch(rng) for _ in range(3)]
  step, losses = overlapped_run(groups, batches, FIRES, 2, "host", weights="host")
  assert all(np.isfinite(losses))
  assert not step._on_device  # no copy outlives the step's programs
  check_against_reference(step, groups, batches, FIRES, 2)
  step.close()


def test_what_the_host_weights_need_is_refused_with_what_to_change():
  rng = np.random.default_rng()
  groups = make_groups(rng)
  with pytest.raises(ValueError, match=r"group 0's weights are on the host, but the plan places its subgroups"):
    overlapped_run(groups, [], NEVER, 1, "stream", weights="host")
  with pytest.raises(ValueError, match=r"weights must be one of \('device', 'host'\)"):
    overlapped_run(groups, [], NEVER, 1, "host", weights=["host"])
  with pytest.raises(ValueError, match=r"a fixed plan: pass rebalance=False"):
    overlapped_run(groups, [], NEVER, 1, "host", weights="host", rebalance=True)


MESH = textwrap.dedent(
  """
    import jax, jax.numpy as jnp, numpy as np, sys
    from jax.sharding import NamedSharding, PartitionSpec as P
    sys.path.insert(0, "tests")
    import overlap_model as t
    import jax_dos

    rng = np.random.default_rng()
    _, _, owner = jax_dos.planning.plan.partition_groups(t.make_groups(rng), 40)
    placements = ["host" if g in (0, 2) else t.MIXED[s] for s, g in enumerate(owner)]
    weights = ["host" if g in (0, 2) else "device" for g in range(max(owner) + 1)]
    # Sharded over both devices ("model"), and data-parallel (replicated, each device a whole copy of its state).
    for axes, spec, rows, tx_kw in (((1, 2), lambda x: P(None, "model") if x.ndim == 2 else P("model"), P(), None),
                                    ((2, 1), lambda x: P(), P("data"), {"partition_replicated": False})):
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(axes), ("data", "model"))
        groups = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), t.make_groups(rng))
        batches = [jax.device_put(t.make_batch(rng), NamedSharding(mesh, rows)) for _ in range(3)]
        for clip in (t.FIRES, t.NEVER):
            step, _ = t.overlapped_run(groups, batches, clip, 2, placements, tx_kw=tx_kw, weights=weights)
            t.check_against_reference(step, groups, batches, clip, 2)
            for p, g in zip(jax.tree.leaves(step.params), jax.tree.leaves(groups)):
                assert p.sharding.is_equivalent_to(g.sharding.with_memory_kind(p.sharding.memory_kind), p.ndim)
            step.close()
    print("mesh ok")
  """
)


def test_weights_on_the_host_on_a_mesh_of_two_devices(two_devices):
  out = two_devices.run(MESH)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "mesh ok" in out.stdout
