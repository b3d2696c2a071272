"""jax-dos's best exact variant and its peers, one process each, on one machine; then one table.

Systems, run one after another in this order (``--systems`` picks a subset):

  ``jaxdos``   ``bench/train_step.py --variants peak,auto`` (jax-dos with the performance model's plan; optax's
               exact AdamW numbers), its bf16 matmul peak the MFU denominator of every row;
  ``zero2``    DeepSpeed ZeRO-Offload (``peers.py --system zero2``; B x G turned into (B*G) x 1 where the host
               cannot hold ZeRO-2's accumulation buffers: ``--host-fallback``);
  ``zero3``    DeepSpeed ZeRO-3 with ``offload_optimizer.ratio`` (TwinFlow);
  ``torchao``  torchao's ``CPUOffloadOptimizer``;
  ``torch``    ``torch.optim.AdamW`` on the GPU (only where the model and its state fit there).

Every process writes its JSON into ``--out``; ``summary.json`` there holds the table and the commands. Before the
peers, the wheels in ``--wheels`` are installed into ``build/peers-site`` (unless DeepSpeed and torchao already
import), and DeepSpeed's ``cpu_adam`` is built once into ``$TORCH_EXTENSIONS_DIR`` (default
``build/torch_extensions``: both kept between calls on a warm machine). No child starts past ``--deadline-s``, and
each is stopped at it, so the command ends, table written, within a run's time limit; split the systems over
consecutive calls (e.g. ``--systems jaxdos,torchao`` then ``--systems zero2,zero3``) where one call cannot hold all.

Usage (GPU machine)::

    python bench/peers/run_all.py --out $OUT/peers                               # 6.7B, 8 x 2, every system
    python bench/peers/run_all.py --out $OUT/peers --systems zero2,zero3 --preset gpt-1.3b
    python bench/peers/run_all.py --table call1/peers call2/peers --out merged  # one table of several calls' JSONs
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SYSTEMS = ("jaxdos", "zero2", "zero3", "torchao", "torch")
PEERS = SYSTEMS[1:]
GIB = 2**30
SITE = os.path.join(ROOT, "build", "peers-site")
MARGIN_S = 15  # kept before the deadline to write the table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", help="folder for the JSON files, logs and summary.json")
  p.add_argument("--table", nargs="+", default=None,
                 help="only the table of these folders' JSON files (a system from the first folder that has it);"
                      " written to --out/summary.json where --out is given")  # fmt: skip
  p.add_argument("--systems", default="jaxdos,zero2,zero3,torchao", help="comma list of " + ", ".join(SYSTEMS))
  p.add_argument("--preset", default="gpt-6.7b")
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--grad-accum", type=int, default=2)
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--steps", type=int, default=3, help="timed steps per system")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps per system")
  p.add_argument("--jaxdos-variants", default="peak,auto", help="bench/train_step.py --variants")
  p.add_argument("--jaxdos-args", default="", help="extra arguments for train_step.py (e.g. '--clip 1e6')")
  p.add_argument("--ratio", type=float, default=0.75, help="zero3's offload_optimizer.ratio")
  p.add_argument("--peer-args", default="", help="extra arguments for every peers.py (e.g. '--torchao-clip host')")
  p.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="wheels to install for the peers")
  p.add_argument("--deadline-s", type=float, default=560, help="wall seconds for the whole command")
  args = p.parse_args(argv)
  if not args.out and not args.table:
    p.error("give --out (run) or --table (summarize folders).")
  for s in args.systems.split(","):
    if s not in SYSTEMS:
      p.error(f"unknown system {s!r}; choose from {SYSTEMS}.")
  args.out = os.path.abspath(args.out) if args.out else None  # the children run in the repository root
  return args


# ----------------------------------------------------------------------------- children


class Clock:
  def __init__(self, deadline_s: float):
    self.t0, self.deadline_s = time.monotonic(), deadline_s

  def elapsed(self) -> float:
    return time.monotonic() - self.t0

  def left(self) -> float:
    return self.deadline_s - self.elapsed() - MARGIN_S


def stream(cmd: list[str], env: dict[str, str], log_path: str, prefix: str, timeout: float) -> int | None:
  """Runs ``cmd``, printing its output line by line (prefixed) and saving it; None when stopped at ``timeout``."""
  print(f"[{prefix}] $ {' '.join(cmd)}", flush=True)
  with open(log_path, "w") as log:
    proc = subprocess.Popen(
      cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )

    def pump() -> None:
      for line in proc.stdout:
        log.write(line)
        print(f"[{prefix}] {line}", end="", flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
      proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
      os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group (compilers, DeepSpeed's helpers)
      proc.wait()
      reader.join(5)
      print(f"[{prefix}] stopped after {timeout:.0f} s (deadline)", flush=True)
      return None
    reader.join(5)
  return proc.returncode


def peers_env(args: argparse.Namespace) -> dict[str, str]:
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, "build", "torch_extensions"))
  env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")  # CPUOffloadOptimizer needs none of torchao's kernels
  env.setdefault("DS_ACCELERATOR", "cuda")
  paths = [ROOT] + ([SITE] if os.path.isdir(SITE) else []) + [p for p in env.get("PYTHONPATH", "").split(":") if p]
  env["PYTHONPATH"] = ":".join(dict.fromkeys(paths))
  return env


def imports(env: dict[str, str], modules: list[str]) -> bool:
  code = "; ".join(f"import {m}" for m in modules)
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True).returncode == 0


def install_wheels(args: argparse.Namespace, modules: list[str]) -> None:
  """Installs ``--wheels`` into build/peers-site when the peers' packages do not import yet."""
  if imports(peers_env(args), modules):
    return
  wheels = sorted(glob.glob(os.path.join(args.wheels, "*.whl")))
  if not wheels:
    raise SystemExit(
      f"{', '.join(modules)} do not import and {args.wheels} holds no wheels: see bench/peers/README.md."
    )
  print(f"installing {len(wheels)} wheels from {args.wheels} into {SITE}", flush=True)
  cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", SITE]
  subprocess.run([*cmd, *wheels], check=True)
  if not imports(peers_env(args), modules):
    raise SystemExit(f"{', '.join(modules)} still do not import after installing the wheels.")


