"""Several processes joined by ``jax.distributed``: 2 CPU processes with 2 devices each, gloo collectives.

One pair of processes (``two_processes``) runs the checks of ``tests/multiprocess_worker.py`` (FSDP-sharded and
data-parallel parameters, every placement, against ``optax.adamw``), of ``tests/multiprocess_checkpoint_worker.py``,
of ``tests/multiprocess_overlap_worker.py`` and of ``tests/multiprocess_dropout_worker.py`` (``test_stage_rng``'s
dropout) one after another, each process checking the shards it addresses; a test reads its part of their outputs.
The processes are bounded in time and killed if they outlive it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import cpu_devices_env

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
CHECKPOINT_WORKER = TESTS / "multiprocess_checkpoint_worker.py"
TIMEOUT_S = 240
CHECKS = 24  # "ok" per process: 2 layouts x (4 placements, update_params, write_behind, delay, auto), 6 whole copies,
# the refusal both processes share, the worker's programs without collectives


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(command: Callable[[str, int], tuple[list[str], dict]], processes: int = 2, devices: int = 2) -> list[str]:
  """Runs ``command(port, i) -> (argv, extra environment)`` as process ``i`` of ``processes`` CPU processes of
  ``devices`` devices each, ``port`` free for their coordinator; returns their outputs (all must pass).

  A process that fails ends the others (they would wait for it in a collective); none outlives ``TIMEOUT_S``.
  """
  env = cpu_devices_env(devices, PYTHONFAULTHANDLER="1")
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  port = str(_free_port())
  with tempfile.TemporaryDirectory() as tmp:
    logs = [open(Path(tmp) / f"process{i}.log", "w+") for i in range(processes)]
    commands = [command(port, i) for i in range(processes)]
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env | extra, stdout=log, stderr=subprocess.STDOUT) for
             (argv, extra), log in zip(commands, logs)]  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    try:
      while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
          break
        time.sleep(0.2)
    finally:
      hung = [p for p in procs if p.poll() is None]
      for p in hung if time.monotonic() >= deadline else []:
        p.send_signal(signal.SIGABRT)  # faulthandler writes every thread's stack to its log
      for p in hung:
        try:
          p.wait(timeout=10)
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()
    outputs = []
    for log in logs:
      log.seek(0)
      outputs.append(log.read())
      log.close()
  codes = [p.returncode for p in procs]
  report = "\n".join(f"--- process {i} (exit {c}):\n{out[-6000:]}" for i, (c, out) in enumerate(zip(codes, outputs)))
  assert codes == [0] * processes, f"exit codes {codes} (-9: killed, timed out or another failed)\n{report}"
  return outputs


# The workers' checks in one job, one part after another: a part's lines follow its name's marker line.
PART = "----- part"
JOINED = textwrap.dedent(
  f"""
    import sys
    sys.path.insert(0, sys.argv[1])
    import jax
    import multiprocess_checkpoint_worker, multiprocess_dropout_worker, multiprocess_overlap_worker
    import multiprocess_worker

    port, process_id, seed, checkpoints, overlapped = sys.argv[2:]
    multiprocess_worker.join(int(port), int(process_id))
    try:
      for name, check in (
        ("optax", lambda: multiprocess_worker.run_checks(int(seed))),
        ("checkpoint", lambda: multiprocess_checkpoint_worker.train_and_save(int(seed), checkpoints)),
        ("overlapped", lambda: multiprocess_overlap_worker.run(int(seed), overlapped)),
        ("dropout", lambda: multiprocess_dropout_worker.run(int(seed))),
      ):
        print("{PART}", name, flush=True)
        check()
    finally:
      jax.distributed.shutdown()
  """
)


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[Path, list[dict[str, str]]]:
  """The three workers' checks in one pair of processes (2 x 2 CPU devices), their checkpoints under the folder
  returned; each process's output by part (``optax``, ``checkpoint``, ``overlapped``, ``dropout``)."""
  root = tmp_path_factory.mktemp("two_processes")
  seed = str(np.random.default_rng().integers(2**31))
  for name in ("checkpoint", "overlapped"):
    (root / name).mkdir()
  outputs = launch(
    lambda port, i: ([sys.executable, "-c", JOINED, str(TESTS), port, str(i), seed, str(root / "checkpoint"),
                      str(root / "overlapped")], {})
  )  # fmt: skip
  parts = []
  for out in outputs:
    pieces = re.split(rf"^{PART} (\w+)\n", out, flags=re.M)[1:]
    parts.append(dict(zip(pieces[::2], pieces[1::2])))
    assert list(parts[-1]) == ["optax", "checkpoint", "overlapped", "dropout"], out
  return root, parts


@pytest.mark.xdist_group("two_processes")  # one worker makes the module's job
def test_two_processes_match_optax(two_processes):
  for out in (parts["optax"] for parts in two_processes[1]):
    assert out.count("ok ") == CHECKS, out


