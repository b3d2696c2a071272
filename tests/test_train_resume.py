"""train/: checkpoints of ``python -m train.gpt``: a resumed run trains as one uninterrupted run, the schedule and
the flags a resume keeps, the guards on a run's directory, and recovery from damaged, killed and diverging runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import optax
import pytest
from helpers import TINY
from helpers import same_tree as _same_tree
from helpers import train_tiny as _run

from train import flags as F
from train import progress as P
from train import schedule as S

ROOT = Path(__file__).resolve().parents[1]
HAVE_CHECKPOINT = importlib.util.find_spec("jax_dos.checkpoint") is not None


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
@pytest.mark.parametrize(
  "offload",
  [
    "host",
    "none",
    "host --delay 1 --delay-warmup 1",
    "host --delay 1 --delay-warmup 1 --delay-predict",
    "host --delay 1 --delay-warmup 1 --delay-predict gradient",
    "host --delay 1 --delay-warmup 1 --delay-predict gradient --batch 2 --grad-accum 2",
    "auto --overlap on --batch 2 --grad-accum 2",
  ],
)
def test_resume_is_bit_exact(tmp_path, offload):
  # One run of 2N steps vs N steps + resume for N more, with the same schedule horizon (--decay-steps).
  schedule = ["--decay-steps", "6", "--warmup", "2"]
  common = ["--offload", *offload.split(), *schedule, "--eval-every", "3", "--log-every", "1"]
  full = _run(tmp_path, "full", *common, "--steps", "6", "--ckpt-every", "2")
  first = _run(tmp_path, "split", *common, "--steps", "3")
  second = _run(tmp_path, "split", *common, "--steps", "6", "--resume")
  assert second["start_step"] == 3 and second["step"] == 6
  assert _same_tree(full["params"], second["params"])
  assert {**first["losses"], **second["losses"]} == full["losses"]
  assert second["val_losses"] == {s: v for s, v in full["val_losses"].items() if s > 3}
  # The metrics log of the split run reads as one run, identical to the full run's losses.
  rows = lambda name: [
    (r["step"], r.get("loss"), r.get("val_loss")) for r in map(json.loads, open(tmp_path / name / "metrics.jsonl"))
  ]  # noqa: E731
  assert rows("split") == rows("full")


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
def test_resume_with_more_steps_keeps_the_learning_rate_schedule(tmp_path):
  common = ["--offload", "host", "--eval-every", "0", "--log-every", "1"]
  _run(tmp_path, "split", *common, "--lr", "1e-2", "--warmup", "1", "--steps", "4")
  resumed = _run(tmp_path, "split", *common, "--steps", "8", "--resume")  # no schedule flags: the first run's
  rows = P.read_metrics(str(tmp_path / "split" / "metrics.jsonl"))
  first = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 4, 1e-3)  # --decay-steps defaulted to the first --steps
  assert [r["step"] for r in rows] == list(range(1, 9))
  np.testing.assert_allclose([r["lr"] for r in rows], [float(first(r["step"] - 1)) for r in rows], rtol=1e-6)
  # The optimizer steps on that schedule too: the same parameters as one run told it explicitly.
  whole = _run(tmp_path, "whole", *common, "--lr", "1e-2", "--warmup", "1", "--decay-steps", "4", "--steps", "8")
  assert resumed["losses"] == {s: v for s, v in whole["losses"].items() if s > 4}
  assert _same_tree(resumed["params"], whole["params"])


def test_resumed_schedule_takes_the_flags_not_given():
  saved = dataclasses.asdict(F.parse_args(["--steps", "10", "--warmup", "3", "--lr", "1e-2"]))
  given = F.parse_args(["--steps", "20"])
  args, notes = S.resumed_schedule(given, saved)
  assert len(notes) == 1 and "--decay-steps" in notes[0] and "--warmup" in notes[0]
  assert [getattr(args, k) for k in S.SCHEDULE_FLAGS] == [saved[k] for k in S.SCHEDULE_FLAGS]
  assert given == F.parse_args(["--steps", "20"])  # a new config: the one given is unchanged
  assert dataclasses.replace(args, **{k: getattr(given, k) for k in S.SCHEDULE_FLAGS}) == given
  args, _ = S.resumed_schedule(F.parse_args(["--steps", "20", "--decay-steps", "20", "--lr", "1e-3"]), saved)  # given
  assert (args.decay_steps, args.lr, args.min_lr, args.warmup) == (20, 1e-3, 1e-3 / 10, saved["warmup"])
  same = F.parse_args(["--steps", "10", "--warmup", "3", "--lr", "1e-2", "--resume"])
  assert S.resumed_schedule(same, saved) == (same, [])
  longer = S.resumed_schedule(F.parse_args(["--decay-steps", "3"]), saved)[0]  # a warm-up as long as the decay
  assert (longer.warmup, longer.decay_steps) == (3, 3) and float(S.Schedule(longer)(2)) < longer.lr  # still rising
  with pytest.raises(SystemExit, match="--lr"):  # the saved rate is below the given final rate
    S.resumed_schedule(F.parse_args(["--min-lr", "2e-3"]), dataclasses.asdict(F.parse_args(["--lr", "1e-3"])))


def test_a_resume_that_changes_the_rows_of_a_step_says_how_to_keep_them():
  """Another device count with the same ``--batch`` (``--batch`` is rows a device) changes the step's batch: a note
  (not an error) with the flags that keep it."""
  from train import checkpoints as C

  on = lambda devices, *flags: dataclasses.replace(F.parse_args(list(flags)), global_batch=int(flags[1]) * devices)  # noqa: E731
  saved = dataclasses.asdict(on(2, "--batch", "2"))  # 4 rows a step
  note = C.batch_note(on(1, "--batch", "2"), saved)
  assert "took 4 rows a step (2 a device x 2 device(s)" in note and "this one takes 2" in note, note
  assert note.endswith("Give --batch 4 to keep them."), note
  assert C.batch_note(on(1, "--batch", "4"), saved) is None  # 4 rows on one device: the same batches
  assert C.batch_note(on(1, "--batch", "2", "--grad-accum", "2"), saved) is None  # or in 2 micro-batches
  assert "--batch and --grad-accum whose product with this run's 3 device(s) is 4" in C.batch_note(
    on(3, "--batch", "1"), saved
  )
  assert C.batch_note(on(1, "--batch", "2"), {}) is None  # a checkpoint that does not say


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
def test_overlapped_step_trains_and_its_checkpoint_resumes_on_the_plain_path(tmp_path):
  overlapped = _run(tmp_path, "run", "--steps", "4", "--overlap", "on", "--eval-every", "0", "--log-every", "1")
  assert overlapped["plan"].startswith(("Plan (model+timeline)", "Plan (model+stages)"))
  assert list(overlapped["losses"]) == [1, 2, 3, 4] and all(math.isfinite(v) for v in overlapped["losses"].values())
  plain = _run(tmp_path, "run", "--steps", "5", "--overlap", "off", "--resume", "--eval-every", "0")
  assert plain["start_step"] == 4 and plain["plan"].startswith("Plan (model)")
  with pytest.raises(SystemExit):
    _run(tmp_path, "bad", "--overlap", "on", "--delay", "1")


DEVICES_WORKER = Path(__file__).resolve().parent / "resume_devices_worker.py"


def test_a_checkpoint_saved_on_two_devices_resumes_on_one_and_in_other_moment_formats(tmp_path, capsys, two_devices):
  """Issue 50's N -> M devices through the script (``tests/resume_devices_worker.py`` says what runs where): saved on
  ``--mesh data=2`` (plain step) and ``--mesh fsdp=2`` (overlapped), resumed on one device and, with bfloat16
  moments, on ``data=2``. What each resume restored was checked in its process: the parameters and master weights
  bit for bit, the moments too or converted as ``moment_formats`` converts them. Here, the losses: the same format
  continues as the uninterrupted run on 2 devices, to float32 rounding; a converted one takes step 3 (from the
  restored parameters) as that run, and step 4 (after one update with rounded moments) close to it. The saves run in
  the ``two_devices`` interpreter; the resumes on one device in this process."""
  import resume_devices_worker

  out = two_devices.run(None, "two", str(tmp_path), path=str(DEVICES_WORKER), timeout=300)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
  capsys.readouterr()
  resume_devices_worker.main("one", str(tmp_path))  # this process: one device
  said = out.stdout + capsys.readouterr().out
  checks = ("saved", "r2bf16", "int8 on a mesh refused", "r2to1", "r2int8")
  assert all(f"ok {check}\n" in said for check in checks), said

  def losses(name: str) -> dict[int, float]:
    rows = map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}

  for saved, resumed, converted in (("s2off", "r2to1", False), ("s2off", "r2bf16", True), ("s2on", "r2int8", True)):
    whole, split = losses(saved), losses(resumed)
    assert sorted(whole) == sorted(split) == [1, 2, 3, 4], (whole, split)
    assert [split[s] for s in (1, 2)] == [whole[s] for s in (1, 2)]  # the log of the steps before the checkpoint
    np.testing.assert_allclose(split[3], whole[3], rtol=1e-5, err_msg=resumed)
    np.testing.assert_allclose(split[4], whole[4], rtol=1e-3 if converted else 1e-5, err_msg=resumed)


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
def test_checkpoint_directory_guards(tmp_path, capsys):
  with pytest.raises(SystemExit, match="no checkpoint"):
    _run(tmp_path, "fresh", "--steps", "1", "--resume")
  _run(tmp_path, "run", "--steps", "1", "--eval-every", "0")
  with pytest.raises(SystemExit, match="--resume to continue it, --overwrite to start again, --no-ckpt"):
    _run(tmp_path, "run", "--steps", "2")
  with pytest.raises(SystemExit, match="not found"):  # other mistakes are not hidden by the refusal
    _run(tmp_path, "run", "--steps", "2", "--data", str(tmp_path / "missing.txt"))
  out = _run(tmp_path, "run", "--steps", "2", "--eval-every", "0", "--no-ckpt")  # a second run that saves nothing
  assert out["step"] == 2 and "leaves the checkpoints" in capsys.readouterr().err
  with pytest.raises(SystemExit, match="was trained with --d-model 32, not 64: give its flags"):
    _run(tmp_path, "run", "--steps", "2", "--resume", "--d-model", "64")
  with pytest.raises(SystemExit, match="was trained with --arch gpt, not llama: give its flags"):
    _run(tmp_path, "run", "--steps", "2", "--resume", "--arch", "llama")
  with pytest.raises(SystemExit, match="not found"):  # a failed --overwrite deletes nothing
    _run(tmp_path, "run", "--steps", "2", "--overwrite", "--data", str(tmp_path / "missing.txt"))
  assert os.listdir(tmp_path / "run" / "ckpt") == ["1"]
  _run(tmp_path, "run", "--steps", "2", "--overwrite", "--eval-every", "0")
  assert os.listdir(tmp_path / "run" / "ckpt") == ["2"]


# Damage done to the newest checkpoint of a run (tests/test_checkpoint.py damages files the same ways).
def _damage_newest(ckpt: str, kind: str) -> None:
  step_dir = os.path.join(ckpt, str(max(int(n) for n in os.listdir(ckpt) if n.isdigit())))
  files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs if f != "jax_dos_manifest.json"]
  largest = max(files, key=os.path.getsize)
  rng = np.random.default_rng()
  if kind == "truncated":
    with open(largest, "r+b") as f:
      f.truncate(os.path.getsize(largest) // 2)
  elif kind == "bit_flipped_in_metadata":
    path = os.path.join(step_dir, "params", "_METADATA")
    data = bytearray(open(path, "rb").read())
    data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
    open(path, "wb").write(bytes(data))
  elif kind == "master_removed":
    shutil.rmtree(os.path.join(step_dir, "master"))
  elif kind == "4k_overwritten":
    size = os.path.getsize(largest)
    with open(largest, "r+b") as f:
      f.seek(size // 2)
      f.write(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
  elif kind == "manifest_missing":
    os.remove(os.path.join(step_dir, "jax_dos_manifest.json"))


RECOVERY = ["--offload", "host", "--decay-steps", "8", "--warmup", "2", "--eval-every", "0", "--ckpt-every", "2"]


@pytest.fixture(scope="module")
def recovery_runs(tmp_path_factory):
  """An undamaged run of 8 steps, and a run stopped at step 4 (checkpoints 2 and 4), to be damaged and resumed."""
  root = tmp_path_factory.mktemp("recovery")
  full = _run(root, "full", *RECOVERY, "--steps", "8")
  _run(root, "stopped", *RECOVERY, "--steps", "4")
  return root, full["losses"]


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
@pytest.mark.xdist_group("recovery_runs")  # one worker makes the module's runs
@pytest.mark.parametrize(
  "kind", ["truncated", "bit_flipped_in_metadata", "master_removed", "4k_overwritten", "manifest_missing"]
)
def test_resume_survives_a_damaged_newest_checkpoint(tmp_path, recovery_runs, kind, capsys):
  root, full = recovery_runs
  shutil.copytree(root / "stopped", tmp_path / "run")
  ckpt = tmp_path / "run" / "ckpt"
  _damage_newest(str(ckpt), kind)
  capsys.readouterr()
  out = _run(tmp_path, "run", *RECOVERY, "--steps", "6", "--resume")
  lines = [line for line in capsys.readouterr().err.splitlines() if "failed verification" in line]
  assert len(lines) == 1 and "step 4" in lines[0] and "moved to" in lines[0], lines
  assert out["start_step"] == 2 and out["step"] == 6
  assert out["losses"] == {s: v for s, v in full.items() if 2 < s <= 6}  # the undamaged run's, bit for bit
  assert len(os.listdir(ckpt / "damaged")) == 1 and os.listdir(ckpt / "damaged")[0].startswith("4-")
  assert sorted(int(n) for n in os.listdir(ckpt) if n.isdigit()) == [2, 4, 6]  # step 2 kept, 4 written again
  again = _run(tmp_path, "run", *RECOVERY, "--steps", "8", "--resume")
  assert again["start_step"] == 6 and again["losses"] == {s: v for s, v in full.items() if s > 6}


_KILLED_FIRST_SAVE = textwrap.dedent("""
    import os, signal, sys
    from jax_dos.checkpoint import integrity as checkpoint_integrity
    from train import gpt
    # SIGKILL once Orbax has committed the first checkpoint, before its manifest is written.
    checkpoint_integrity.write_manifest = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
    gpt.main(sys.argv[1:])