def peak_tflops(out_dir: str) -> float | None:
  """The bf16 peak the jax-dos run measured in this folder (TFLOP/s), if it ran."""
  path = os.path.join(out_dir, "jaxdos.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    results = json.load(f).get("results", [])
  return next((r["peak_flops"] / 1e12 for r in results if r.get("variant") == "peak" and "peak_flops" in r), None)


def command(args: argparse.Namespace, system: str) -> list[str]:
  shape = ["--preset", args.preset, "--batch", str(args.batch), "--grad-accum", str(args.grad_accum)]
  shape += ["--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
  if system == "jaxdos":
    script = os.path.join("bench", "train_step.py")
    out = os.path.join(args.out, "jaxdos.json")
    return [sys.executable, script, *shape, "--variants", args.jaxdos_variants, "--fb-reps", "1", "--out", out,
            *shlex.split(args.jaxdos_args)]  # fmt: skip
  cmd = [sys.executable, os.path.join("bench", "peers", "peers.py"), "--system", system, *shape]
  cmd += ["--out", os.path.join(args.out, f"{system}.json"), "--ratio", str(args.ratio), *shlex.split(args.peer_args)]
  peak = peak_tflops(args.out)
  if peak:
    cmd += ["--peak-tflops", f"{peak:.1f}"]
  if system == "zero2":
    cmd.append("--host-fallback")
  return cmd


def run(args: argparse.Namespace) -> list[str]:
  """Runs the systems one after another; returns notes on each (exit status, time, what was skipped)."""
  clock = Clock(args.deadline_s)
  os.makedirs(args.out, exist_ok=True)
  systems = args.systems.split(",")
  notes = []
  peers = [s for s in systems if s in PEERS]
  if peers:
    modules = (["deepspeed"] if {"zero2", "zero3"} & set(peers) else []) + (["torchao"] if "torchao" in peers else [])
    if modules:
      install_wheels(args, modules)
  env = peers_env(args)
  if {"zero2", "zero3"} & set(systems):
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"
    t = time.monotonic()
    rc = stream([sys.executable, "-c", code], env, os.path.join(args.out, "cpu_adam.log"), "cpu_adam", clock.left())
    notes.append(f"cpu_adam build/load: {time.monotonic() - t:.0f} s (exit {rc})")
    print(notes[-1], flush=True)
  for system in systems:
    left = clock.left()
    if left < 60:
      notes.append(f"{system}: not started, {left:.0f} s left before the deadline; run it with --systems {system}")
      print(notes[-1], flush=True)
      continue
    cmd = command(args, system)
    if system == "jaxdos":
      cmd += ["--timeout", str(int(left - 30))]
      paths = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and p != SITE]
      child_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=":".join(dict.fromkeys(paths)))
    else:
      child_env = env
    t = time.monotonic()
    rc = stream(cmd, child_env, os.path.join(args.out, f"{system}.log"), system, left)
    notes.append(f"{system}: exit {rc}, {time.monotonic() - t:.0f} s")
    print(f"== {notes[-1]} (elapsed {clock.elapsed():.0f} s)", flush=True)
    write_summary(args.out, notes)
  return notes


# ----------------------------------------------------------------------------- the table


def _first(dirs: list[str], name: str) -> str | None:
  return next((os.path.join(d, name) for d in dirs if os.path.exists(os.path.join(d, name))), None)


