"""train/: a run that is stopped loses nothing (``train/stopping.py``). ``python -m train.gpt`` as a subprocess, given
a signal at a random step: it saves that step, which verifies, exits with ``128 + signum``, and ``--resume`` reaches
the losses of an uninterrupted run bit for bit; a second Ctrl-C ends it at once; two processes of a job stop at the
same step; a step that fails in the host worker ends the run in one line, its newest checkpoint intact."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY, cpu_devices_env

import jax_dos

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40  # the uninterrupted run's; a stopped run is given far more, on the same schedule
SCHEDULE = ["--warmup", "4", "--decay-steps", str(STEPS), "--eval-every", "0", "--log-every", "1", "--offload", "host"]
TIMEOUT_S = 120


def _env(**extra: str) -> dict[str, str]:
  return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **extra)


def _start(out: Path, *flags: str, code: str | None = None, env: dict | None = None) -> subprocess.Popen:
  """``python -m train.gpt`` (or ``python -c code``) on the tiny model, writing to ``out``; stderr to ``out.err``."""
  out.parent.mkdir(parents=True, exist_ok=True)
  head = ["-c", code] if code is not None else ["-m", "train.gpt"]
  err = open(f"{out}.err", "w")
  return subprocess.Popen([sys.executable, *head, *TINY, *SCHEDULE, "--out", str(out), *flags], cwd=ROOT,
                          env=env or _env(), stdout=subprocess.DEVNULL, stderr=err)  # fmt: skip


def _finish(proc: subprocess.Popen, out: Path, timeout: float = TIMEOUT_S) -> tuple[int, str]:
  try:
    proc.wait(timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  return proc.returncode, Path(f"{out}.err").read_text()


def _run(out: Path, *flags: str) -> str:
  """A run to its end (exit status 0); its stderr."""
  code, err = _finish(_start(out, *flags), out)
  assert code == 0, err[-4000:]
  return err


def _logged_step(out: Path) -> int:
  try:
    rows = (out / "metrics.jsonl").read_text().splitlines()
  except FileNotFoundError:
    return 0
  return max((json.loads(r)["step"] for r in rows if r.strip().endswith("}")), default=0)


def _signal_at(proc: subprocess.Popen, out: Path, step: int, signum: int) -> None:
  """Sends ``signum`` once the run has logged ``step`` (or ended)."""
  deadline = time.monotonic() + TIMEOUT_S
  while _logged_step(out) < step and proc.poll() is None and time.monotonic() < deadline:
    time.sleep(0.02)
  proc.send_signal(signum)


def _losses(out: Path) -> list[tuple]:
  rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
  return [(r["step"], r.get("loss"), r.get("val_loss")) for r in rows]


def _stopped_step(err: str, name: str) -> int:
  found = re.findall(rf"^stopped by {name} at step (\d+): saved (\S+) in [\d.]+ s; --resume continues$", err, re.M)
  assert len(found) == 1, err[-4000:]
  return int(found[0][0])


def _verified(ckpt: Path) -> int | None:
  """The newest step that verifies (checksums read); every committed step newer than it moved aside."""
  with jax_dos.CheckpointManager(ckpt) as manager:
    return manager.latest_step()


@pytest.mark.parametrize("name, flags", [("SIGTERM", []), ("SIGINT", ["--overlap", "on"])], ids=["plain", "overlap"])
def test_a_signal_saves_the_step_and_the_resume_is_bit_exact(tmp_path, name, flags):
  signum = getattr(signal, name)
  reference = _start(tmp_path / "whole", *flags, "--steps", str(STEPS))  # beside the stopped run: two cores
  stopped = _start(tmp_path / "run", *flags, "--steps", "100000")
  at = random.randint(2, 25)
  _signal_at(stopped, tmp_path / "run", at, signum)
  code, err = _finish(stopped, tmp_path / "run")
  assert code == 128 + signum, (at, code, err[-4000:])
  assert "Traceback" not in err and f"{name}: the run stops at the end of the step in flight and saves it" in err, err
  step = _stopped_step(err, name)
  assert at <= step < STEPS, (at, step)
  assert _verified(tmp_path / "run" / "ckpt") == step
  code, whole_err = _finish(reference, tmp_path / "whole")
  assert code == 0, whole_err[-4000:]
  _run(tmp_path / "run", *flags, "--steps", str(STEPS), "--resume")
  assert _losses(tmp_path / "run") == _losses(tmp_path / "whole")  # every step's loss and the final val loss


def test_a_second_ctrl_c_stops_at_once(tmp_path):
  """The second SIGINT, sent while the first one's save is being made, ends the run within 5 s with one line and
  no traceback, status 130; what it leaves on disk is never taken for a whole step."""
  out = tmp_path / "run"
  proc = _start(out, "--steps", "100000")
  _signal_at(proc, out, 3, signal.SIGINT)
  deadline = time.monotonic() + TIMEOUT_S
  while "SIGINT again stops at once" not in Path(f"{out}.err").read_text() and time.monotonic() < deadline:
    time.sleep(0.005)
  proc.send_signal(signal.SIGINT)
  sent = time.monotonic()
  code, err = _finish(proc, out, timeout=5)
  took = time.monotonic() - sent
  assert code == 130 and took < 5, (code, took, err[-4000:])
  assert "Traceback" not in err and err.count("stopped by a second SIGINT") == 1, err
  assert "stopped by SIGINT at step" not in err or err.index("stopped by SIGINT at step") < err.index("second"), err
  ckpt = out / "ckpt"
  if ckpt.is_dir():  # the first SIGINT's save, whole, or what the second one left of it, set aside
    newest = _verified(ckpt)
    with jax_dos.CheckpointManager(ckpt) as manager:
      assert manager.all_steps() == ([] if newest is None else [newest]), os.listdir(ckpt)


_FAILING_KERNEL = """
import sys
from jax_dos.kernels import host_kernels
from train import gpt
# The host kernel's 5th call (step 5's update, in the host worker thread) fails as an allocation would.
real, calls = host_kernels.adam_many, []
def adam_many(*args, **kwargs):
  calls.append(1)
  if len(calls) == 5:
    raise MemoryError("the host kernel could not allocate its buffers")
  return real(*args, **kwargs)