""")


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
def test_a_first_save_killed_midway_is_taken_over_by_a_plain_run_and_by_resume(tmp_path, capsys):
  flags = [*TINY, "--offload", "host", "--eval-every", "0", "--ckpt-every", "2", "--steps", "3"]
  proc = subprocess.run(
    [sys.executable, "-c", _KILLED_FIRST_SAVE, *flags, "--out", str(tmp_path / "a")],
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])),
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  assert os.listdir(tmp_path / "a" / "ckpt") == ["2"]  # committed, no manifest
  shutil.copytree(tmp_path / "a", tmp_path / "b")
  for name, extra in (("a", []), ("b", ["--resume"])):
    capsys.readouterr()
    out = _run(tmp_path, name, *flags[len(TINY) :], *extra)
    err = capsys.readouterr().err
    assert out["start_step"] == 0 and out["step"] == 3, name
    assert "no complete checkpoint" in err and "2-no-manifest" in err, err
    assert sorted(os.listdir(tmp_path / name / "ckpt")) == ["2", "3", "damaged"]


DIVERGING = ["--offload", "host", "--decay-steps", "100", "--warmup", "0", "--eval-every", "0", "--log-every", "10"]


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory):
  """A run of 4 steps with checkpoints at steps 2 and 4, to be copied and resumed with a diverging learning rate."""
  root = tmp_path_factory.mktemp("diverging")
  _run(root, "run", *DIVERGING, "--steps", "4", "--ckpt-every", "2")
  return root / "run"


@pytest.mark.skipif(not HAVE_CHECKPOINT, reason="jax_dos.checkpoint is not in this checkout yet")
@pytest.mark.xdist_group("checkpointed_run")  # one worker makes the module's run
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the learning rate, in float32
@pytest.mark.parametrize("ckpt_every, match", [("1", "parameters after step 5's update are not finite"),
                                               ("4", "training loss of step 6 is nan")])  # fmt: skip
def test_a_diverging_run_stops_and_saves_nothing(tmp_path, checkpointed_run, ckpt_every, match):
  common = DIVERGING
  shutil.copytree(checkpointed_run, tmp_path / "run")
  before = {n: os.path.getmtime(tmp_path / "run" / "ckpt" / n) for n in os.listdir(tmp_path / "run" / "ckpt")}
  with pytest.raises(SystemExit, match=match) as e:  # an overflowing learning rate: inf parameters after step 5
    _run(tmp_path, "run", *common, "--steps", "12", "--ckpt-every", ckpt_every, "--resume", "--lr", "1e39")
  assert "Nothing of this state was saved; the newest checkpoint is step 4" in str(e.value)
  after = {n: os.path.getmtime(tmp_path / "run" / "ckpt" / n) for n in os.listdir(tmp_path / "run" / "ckpt")}
  assert after == before  # nothing written, nothing deleted
  assert _run(tmp_path, "run", *common, "--steps", "6", "--resume")["start_step"] == 4


def test_resume_with_no_ckpt_continues_and_writes_nothing(tmp_path):
  """``--resume --no-ckpt`` (a disk without room for another checkpoint) continues from the newest checkpoint, as
  ``--resume`` does, and leaves the folder as it was: no new step, nothing deleted or rewritten."""
  _run(tmp_path, "run", "--steps", "2", "--eval-every", "0")
  ckpt = tmp_path / "run" / "ckpt"
  before = {str(p.relative_to(ckpt)): p.stat().st_mtime_ns for p in ckpt.rglob("*")}
  out = _run(tmp_path, "run", "--steps", "3", "--eval-every", "0", "--resume", "--no-ckpt")
  assert out["start_step"] == 2 and out["step"] == 3, out
  assert {str(p.relative_to(ckpt)): p.stat().st_mtime_ns for p in ckpt.rglob("*")} == before
  assert _run(tmp_path, "run", "--steps", "3", "--eval-every", "0", "--resume")["start_step"] == 2


def test_no_ckpt_writes_no_checkpoint(tmp_path):
  _run(tmp_path, "nockpt", "--steps", "2", "--eval-every", "0", "--no-ckpt")
  ckpt = tmp_path / "nockpt" / "ckpt"
  assert not ckpt.exists() or not any(ckpt.iterdir())