def rows(dirs: list[str]) -> list[dict[str, Any]]:
  """One row per system result in ``dirs`` (jax-dos variants first), with the common MFU denominator.

  A system's JSON comes from the first folder that has one; every row's MFU is against jax-dos's measured bf16 peak
  where jax-dos ran (``peak`` variant), else against the peak each peer measured itself.
  """
  found = []
  path = _first(dirs, "jaxdos.json")
  peak = peak_tflops(os.path.dirname(path)) if path else None
  if path:
    with open(path) as f:
      doc = json.load(f)
    cfg = doc.get("config", {})
    for r in doc.get("results", []):
      if r.get("variant") == "peak":
        continue
      row = {"system": f"jax-dos {r['variant']}", "setup": f"{cfg.get('batch')}x{cfg.get('grad_accum')}"}
      if "error" in r:
        found.append({**row, "error": r["error"]})
        continue
      losses = r.get("losses") or [0.0]
      row.update(
        tokens_per_s=r["tokens_per_s"],
        flops_per_token=r["flops_per_token"],
        num_params=r["num_params"],
        gpu_bytes=r.get("gpu_peak_bytes"),
        host_bytes=r.get("host_maxrss_bytes"),
        loss_fell=losses[-1] < losses[0],
        peak_flops=peak * 1e12 if peak else None,
      )
      found.append(row)
  names = {"zero2": "ZeRO-Offload", "zero3": "ZeRO-3 ratio", "torchao": "torchao", "torch": "torch, no offload"}
  for system in PEERS:
    path = _first(dirs, f"{system}.json")
    if not path:
      continue
    with open(path) as f:
      r = json.load(f)
    cfg = r.get("config", {})
    name = names[system]
    if system == "zero3":
      name += f" {cfg.get('ratio')}"
    if system == "torchao":
      name += f" {cfg.get('torchao_master')}" + (", clip" if cfg.get("torchao_clip") == "host" else ", no clip")
    row = {"system": name, "key": system, "setup": f"{cfg.get('batch')}x{cfg.get('grad_accum')}"}
    if "refused" in r or "error" in r or r.get("cut_short"):
      cut = f"cut short after {len(r.get('steps', []))} steps" if r.get("cut_short") else None
      found.append({**row, "error": r.get("refused") or r.get("error") or cut})
      continue
    row.update(
      tokens_per_s=r["tokens_per_s"],
      flops_per_token=r["flops_per_token"],
      num_params=r["num_params"],
      gpu_bytes=r.get("gpu_peak_allocated_bytes"),
      host_bytes=r.get("host_rss_peak_bytes"),
      host_estimate_bytes=r.get("host_estimate_bytes"),
      loss_fell=r.get("loss_fell"),
      peak_flops=peak * 1e12 if peak else r.get("peak_flops"),
      split=(r.get("fwd_s"), r.get("bwd_s"), r.get("opt_s")),
    )
    found.append(row)
  return found


def table(found: list[dict[str, Any]]) -> list[str]:
  base = next((r["tokens_per_s"] for r in found if r.get("key") == "zero2" and "tokens_per_s" in r), None)
  head = f"{'system':26} {'BxG':>5} {'tok/s':>8} {'MFU':>6} {'GPU GiB':>8} {'host GiB':>9} {'host B/param':>13}"
  lines = [head + f" {'loss falls':>10} {'vs ZeRO-Offload':>16}"]
  for r in found:
    if "error" in r:
      lines.append(f"{r['system']:26} {r['setup']:>5} {str(r['error'])[:160]}")
      continue
    mfu = r["flops_per_token"] * r["tokens_per_s"] / r["peak_flops"] if r.get("peak_flops") else None
    r["mfu"] = mfu
    mfu_s = "-" if mfu is None else f"{100 * mfu:.1f}%"
    gpu = f"{r['gpu_bytes'] / GIB:.1f}" if r.get("gpu_bytes") else "-"
    host, per_param = "-", "-"
    if r.get("host_bytes"):
      host, per_param = f"{r['host_bytes'] / GIB:.1f}", f"{r['host_bytes'] / r['num_params']:.1f}"
    ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
    lines.append(
      f"{r['system']:26} {r['setup']:>5} {r['tokens_per_s']:8,.0f} {mfu_s:>6} {gpu:>8} {host:>9} {per_param:>13}"
      f" {str(r.get('loss_fell')):>10} {ratio:>16}"
    )
  return lines


def write_summary(out_dir: str | None, notes: list[str] | None = None, dirs: list[str] | None = None) -> list[str]:
  """The table of ``dirs`` (default ``[out_dir]``); written with its rows and ``notes`` to ``out_dir/summary.json``."""
  found = rows(dirs or [out_dir])
  lines = table(found)
  doc = {
    "command": " ".join(["python", os.path.relpath(os.path.abspath(__file__), ROOT), *sys.argv[1:]]),
    "host": socket.gethostname(),
    "python": platform.python_version(),
    "sources": dirs or [out_dir],
    "notes": notes or [],
    "rows": found,
    "table": lines,
  }
  if out_dir:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
      json.dump(doc, f, indent=1)
  return lines


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  if args.table:
    print("\n".join(write_summary(args.out, dirs=args.table)))
    return
  notes = run(args)
  print("\n".join(write_summary(args.out, notes)))


if __name__ == "__main__":
  main()
