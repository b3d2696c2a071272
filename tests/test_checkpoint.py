"""Checkpoints of the offloaded Adam state: roundtrips, cross-plan/optax restores, hazards, robustness."""

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_helpers import (
  LR,
  WD,
  assert_close_trees,
  assert_equal_trees,
  fresh,
  fresh_tree,
  interleaved,
  kinds,
  make_params,
  snapshot,
  train,
)

import jax_dos
from jax_dos.checkpoint import CheckpointManager, from_optax_adamw_state, to_optax_adamw_state


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


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_waited_for_copies_to_host_in_batches(tmp_path, async_save):
  """A save that returns only once written (a synchronous manager, or host state too large to copy: ``"block"``)
  makes Orbax's host copies a batch at a time, each written before the next (at most one array a batch here, a
  handler for each of the three trees at once), where an unbounded batch copies a whole tree first; the checkpoint
  is the same."""
  tx = interleaved("host")
  params, state = train(tx, make_params(), tx.init(make_params()), 2)
  want = snapshot((params, state))
  host_copy = "block" if async_save else "auto"
  peaks = {}
  for batch in (1, 2**30):
    with CheckpointManager(tmp_path / str(batch), async_save=async_save, host_copy=host_copy,
                           save_batch_bytes=batch) as mgr:  # fmt: skip
      mgr.save(2, params=params, opt_state=state, force=True)
      mgr.wait_until_finished()
      peaks[batch] = mgr._transfer_order.peak_in_flight
      tp, ts = fresh(tx)
      rp, rs, _ = mgr.restore(2, params=tp, opt_state=ts)
    assert_equal_trees(want, (rp, rs))
  assert peaks[1] <= 3 < 7 <= peaks[2**30], peaks  # the optimizer state's tree: count, 3 mu, 3 nu


def test_auto_saves_asynchronously_only_what_adds_at_most_a_batch(tmp_path, caplog):
  """``host_copy="auto"``: a state whose asynchronous save could add more host memory than a save's batch (twice its
  host bytes, for the guard's copy and Orbax's, plus the rest) is saved synchronously, said once; a smaller one
  asynchronously. ``save_added_bytes`` states each bound; both checkpoints restore the same state."""
  if jax.default_backend() != "cpu":
    pytest.skip("counts every array as host-resident, as the CPU backend has them")
  tx = interleaved("host")
  params, state = train(tx, make_params(), tx.init(make_params()), 2)
  want = snapshot((params, state))
  trees, _ = jax_dos.checkpoint.canonical.to_disk(params, state)
  total = sum(x.nbytes for x in jax.tree.leaves(trees))  # the CPU backend: every array is host-resident
  for batch, blocks in ((total, True), (2 * total, False)):
    caplog.clear()
    with caplog.at_level("WARNING", logger="jax_dos.checkpoint"):
      with CheckpointManager(tmp_path / str(batch), save_interval_steps=1, save_batch_bytes=batch) as mgr:
        added = mgr.save_added_bytes(params, state)
        for step in (1, 2):
          mgr.save(step, params=params, opt_state=state)
          assert step in mgr.complete_steps() or not blocks  # a synchronous save is complete when it returns
        mgr.wait_until_finished()
        tp, ts = fresh(tx)
        rp, rs, _ = mgr.restore(2, params=tp, opt_state=ts)
    assert_equal_trees(want, (rp, rs))
    said = [r for r in caplog.records if "saves are waited for" in r.getMessage()]
    assert len(said) == (1 if blocks else 0), caplog.text
    assert added == (total if blocks else 2 * total), (added, total)


