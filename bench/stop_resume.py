"""A run stopped by SIGTERM and resumed, and what a periodic save costs the steps, with ``python -m train.gpt``.

    python bench/stop_resume.py stop --out OUT [--preset gpt-2.7b] [--stop-at 6] [FLAGS...]
    python bench/stop_resume.py cost --out OUT [--preset gpt-2.7b] [FLAGS...]

``stop``: a run of many steps gets SIGTERM once it has logged ``--stop-at`` steps; the time from the signal to the
process's exit, its status and its last line are recorded. It is resumed for 3 more steps (``--no-ckpt``: nothing
more written), and an uninterrupted run of as many steps gives the losses to compare (the same schedule:
``--decay-steps`` is given). ``cost``: ``--steps 12`` with no checkpoint, with one periodic save at step 6 that the
training waits for (``--ckpt-async off``), and with it written beside the next steps (``--ckpt-async on``) where
the host's available memory holds the save's copies (twice the host state and the parameters; else skipped, and
said): the steps' time after the save against the run without one. Each run's lines go to ``OUT/<name>.log``, the
results to ``OUT/<part>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECAY = ["--decay-steps", "1000"]  # every run on one schedule, whatever its --steps


def _metrics(out: Path) -> list[dict]:
  try:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}")]
  except FileNotFoundError:
    return []


def _start(log: Path, flags: list[str]) -> subprocess.Popen:
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
  return subprocess.Popen([sys.executable, "-m", "train.gpt", *flags], cwd=ROOT, env=env, stdout=open(log, "w"),
                          stderr=subprocess.STDOUT)  # fmt: skip


def _run(log: Path, flags: list[str], deadline: float) -> dict:
  t0 = time.monotonic()
  proc = _start(log, flags)
  try:
    proc.wait(max(1.0, deadline - time.monotonic()))
  except subprocess.TimeoutExpired:
    proc.send_signal(signal.SIGINT)  # stops it at a step boundary, saving: the log says how far it came
    proc.wait(120)
  return {"returncode": proc.returncode, "wall_s": round(time.monotonic() - t0, 1), "flags": flags}


def _tail(log: Path, n: int = 4) -> list[str]:
  keep = ("stopped", "checkpoint", "error", "ckpt ", "done:", "resumed", "Traceback")
  return [line for line in log.read_text(errors="replace").splitlines() if line.startswith(keep)][-n:]


def _losses(out: Path) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in _metrics(out) if "loss" in r}


def stop(args, flags: list[str]) -> dict:
  run, whole = args.run_dir / "run", args.run_dir / "whole"
  base = ["--preset", args.preset, *DECAY, "--log-every", "1", *flags]
  result: dict = {}
  proc = _start(args.out / "stopped.log", [*base, "--steps", "1000", "--ckpt-every-minutes", "0", "--out", str(run),
                                          "--overwrite"])  # fmt: skip
  while proc.poll() is None and max((r["step"] for r in _metrics(run) if "loss" in r), default=0) < args.stop_at:
    if time.monotonic() > args.deadline:
      break
    time.sleep(0.05)
  signalled_at_step = max((r["step"] for r in _metrics(run) if "loss" in r), default=0)
  t_signal = time.monotonic()
  proc.send_signal(signal.SIGTERM)
  proc.wait(max(1.0, args.deadline - time.monotonic()))
  result["stopped"] = {
    "returncode": proc.returncode, "signal_to_exit_s": round(time.monotonic() - t_signal, 2),
    "logged_step_at_signal": signalled_at_step, "lines": _tail(args.out / "stopped.log"),
  }  # fmt: skip
  stopped_at = max(_losses(run), default=0)
  steps = str(stopped_at + 3)
  result["resume"] = _run(args.out / "resume.log", [*base, "--steps", steps, "--resume", "--no-ckpt", "--out",
                                                    str(run)], args.deadline)  # fmt: skip
  result["resume"]["lines"] = _tail(args.out / "resume.log")
  result["whole"] = _run(args.out / "whole.log", [*base, "--steps", steps, "--no-ckpt", "--out", str(whole),
                                                  "--overwrite"], args.deadline)  # fmt: skip
  resumed, reference = _losses(run), _losses(whole)
  common = sorted(set(resumed) & set(reference))
  result["losses"] = {"resumed": resumed, "uninterrupted": reference,
                      "equal_bit_for_bit": bool(common) and all(resumed[s] == reference[s] for s in common),
                      "max_abs_diff": max((abs(resumed[s] - reference[s]) for s in common), default=None)}  # fmt: skip
  return result


def _available_bytes() -> int:
  for line in open("/proc/meminfo"):
    if line.startswith("MemAvailable:"):
      return int(line.split()[1]) * 1024
  return 0


def _step_times(out: Path) -> dict[int, float]:
  rows = [r for r in _metrics(out) if "loss" in r and "time" in r]
  return {b["step"]: b["time"] - a["time"] for a, b in zip(rows, rows[1:])}


def cost(args, flags: list[str]) -> dict:
  base = ["--preset", args.preset, *DECAY, "--log-every", "1", "--steps", "12", "--ckpt-every-minutes", "0", *flags]
  save_at = 6
  runs = {"none": ["--no-ckpt"], "waited": ["--ckpt-every", str(save_at), "--ckpt-async", "off", "--keep", "1"],
          "beside": ["--ckpt-every", str(save_at), "--ckpt-async", "on", "--keep", "1"]}  # fmt: skip
  result: dict = {"save_at": save_at}
  for name, more in runs.items():
    out = args.run_dir / name
    if name == "beside":  # its copies: twice the host state and the parameters, from the run that waited
      ckpt = args.run_dir / "waited" / "ckpt"
      state = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.is_dir() else 0
      if state == 0 or 2 * state > _available_bytes() - 8 * 2**30:
        result[name] = {"skipped": f"a save beside the steps needs about {2 * state / 2**30:.1f} GiB more host memory"
                                   f" than training; {_available_bytes() / 2**30:.1f} GiB available now"}  # fmt: skip
        continue
    shutil.rmtree(args.run_dir / "waited", ignore_errors=True) if name == "beside" else None  # the disk's room
    result[name] = _run(args.out / f"{name}.log", [*base, *more, "--out", str(out), "--overwrite"], args.deadline)
    times = _step_times(out)
    result[name]["step_s"] = {str(k): round(v, 3) for k, v in sorted(times.items())}
    result[name]["after_save_s"] = round(sum(v for k, v in times.items() if k > save_at), 3)  # steps 7..12
    result[name]["lines"] = _tail(args.out / f"{name}.log", 6)
  none = result["none"].get("after_save_s")
  for name in ("waited", "beside"):
    if "after_save_s" in result.get(name, {}) and none:
      result[name]["save_cost_s"] = round(result[name]["after_save_s"] - none, 3)  # what the save added to the steps
      result[name]["tokens_per_s_share"] = round(none / result[name]["after_save_s"], 4)  # of the run without a save
  return result


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("part", choices=("stop", "cost"))
  p.add_argument("--out", type=Path, required=True)
  p.add_argument("--preset", default="gpt-2.7b")
  p.add_argument("--stop-at", type=int, default=6)
  p.add_argument("--run-dir", type=Path, default=Path("/tmp/stop_resume"))
  p.add_argument("--deadline-s", type=float, default=470.0)
  args, flags = p.parse_known_args()
  args.deadline = time.monotonic() + args.deadline_s
  args.out.mkdir(parents=True, exist_ok=True)
  shutil.rmtree(args.run_dir, ignore_errors=True)
  args.run_dir.mkdir(parents=True)
  flags = flags or ["--batch", "8", "--grad-accum", "2", "--clip", "1e6"]
  result = (stop if args.part == "stop" else cost)(args, flags)
  (args.out / f"{args.part}.json").write_text(json.dumps(result, indent=1))
  print(json.dumps(result, indent=1)[:6000])
  shutil.rmtree(args.run_dir, ignore_errors=True)


if __name__ == "__main__":
  main()
