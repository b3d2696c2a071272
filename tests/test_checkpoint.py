"""Checkpoints of the offloaded Adam state: roundtrips, cross-plan/optax restores, hazards, robustness."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_dos
from jax_dos.checkpoint import CheckpointManager, from_optax_adamw_state, to_optax_adamw_state

LR, WD = 1e-2, 0.1


def make_params(seed=0):
  k = jax.random.split(jax.random.key(seed), 3)
  return {
    "w": jax.random.normal(k[0], (8, 16), jnp.float32),
    "b": jax.random.normal(k[1], (16,), jnp.float32),
    "h": [jax.random.normal(k[2], (4, 4), jnp.float32)],
  }


def grads_for(params, step):
  keys = jax.random.split(jax.random.key(1000 + step), len(jax.tree.leaves(params)))
  leaves, treedef = jax.tree.flatten(params)
  return jax.tree.unflatten(
    treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
  )


def train(tx, params, state, steps, start=0):
  for i in range(start, start + steps):
    updates, state = tx.update(grads_for(params, i), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def snapshot(tree):
  return jax.tree.map(lambda x: np.array(x), tree)


def assert_equal_trees(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_close_trees(a, b, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def kinds(tree):
  return [x.sharding.memory_kind for x in jax.tree.leaves(tree)]


def fresh(tx, seed=99):
  p = make_params(seed)  # different values: restore must overwrite everything
  return p, tx.init(p)


def interleaved(plan):
  return jax_dos.interleaved_adam(LR, weight_decay=WD, subgroup_size=1, plan=plan)


@pytest.mark.parametrize("plan", ["device", "stream", "host"])
def test_roundtrip_every_placement(tmp_path, plan):
  tx = interleaved(plan)
  params = make_params()
  params, state = train(tx, params, tx.init(params), 2)
  want = snapshot((params, state))
  with CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    assert mgr.save(2, params=params, opt_state=state, meta={"data": 7})
    mgr.wait_until_finished()
    assert mgr.latest_step() == 2
    tp, ts = fresh(tx)
    rp, rs, meta = mgr.restore(params=tp, opt_state=ts)
  assert meta == {"data": 7}
  assert_equal_trees(want, (rp, rs))
  assert kinds(rs) == kinds(ts) and kinds(rp) == kinds(tp)
  expected = "device" if plan == "device" else "pinned_host"
  assert set(kinds(rs.mu)) == {expected}


@pytest.mark.parametrize("new_plan", ["device", ["host", "device", "stream"]])
def test_restore_into_other_plan_continues_exactly(tmp_path, new_plan):
  tx_host, tx_new = interleaved("host"), interleaved(new_plan)
  params = make_params()
  params, state = train(tx_host, params, tx_host.init(params), 3)
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(3, params=params, opt_state=state, force=True)
    mgr.wait_until_finished()
    tp, ts = fresh(tx_new)
    rp, rs, _ = mgr.restore(params=tp, opt_state=ts)
  assert kinds(rs) == kinds(ts)
  # Reference: the same run without a checkpoint (the plan may change between steps).
  ref = train(tx_new, params, state, 3, start=3)
  got = train(tx_new, rp, rs, 3, start=3)
  assert_equal_trees(ref, got)
  # And both are optax.adamw.
  otx = optax.adamw(LR, weight_decay=WD)
  p0 = make_params()
  op, _ = train(otx, p0, otx.init(p0), 6)
  assert_close_trees(op, got[0])


def test_optax_checkpoint_into_interleaved_and_back(tmp_path):
  sched = optax.linear_schedule(LR, LR / 10, 20)
  mask = lambda p: {"w": True, "b": False, "h": [True]}  # noqa: E731
  otx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=WD, mask=mask))
  itx = optax.chain(
    optax.clip_by_global_norm(1.0),
    jax_dos.interleaved_adam(sched, weight_decay=WD, mask=mask, subgroup_size=1, plan="host"),
  )
  params = make_params()
  op, ostate = train(otx, params, otx.init(params), 3)
  with CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    mgr.save(3, params=op, opt_state=ostate)
    mgr.wait_until_finished()
    tp, ts = fresh(itx)
    ip, istate, _ = mgr.restore(params=tp, opt_state=ts)
    assert set(kinds(istate[1].master)) == {"pinned_host"}
    assert_equal_trees(istate[1].master, op)  # float32 params are the master weights
    ref_p, ref_s = train(otx, op, ostate, 3, start=3)
    ip, istate = train(itx, ip, istate, 3, start=3)
    assert_close_trees(ref_p, ip)
    assert_close_trees(ref_s[1][0].mu, istate[1].mu)
    # ... and back into optax.
    mgr.save(6, params=ip, opt_state=istate)
    mgr.wait_until_finished()
    tp, ts = fresh(otx)
    bp, bstate, _ = mgr.restore(params=tp, opt_state=ts)
  assert int(bstate[1][2].count) == 6 and int(bstate[1][0].count) == 6
  ref_p, _ = train(otx, ref_p, ref_s, 2, start=6)
  bp, _ = train(otx, bp, bstate, 2, start=6)
  assert_close_trees(ref_p, bp)


def test_in_memory_conversion_matches_optax():
  otx = optax.adamw(LR, weight_decay=WD)
  tx = interleaved("host")
  params = make_params()
  op, ostate = train(otx, params, otx.init(params), 2)
  state = from_optax_adamw_state(ostate, op, plan=jax_dos.get_plan(tx, op))
  assert set(kinds(state.nu)) == {"pinned_host"}
  ip, state = train(tx, op, state, 2, start=2)
  ref_p, ref_s = train(otx, op, ostate, 2, start=2)
  assert_close_trees(ref_p, ip)
  back = to_optax_adamw_state(state, schedule=False)
  assert jax.tree.structure(back) == jax.tree.structure(ref_s)
  assert_close_trees(ref_s, back)


@pytest.mark.parametrize("host_copy", ["auto", "block"])
def test_async_save_then_in_place_updates(tmp_path, host_copy):
  tx = interleaved("host")
  params = make_params()
  params, state = train(tx, params, tx.init(params), 2)
  want = snapshot((params, state))
  with CheckpointManager(tmp_path, async_save=True, host_copy=host_copy) as mgr:
    mgr.save(2, params=params, opt_state=state, force=True)
    params, state = train(tx, params, state, 3, start=2)  # overwrites the host buffers in place
    mgr.wait_until_finished()
    tp, ts = fresh(tx)
    rp, rs, _ = mgr.restore(2, params=tp, opt_state=ts)
  assert_equal_trees(want, (rp, rs))


def test_tree_mismatch_and_missing_directory(tmp_path):
  tx = interleaved("host")
  params = make_params()
  with CheckpointManager(tmp_path / "run", save_interval_steps=1) as mgr:
    mgr.save(1, params=params, opt_state=tx.init(params))
    mgr.wait_until_finished()
    other = {"w": params["w"], "b2": params["b"], "h": params["h"]}
    with pytest.raises(ValueError, match=r"not in the checkpoint: \['b2'\]"):
      mgr.restore(params=other, opt_state=tx.init(other))
    bigger = dict(params, b=jnp.zeros(17))
    with pytest.raises(ValueError, match="shape mismatches"):
      mgr.restore(params=bigger, opt_state=tx.init(bigger))
  missing = CheckpointManager(tmp_path / "missing")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    missing.restore(params=params, opt_state=tx.init(params))
  assert missing.latest_step() is None and not (tmp_path / "missing").exists()
  missing.close()


def _save_two(tmp_path, tx, **kw):
  params = make_params()
  params, state = train(tx, params, tx.init(params), 1)
  first = snapshot((params, state))
  mgr = CheckpointManager(tmp_path, save_interval_steps=1, **kw)
  mgr.save(1, params=params, opt_state=state)
  params, state = train(tx, params, state, 1, start=1)
  mgr.save(2, params=params, opt_state=state)
  mgr.wait_until_finished()
  return mgr, first


def _data_files(step_dir):
  out = []
  for root, _, files in os.walk(step_dir):
    out += [os.path.join(root, f) for f in files if os.sep + "d" + os.sep in os.path.join(root, f) + os.sep]
  return [f for f in out if os.path.getsize(f) > 64]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's failed read
@pytest.mark.parametrize("damage", ["truncate", "garbage_metadata", "truncate_without_manifest"])
def test_corrupt_checkpoint_falls_back(tmp_path, damage):
  tx = interleaved("host")
  mgr, first = _save_two(tmp_path, tx)
  step2 = tmp_path / "2"
  if damage == "garbage_metadata":
    (step2 / "opt_state" / "_METADATA").write_text("{not json")
  else:
    for f in _data_files(step2):
      with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    if damage == "truncate_without_manifest":
      os.remove(step2 / "jax_dos_manifest.json")
  with pytest.warns(UserWarning, match="step 2 .* unusable"):
    if damage == "truncate_without_manifest":
      assert mgr.latest_step() == 2  # cheap checks cannot see it; reading does
    else:
      assert mgr.latest_step() == 1
    tp, ts = fresh(tx)
    rp, rs, _ = mgr.restore(params=tp, opt_state=ts)
  assert_equal_trees(first, (rp, rs))
  assert step2.is_dir()  # never delete what could not be read
  mgr.close()


def test_retention_keeps_valid_steps_and_never_deletes_invalid(tmp_path):
  tx = interleaved("device")
  params = make_params()
  state = tx.init(params)
  with CheckpointManager(tmp_path, save_interval_steps=1, max_to_keep=2, async_save=False) as mgr:
    mgr.save(1, params=params, opt_state=state)
    mgr.save(2, params=params, opt_state=state)
    (tmp_path / "2" / "params" / "_METADATA").write_text("garbage")
    mgr.save(3, params=params, opt_state=state)
    mgr.save(4, params=params, opt_state=state)
    assert mgr.all_steps() == [2, 3, 4]  # 1 rotated out, 2 (unreadable) kept
    mgr.save(5, params=params, opt_state=state)
    assert mgr.all_steps() == [2, 4, 5]


def test_incomplete_tmp_directory_is_ignored(tmp_path):
  tx = interleaved("host")
  mgr, first = _save_two(tmp_path, tx)
  mgr.close()
  # What a save killed before commit leaves: a tmp directory without commit metadata.
  tmp_dir = tmp_path / "3.orbax-checkpoint-tmp"
  (tmp_dir / "params").mkdir(parents=True)
  (tmp_dir / "params" / "_METADATA").write_text("{")
  with CheckpointManager(tmp_path) as mgr:
    assert mgr.latest_step() == 2


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_dos
    from jax_dos.checkpoint import CheckpointManager
    params = {"w": jnp.arange(64.0).reshape(8, 8)}
    tx = jax_dos.interleaved_adam(1e-2, plan="host")
    state = tx.init(params)
    mgr = CheckpointManager(sys.argv[1], save_interval_steps=1)
    mgr.save(1, params=params, opt_state=state)
    mgr.wait_until_finished()
    big = {"w": jnp.ones((1024, 1024)), "v": jnp.ones((1024, 1024))}
    bstate = jax_dos.interleaved_adam(1e-2, plan="host").init(big)
    mgr.save(2, params=big, opt_state=bstate)  # async: killed mid-write
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_kill_during_save_keeps_previous(tmp_path):
  proc = subprocess.run(
    [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  params = {"w": jnp.zeros((8, 8))}
  tx = jax_dos.interleaved_adam(1e-2, plan="host")
  with CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    latest = mgr.latest_step()
    assert latest == (2 if (tmp_path / "2").is_dir() else 1)  # 2 only if it committed before the kill
    rp, rs, _ = mgr.restore(1, params=params, opt_state=tx.init(params))
    np.testing.assert_array_equal(np.asarray(rp["w"]), np.arange(64.0).reshape(8, 8))
    np.testing.assert_array_equal(np.asarray(rs.master["w"]), np.arange(64.0).reshape(8, 8))
    # The run goes on and saves over the leftovers.
    assert mgr.save(3, params=rp, opt_state=rs)
    mgr.wait_until_finished()
    assert mgr.latest_step() == 3


_SHARDED_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jax_dos
    from jax_dos.checkpoint import CheckpointManager
    assert len(jax.devices()) == 4
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("x", "y"))
    def make(seed):
      k = jax.random.split(jax.random.key(seed), 2)
      return {"w": jax.device_put(jax.random.normal(k[0], (8, 4)), NamedSharding(mesh, P("x", "y"))),
              "b": jax.device_put(jax.random.normal(k[1], (4,)), NamedSharding(mesh, P("y")))}
    params = make(0)
    tx = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan="host")
    state = tx.init(params)
    g = jax.tree.map(jnp.ones_like, params)
    u, state = tx.update(g, state, params)
    params = optax.apply_updates(params, u)
    want = jax.tree.map(np.array, (params, state))
    with CheckpointManager(sys.argv[1], save_interval_steps=1) as mgr:
      mgr.save(1, params=params, opt_state=state)
      mgr.wait_until_finished()
      # Restore into another plan and another sharding.
      tx2 = jax_dos.interleaved_adam(1e-2, weight_decay=0.1, subgroup_size=1, plan=["device", "host"])
      tp = make(1)
      tp["w"] = jax.device_put(tp["w"], NamedSharding(mesh, P(None, "x")))
      ts = tx2.init(tp)
      rp, rs, _ = mgr.restore(params=tp, opt_state=ts)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves((rp, rs))):
      np.testing.assert_array_equal(a, np.asarray(b))
    for a, b in zip(jax.tree.leaves((tp, ts)), jax.tree.leaves((rp, rs))):
      assert a.sharding == b.sharding, (a.sharding, b.sharding)
    assert rs.master["w"].sharding.memory_kind == "pinned_host"
    assert rs.master["b"].sharding.memory_kind == "device"
    assert rs.mu["w"].sharding.spec == P(None, "x")
    print("OK")
""")