def test_a_checkpoint_written_compressed_restores(tmp_path, monkeypatch):
  """Checkpoints are written without zstd; one written with it (Orbax's default, this project's before: here
  smaller than the uncompressed one) restores the same state: the codec is in each array's metadata."""
  import orbax.checkpoint as ocp

  tx = interleaved("host")
  start = {"w": jnp.ones((256, 256), jnp.float32), "b": jnp.ones((256,), jnp.float32)}  # compressible
  params, state = train(tx, start, tx.init(start), 2)
  want = snapshot((params, state))
  handler = ocp.PyTreeCheckpointHandler
  with monkeypatch.context() as patch:
    patch.setattr(ocp, "PyTreeCheckpointHandler", lambda *a, **k: handler(*a, **{**k, "use_compression": True}))
    with CheckpointManager(tmp_path / "zstd", async_save=False) as mgr:
      mgr.save(2, params=params, opt_state=state, force=True)
  with CheckpointManager(tmp_path / "plain", async_save=False) as mgr:
    mgr.save(2, params=params, opt_state=state, force=True)
  size = {d: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmp_path / d) for f in fs)
          for d in ("zstd", "plain")}  # fmt: skip
  assert size["zstd"] < 0.95 * size["plain"], size  # the patch took: the files are compressed
  with CheckpointManager(tmp_path / "zstd") as mgr:
    tp, ts = fresh_tree(tx, start)
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


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    import jax, jax.numpy as jnp, numpy as np
    import jax_dos
    from jax_dos.checkpoint import integrity
    from jax_dos.checkpoint import CheckpointManager
    directory, moment = sys.argv[1], sys.argv[2]
    params = {"w": jnp.arange(64.0).reshape(8, 8)}
    tx = jax_dos.interleaved_adam(1e-2, plan="host")
    state = tx.init(params)
    mgr = CheckpointManager(directory, save_interval_steps=1, max_to_keep=1)
    mgr.save(1, params=params, opt_state=state)
    mgr.wait_until_finished()
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if moment == "committed":
      integrity.write_manifest = die
    elif moment == "checksums":
      calls, crc = [], integrity._crc32_range
      integrity._crc32_range = lambda *a: die() if len(calls) > 2 else calls.append(1) or crc(*a)
    big = {"w": jnp.ones((1024, 1024)), "v": jnp.ones((1024, 1024))}
    bstate = jax_dos.interleaved_adam(1e-2, plan="host").init(big)
    mgr.save(2, params=big, opt_state=bstate)  # async: returns while Orbax writes
    if moment == "writing":
      die()
    mgr.wait_until_finished()
    print("not killed")
""")


@pytest.mark.parametrize("moment", ["writing", "committed", "checksums"])
def test_kill_during_save_keeps_previous(tmp_path, moment):
  proc = subprocess.run(
    [sys.executable, "-c", _KILL_SCRIPT, str(tmp_path), moment], capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr[-2000:]
  assert (tmp_path / "1" / "jax_dos_manifest.json").exists()  # retention kept it: step 2 never completed
  params = {"w": jnp.zeros((8, 8))}
  tx = jax_dos.interleaved_adam(1e-2, plan="host")
  with CheckpointManager(tmp_path, save_interval_steps=1, max_to_keep=1) as mgr:
    with warnings.catch_warnings(record=True) as w:
      warnings.simplefilter("always")
      rp, rs, _ = mgr.restore(params=params, opt_state=tx.init(params))
    damaged = [str(x.message) for x in w if issubclass(x.category, jax_dos.DamagedCheckpointWarning)]
    if moment == "writing" and not damaged:  # killed before the commit: only a tmp directory is left
      assert not (tmp_path / "2").exists()
    else:
      assert len(damaged) == 1 and "no jax_dos_manifest.json" in damaged[0], damaged
      assert os.listdir(tmp_path / "damaged") == ["2-no-manifest"]
    np.testing.assert_array_equal(np.asarray(rp["w"]), np.arange(64.0).reshape(8, 8))
    np.testing.assert_array_equal(np.asarray(rs.master["w"]), np.arange(64.0).reshape(8, 8))
    # The run goes on and saves over the leftovers, at the same step number.
    assert mgr.save(2, params=rp, opt_state=rs)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2] and mgr.latest_step() == 2


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
    # The restored count sits on one device; an update with a gradient scale on the mesh still runs.
    scale = jax.device_put(jnp.float32(0.5), NamedSharding(mesh, P()))
    u, _ = tx2.update(jax.tree.map(jnp.ones_like, rp), rs, rp, grad_scale=scale)
    jax.block_until_ready(u)
    assert rs.master["b"].sharding.memory_kind == "device"
    # The template's layout: w's state partitioned over the axis that replicates it (the default), as saved b's was.
    assert rs.mu["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("y", "x"), memory_kind="pinned_host"), 2)
    print("OK")
""")


def test_sharded_restore_4_devices(tmp_path, four_devices):
  proc = four_devices.run(_SHARDED_SCRIPT, str(tmp_path), timeout=120)
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
  from jax_dos.checkpoint import manager as ckpt

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