@pytest.mark.xdist_group("two_processes")
def test_checkpoint_saved_by_two_processes_restores_in_two_and_in_one(two_processes, four_devices):
  """Each process writes its shards; the step restores bit-exact into 2 processes, and into 1 on other layouts; and
  with its moments converted: to bfloat16 in the 2 processes, to int8 on one device."""
  root, parts = two_processes
  for out in (p["checkpoint"] for p in parts):
    assert "ok restored in 2 processes" in out and "ok converted in 2 processes" in out, out
  result = four_devices.run(None, "single", str(root / "checkpoint"), path=str(CHECKPOINT_WORKER), timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stdout + result.stderr
  assert result.stdout.count("ok restored in one process") == 3, result.stdout


@pytest.mark.xdist_group("two_processes")
def test_overlapped_step_on_two_processes_matches_optax_agrees_on_one_plan_and_resumes(two_processes):
  """``OverlappedStep`` data-parallel over 2 processes x 2 devices: optax's chain with the clip firing and silent,
  each process's pinned bytes (its half of the state), one plan from processes that measured apart, a layout one
  host cannot hold refused on both before allocation, and a checkpoint both wrote resumed bit-exact."""
  checks = ("equals optax, clip fires", "equals optax, clip silent", "refused before allocation", "one plan",
            "resumed bit-exact")  # fmt: skip
  for out in (parts["overlapped"] for parts in two_processes[1]):
    for check in checks:
      assert f"ok {check}" in out, out


@pytest.mark.xdist_group("two_processes")
def test_dropout_over_two_processes_is_the_plain_models(two_processes):
  """2 processes (``jax.distributed``, gloo) train ``test_stage_rng``'s NNX model data-parallel through the stages,
  on a mesh of one device of each, and draw the plain path's masks on the whole batches: its losses, parameters and
  counters (``tests/multiprocess_dropout_worker.py``), with the model's own streams and with keys given at call
  time."""
  for out in (parts["dropout"] for parts in two_processes[1]):
    assert out.count("ok ") == 2, out


# A GPT small enough that a run takes seconds; 8 rows a step (2 micro-batches of 4: one per device of the mesh).
TINY_GPT = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--seq-len", "16", "--batch", "1", "--grad-accum",
            "2", "--eval-batches", "1", "--eval-every", "0", "--log-every", "1", "--offload", "host",
            "--decay-steps", "6", "--mesh", "data=2,fsdp=2"]  # fmt: skip


def _losses(out: Path) -> dict[int, float]:
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_train_gpt_on_two_processes_matches_one_and_resumes_on_the_overlapped_step(tmp_path):
  """``python -m train.gpt --mesh data=2,fsdp=2`` as 2 processes x 2 devices (explicit coordinator) trains as one
  device does on the same 8 rows a step (this process, ``--batch 4``; ``--overlap`` off, as ``auto`` is on a CPU; one
  process of 4 devices trains as one device: ``test_devices.py``), and resumes from the checkpoint the 2 processes
  wrote as 2 processes x 1 device on the overlapped step (``--mesh data=2 --overlap on``): the same losses, to
  rounding (float32 parameters)."""
  from train import gpt as train_gpt

  flags = [*TINY_GPT, "--param-dtype", "float32"]

  def gpt(*more: str):
    def command(port: str, i: int) -> tuple[list[str], dict]:
      coordinator = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i)}
      return [sys.executable, "-m", "train.gpt", *flags, *more], coordinator

    return command

  mesh = flags.index("--mesh")
  one_device = [*flags[:mesh], *flags[mesh + 2 :], "--batch", "4"]  # the 8 rows of a step, 4 a micro-batch
  train_gpt.main([*one_device, "--steps", "6", "--quiet", "--no-ckpt", "--out", str(tmp_path / "one")])
  outputs = launch(gpt("--steps", "4", "--ckpt-every", "2", "--out", str(tmp_path / "two")))
  assert "done: step 4" in outputs[0] and "done:" not in outputs[1], outputs  # messages from process 0 only
  for out in outputs:  # every process leaves the job together (jax.distributed.shutdown): no error line at the end
    assert not re.search(r"^E\d{4} |Traceback|WatchTasksAsync|Connection refused", out, re.M), out
  assert sorted(os.listdir(tmp_path / "two" / "ckpt")) == ["2", "4"]
  # The resumed steps: `--mesh data=2 --overlap on`, one device a process (the checkpoint restores into any mesh).
  resumed = gpt(
    "--steps", "6", "--resume", "--overlap", "on", "--mesh", "data=2", "--batch", "2", "--out", str(tmp_path / "two")
  )  # 2 rows a device of 2: the same 4 rows a micro-batch
  outputs = launch(resumed, devices=1)
  assert "resumed from step 4" in outputs[0] and "step    overlapped (--overlap on)" in outputs[0], outputs[0]
  one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
  assert sorted(one) == sorted(two) == list(range(1, 7)), (one, two)
  np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-5)
