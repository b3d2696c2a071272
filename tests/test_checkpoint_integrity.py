"""Checkpoints that verify: a damaged step is moved aside and reported, the manifest's checksums, retention that never
deletes what it cannot replace, an interrupted save's directory."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_helpers import assert_equal_trees, fresh_tree, interleaved, make_params, snapshot, train

import jax_dos
from jax_dos.checkpoint import MANIFEST, CheckpointManager


def _save_two(tmp_path, tx, params=None, **kw):
  """Steps 1 and 2 of a short run, written and closed; returns step 1's ``(params, state)`` and the params."""
  params = make_params() if params is None else params
  params, state = train(tx, params, tx.init(params), 1)
  first = snapshot((params, state))
  with CheckpointManager(tmp_path, save_interval_steps=1, **kw) as mgr:
    mgr.save(1, params=params, opt_state=state)
    params, state = train(tx, params, state, 1, start=1)
    mgr.save(2, params=params, opt_state=state)
  return first, params


def _largest_file(step_dir):
  files = [os.path.join(root, f) for root, _, names in os.walk(step_dir) for f in names if f != MANIFEST]
  return max(files, key=os.path.getsize)


def _damage(step_dir, kind):
  """Damages a saved step as disks, copies and interrupted saves do."""
  rng = np.random.default_rng()
  if kind == "truncated":
    path = _largest_file(step_dir)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  elif kind == "bit_flipped_in_metadata":
    path = os.path.join(step_dir, "opt_state", "_METADATA")
    data = bytearray(open(path, "rb").read())
    i = int(rng.integers(len(data)))
    data[i] ^= 1 << int(rng.integers(8))
    open(path, "wb").write(bytes(data))
  elif kind == "master_removed":
    shutil.rmtree(os.path.join(step_dir, "master"))
  elif kind == "4k_overwritten":  # in the middle of the largest file, same size: only the checksums can tell
    path = _largest_file(step_dir)
    size = os.path.getsize(path)
    assert size > 64 * 1024, size
    with open(path, "r+b") as f:
      f.seek(size // 2)
      f.write(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert os.path.getsize(path) == size
  elif kind == "manifest_missing":  # a kill between Orbax's commit and the manifest
    os.remove(os.path.join(step_dir, "jax_dos_manifest.json"))
  else:
    raise ValueError(kind)


DAMAGE = {
  "truncated": "size-mismatch",
  "bit_flipped_in_metadata": "checksum-mismatch",
  "master_removed": "missing-files",
  "4k_overwritten": "checksum-mismatch",
  "manifest_missing": "no-manifest",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_step_is_moved_aside_and_its_number_reused(tmp_path, damage):
  tx = interleaved("host")
  big = {"w": jax.random.normal(jax.random.key(5), (512, 256), jnp.float32), "b": jnp.ones(7)}  # files of ~0.5 MB
  first, params = _save_two(tmp_path, tx, big)
  _damage(str(tmp_path / "2"), damage)
  with CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    template = fresh_tree(tx, big)
    with pytest.warns(jax_dos.DamagedCheckpointWarning, match=r"step 2 .* failed verification: .*; moved to") as w:
      rp, rs, _ = mgr.restore(params=template[0], opt_state=template[1])
    assert len(w) == 1 and "\n" not in str(w[0].message)
    assert_equal_trees(first, (rp, rs))
    assert os.listdir(tmp_path / "damaged") == [f"2-{DAMAGE[damage]}"] and not (tmp_path / "2").exists()
    assert mgr.all_steps() == [1]
    # Training goes on and saves at the damaged step's number.
    rp, rs = train(tx, rp, rs, 1, start=1)
    want = snapshot((rp, rs))
    mgr.save(2, params=rp, opt_state=rs)
  with CheckpointManager(tmp_path) as mgr:  # a further resume
    assert mgr.latest_step() == 2
    got = mgr.restore(params=template[0], opt_state=template[1])
  assert_equal_trees(want, got[:2])


def test_damaged_steps_are_only_skipped_when_not_to_be_moved(tmp_path):
  tx = interleaved("host")
  first, _ = _save_two(tmp_path, tx)
  _damage(str(tmp_path / "2"), "master_removed")
  with CheckpointManager(tmp_path, move_damaged=False) as mgr:
    with pytest.warns(jax_dos.DamagedCheckpointWarning, match="left in place"):
      assert mgr.latest_step() == 1
    with pytest.raises(ValueError, match="step 2 .* failed verification: .* files are missing .*; left in place"):
      mgr.restore(2, params=make_params(), opt_state=tx.init(make_params()))
  assert (tmp_path / "2").is_dir() and not (tmp_path / "damaged").exists()


def test_no_step_verifies(tmp_path):
  tx = interleaved("device")
  _save_two(tmp_path, tx)
  for step in ("1", "2"):
    _damage(str(tmp_path / step), "bit_flipped_in_metadata" if step == "1" else "truncated")
  with CheckpointManager(tmp_path) as mgr:
    with (
      pytest.warns(jax_dos.DamagedCheckpointWarning),
      pytest.raises(FileNotFoundError, match="no checkpoint .* verifies"),
    ):
      mgr.restore(params=make_params(), opt_state=tx.init(make_params()))
  assert sorted(os.listdir(tmp_path / "damaged")) == ["1-checksum-mismatch", "2-size-mismatch"]


def test_a_step_that_verifies_is_not_overwritten(tmp_path):
  tx = interleaved("device")
  _save_two(tmp_path, tx)
  with CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    with pytest.raises(ValueError, match="step 2 already exists .* and verifies"):
      mgr.save(2, params=make_params(), opt_state=tx.init(make_params()), force=True)
    assert mgr.all_steps() == [1, 2]


def test_manifest_checksums_every_segment_of_every_file(tmp_path, monkeypatch):
  from jax_dos.checkpoint import integrity

  tx = interleaved("host")
  monkeypatch.setattr(integrity, "SEGMENT_BYTES", 4096)  # several segments per data file
  _save_two(tmp_path, tx, {"w": jax.random.normal(jax.random.key(1), (64, 64))})
  manifest = json.load(open(tmp_path / "2" / "jax_dos_manifest.json"))
  on_disk = {os.path.relpath(os.path.join(r, f), tmp_path / "2") for r, _, fs in os.walk(tmp_path / "2") for f in fs}
  assert set(manifest["files"]) == on_disk - {"jax_dos_manifest.json"}
  for rel, (size, crcs) in manifest["files"].items():
    assert len(crcs) == max(1, -(-size // 4096)), rel
  assert integrity.verify(str(tmp_path / "2")) is None
  with open(_largest_file(tmp_path / "2"), "r+b") as f:  # one byte of the last segment
    f.seek(-1, os.SEEK_END)
    last = f.read(1)
    f.seek(-1, os.SEEK_END)
    f.write(bytes([last[0] ^ 0x80]))
  assert integrity.verify(str(tmp_path / "2")).kind == "checksum-mismatch"


def test_a_manifest_of_the_earlier_format_still_verifies(tmp_path):
  """Manifests written before content checksums hold the CRC-32 of files up to 1 MiB; larger files go by size."""
  import zlib

  from jax_dos.checkpoint import integrity

  _save_two(tmp_path, interleaved("host"))
  step = tmp_path / "2"
  files = json.load(open(step / MANIFEST))["files"]
  legacy = {}
  for rel, (size, _) in files.items():
    legacy[rel] = [size, zlib.crc32((step / rel).read_bytes()) if size <= 1 << 20 else None]
  json.dump({"format": "jax_dos.adam/1", "step": 2, "files": legacy}, open(step / MANIFEST, "w"))
  assert integrity.verify(str(step)) is None
  _damage(str(step), "bit_flipped_in_metadata")
  assert integrity.verify(str(step)).kind == "checksum-mismatch"


def test_retention_keeps_intact_steps_and_never_deletes_damaged_ones(tmp_path):
  tx = interleaved("device")
  params = make_params()
  state = tx.init(params)
  with CheckpointManager(tmp_path, save_interval_steps=1, max_to_keep=2, async_save=False) as mgr:
    mgr.save(1, params=params, opt_state=state)
    mgr.save(2, params=params, opt_state=state)
    (tmp_path / "2" / "params" / "_METADATA").write_text("garbage")
    mgr.save(3, params=params, opt_state=state)
    assert mgr.all_steps() == [1, 2, 3]  # intact: 1 and 3
    mgr.save(4, params=params, opt_state=state)
    assert mgr.all_steps() == [2, 3, 4]  # 1 rotated out, 2 (damaged) kept
    mgr.save(5, params=params, opt_state=state)
    assert mgr.all_steps() == [2, 4, 5]
    assert mgr.complete_steps() == [2, 4, 5]  # 2 has its manifest: it finished, then was damaged


def test_retention_deletes_only_after_the_newer_step_is_complete(tmp_path):
  tx = interleaved("host")
  params = make_params()
  state = tx.init(params)
  with CheckpointManager(tmp_path, save_interval_steps=1, max_to_keep=1) as mgr:
    mgr.save(1, params=params, opt_state=state)
    mgr.save(2, params=params, opt_state=state)  # waits for 1's manifest, then writes 2 in the background
    assert (tmp_path / "1" / "jax_dos_manifest.json").exists()  # still there while 2 is written
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2] and mgr.complete_steps() == [2]


def test_incomplete_tmp_directory_is_ignored_and_replaced(tmp_path):
  tx = interleaved("host")
  _save_two(tmp_path, tx)
  # What a save killed before commit leaves: a tmp directory without commit metadata.
  tmp_dir = tmp_path / "3.orbax-checkpoint-tmp"
  (tmp_dir / "params").mkdir(parents=True)
  (tmp_dir / "params" / "_METADATA").write_text("{")
  with CheckpointManager(tmp_path, save_interval_steps=1) as mgr:
    assert mgr.latest_step() == 2
    mgr.save(3, params=make_params(), opt_state=tx.init(make_params()))
    mgr.wait_until_finished()
    assert mgr.latest_step() == 3 and not tmp_dir.exists()


# A subprocess saves step 1, then is killed with SIGKILL while saving step 2 at one of several moments: during Orbax's
# write, after Orbax's commit but before the manifest, or while the manifest's checksums are computed.