host_kernels.adam_many = adam_many
sys.argv[0] = "train.gpt"
gpt.cli()
"""


def test_a_failure_in_the_host_worker_ends_the_run_in_one_line(tmp_path):
  out = tmp_path / "run"
  code, err = _finish(_start(out, "--steps", "10", "--ckpt-every", "2", code=_FAILING_KERNEL), out)
  assert code == 1, (code, err[-4000:])  # not an abort (-6), not 0
  lines = [line for line in err.splitlines() if line.strip()]
  assert lines[-1].startswith("error: training stopped: step 5 failed: MemoryError: the host kernel could not"), err
  assert "Traceback" not in err and "rror" not in "\n".join(lines[:-1]), err  # nothing else: Orbax's threads ended
  assert "the newest checkpoint is step 4" in lines[-1], lines[-1]
  assert _verified(out / "ckpt") == 4


def _job(out: Path, port: int, *flags: str) -> list[subprocess.Popen]:
  """``train.gpt`` as 2 processes of 1 CPU device each (gloo), ``--mesh data=2``; process i's stderr in
  ``out.<i>.err``."""
  procs = []
  for i in range(2):
    coordinator = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
    env = cpu_devices_env(1, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **coordinator)
    err = open(f"{out}.{i}.err", "w")
    procs.append(subprocess.Popen([sys.executable, "-m", "train.gpt", *TINY, *SCHEDULE, "--mesh", "data=2", "--batch",
                                   "2", "--out", str(out), *flags], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=err))  # fmt: skip
  return procs


def _job_done(procs: list[subprocess.Popen], out: Path) -> tuple[list[int | None], list[str]]:
  deadline = time.monotonic() + TIMEOUT_S
  while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
    time.sleep(0.1)
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()
  return [p.returncode for p in procs], [Path(f"{out}.{i}.err").read_text() for i in range(2)]


def test_a_signal_to_one_process_of_a_job_stops_every_process_at_the_same_step(tmp_path):
  """SIGTERM to process 1 of 2: both save the same step (the step's folder holds both processes' shards and
  verifies), both exit 143, and the job resumes from it."""
  from test_multiprocess import _free_port

  out = tmp_path / "run"
  procs = _job(out, _free_port(), "--steps", "100000")
  at = random.randint(2, 10)
  _signal_at(procs[1], out, at, signal.SIGTERM)  # process 0 logs the steps
  codes, errs = _job_done(procs, out)
  assert codes == [143, 143], (codes, errs[0][-3000:], errs[1][-3000:])
  assert "SIGTERM (process 1 of 2): the run stops" in errs[1], errs[1][-3000:]
  step = _stopped_step(errs[0], "SIGTERM")
  assert step >= at and not any("Traceback" in e for e in errs), errs
  assert _verified(out / "ckpt") == step
  assert {p.name for p in (out / "ckpt" / str(step) / "opt_state").glob("ocdbt.process_*")} == {
    "ocdbt.process_0", "ocdbt.process_1"}  # fmt: skip
  codes, errs = _job_done(_job(out, _free_port(), "--steps", str(step + 2), "--resume"), out)
  assert codes == [0, 0], (codes, errs[0][-3000:], errs[1][-3000:])
  assert [s for s, _, _ in _losses(out)] == list(range(1, step + 3))


def test_saves_by_time_cost_at_most_their_share_of_the_run():
  """``SaveClock``: the first save by time after the minutes given, each next one no sooner than 20 times the last
  one's measured cost (``SAVE_SHARE``) nor the minutes; a save written beside the steps costs what it waited for and
  what the steps beside it took beyond their median before it."""
  from train.stopping import SAVE_SHARE, SaveClock

  clock = SaveClock(1.0, now=0.0)
  assert not clock.due(59.9) and clock.due(60.0)
  clock.saved(60.0, waited=10.0, beside=False)  # a save the training waited 10 s for
  assert clock.due_at == 60.0 + 10.0 / SAVE_SHARE and clock.gap_s == 200.0
  clock.saved(300.0, waited=1.0, beside=False)  # a short one: the minutes given
  assert clock.due_at == 360.0
  for _ in range(30):
    clock.step_took(0.1)
  clock.saved(400.0, waited=0.5, beside=True)
  for _ in range(5):
    clock.step_took(0.3)
  assert not clock.due(1e9)  # not while it is being written
  written = clock.written(410.0)
  assert written["steps"] == 5 and abs(written["per_step"] - 0.2) < 1e-12 and abs(written["cost"] - 1.5) < 1e-12
  assert written["seconds"] == 10.0 and clock.due_at == 460.0 and clock.written(411.0) is None
  assert SaveClock(0.0, now=0.0).due(1e9) is False  # --ckpt-every-minutes 0: none by time


def test_a_run_saves_by_time_and_keeps_the_newest(tmp_path):
  """``--ckpt-every-minutes``: a save by time during the run, beside the final one; ``--keep 1`` leaves the final."""
  from helpers import train_tiny

  out = train_tiny(tmp_path, "run", *SCHEDULE, "--steps", "30", "--ckpt-every-minutes", "0.0005", "--keep", "9")
  assert out["step"] == 30
  with jax_dos.CheckpointManager(tmp_path / "run" / "ckpt") as manager:
    steps = manager.complete_steps()
  assert len(steps) >= 2 and steps[-1] == 30 and all(0 < s < 30 for s in steps[:-1]), steps
  train_tiny(tmp_path, "run", *SCHEDULE, "--steps", "32", "--resume", "--ckpt-every-minutes", "0", "--keep", "1")
  assert sorted(os.listdir(tmp_path / "run" / "ckpt")) == ["32"]


def test_a_state_larger_than_the_disk_trains_on_without_checkpoints(tmp_path, monkeypatch, capsys):
  """The disk's free space as a full disk reports it (the one stand-in here: this machine's disk has room): one line
  at the start says checkpoints are off, and the run trains to its end, writing none."""
  from helpers import train_tiny

  from jax_dos.checkpoint import integrity

  real = integrity.shutil.disk_usage
  monkeypatch.setattr(integrity.shutil, "disk_usage", lambda path: real(path)._replace(free=4096))
  out = train_tiny(tmp_path, "run", *SCHEDULE, "--steps", "3", "--ckpt-every", "1")
  err = capsys.readouterr().err
  assert out["step"] == 3 and err.count("ckpt    off: a checkpoint needs") == 1, err
  assert "This run trains on without checkpoints" in err, err
  ckpt = tmp_path / "run" / "ckpt"
  assert not ckpt.exists() or not [n for n in os.listdir(ckpt) if n[0].isdigit()], os.listdir(ckpt)