def test_sharded_restore_4_devices(tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  proc = subprocess.run(
    [sys.executable, "-c", _SHARDED_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
  )
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_restore_into_abstract_templates(tmp_path):
  """Templates may be ShapeDtypeStructs with shardings (no memory spent on a throwaway init)."""
  tx = interleaved("host")
  params = make_params()
  params, state = train(tx, params, tx.init(params), 1)
  want = snapshot((params, state))
  with CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    mgr.save(1, params=params, opt_state=state)
    mgr.wait_until_finished()
    abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)  # noqa: E731
    rp, rs, _ = mgr.restore(params=abstract(params), opt_state=abstract(state))
  assert_equal_trees(want, (rp, rs))
  assert kinds(rs) == kinds(state)


def test_a_disk_too_small_is_refused_before_writing(tmp_path, monkeypatch):
  # A full disk cannot be made here; the check reads shutil.disk_usage, so that is what reports one.
  import jax_dos.checkpoint as ckpt

  tx = interleaved("host")
  params = make_params()
  state = tx.init(params)
  with CheckpointManager(tmp_path, save_interval_steps=1, async_save=False) as mgr:
    mgr.save(1, params=params, opt_state=state)
    params, state = train(tx, params, state, 2)
    real = ckpt.shutil.disk_usage
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(OSError, match=r"needs 0\.00 MB but .* has 0\.00 MB free"):
      mgr.check_space(params, state)
    with pytest.raises(OSError, match="earlier checkpoints are untouched"):
      mgr.save(2, params=params, opt_state=state)
    monkeypatch.undo()
    assert mgr.all_steps() == [1]
    restored, _, _ = mgr.restore(1, params=params, opt_state=state)
  assert_equal_trees(restored, make_params())


@pytest.mark.parametrize("plan", ["host", "device"])
def test_a_tree_with_an_empty_leaf_roundtrips(tmp_path, plan):
  """Orbax refuses zero-size arrays; the manager saves a stand-in and restores the template's empty array."""
  tx = interleaved(plan)

  def with_empty(seed):
    p = make_params(seed)
    p["empty"] = jnp.zeros((0, 4), jnp.float32)
    return p

  params = with_empty(0)
  params, state = train(tx, params, tx.init(params), 2)
  want = snapshot((params, state))
  with CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    mgr.save(2, params=params, opt_state=state)
    mgr.wait_until_finished()
    template_params = with_empty(99)
    template_state = tx.init(template_params)
    rp, rs, _ = mgr.restore(params=template_params, opt_state=template_state)
    assert rs.mu["empty"].shape == (0, 4) and kinds(rs) == kinds(template_state)
    assert_equal_trees(want, (rp, rs))
    # and into optax's adamw state, the other way round
    op, os_, _ = mgr.restore(params=with_empty(7), opt_state=optax.adamw(LR, weight_decay=WD).init(with_empty(7)))
  assert op["empty"].shape == (0, 4) and os_[0].nu["empty"].shape == (0, 4)
  np.testing.assert_array_equal(np.asarray(op["w"]), want[0]["w"])
