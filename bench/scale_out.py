"""Scaling out on one host: the GPT step and its update phase with one process per GPU, against one GPU.

The driver launches, one after another on this host:

  1. the calibration, in its own process (cached per machine, so every run below plans from the same rates);
  2. the baseline: one process on one GPU (no mesh, ``train.gpt``'s single-device path);
  3. for each ``--mesh`` (default ``data=P``): P processes, one per GPU, joined by ``jax.distributed`` through an
     explicit coordinator on localhost (``JAX_LOCAL_DEVICE_IDS`` gives each its GPU), parameters laid out as
     ``train.gpt --mesh`` lays them (``train/parallel.py``), replicated parameters' state partitioned (the default).

Every run trains the same model as ``train.gpt`` does (``train/gradients.py``, ``train/optimizer.py``: ``--offload
auto`` sized from the compiled step, ``jax_dos.update_params``) on random tokens, with ``--batch`` rows per GPU (the
global batch grows with P: weak scaling). Each step is timed in two parts, the gradient step and the update phase
(each waited for, so the parts do not overlap), in every process; a part's time is the slowest process's. Per GPU:
tokens/s of the step, and the update phase's rate: the parameters whose state one GPU updates (all N on one GPU,
about N/P with partitioned or FSDP-sharded state) per second of update phase. Host DRAM bandwidth (numpy, all
cores) and the core count are recorded to explain a shortfall: the GPUs of one host share them.

One JSON (``--out``, default ``$OUT/scale_out.json`` or ``bench/results/scale_out.json``) and a table. At 6.7B on two
H200s the defaults should take 5-7 minutes (not measured yet; at most the calibration's 40 s and ``--timeout`` a run)::

    python bench/scale_out.py                      # 6.7B, P = every GPU of this host, --mesh data=P (5-7 min)
    python bench/scale_out.py --mesh data=2 --mesh fsdp=2
    python bench/scale_out.py --smoke              # 2 CPU processes of one device each, a tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402  (sets nothing until setup_env is called)

SMOKE_MODEL = ["--n-layer", "1", "--n-head", "2", "--d-model", "32", "--vocab-size", "256"]


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--processes", type=int, default=None, help="processes (GPUs) of the scaled runs; default: every GPU")
  p.add_argument("--mesh", action="append", default=None, help="mesh of a scaled run (repeat for several); data=P")
  p.add_argument("--preset", default="gpt-6.7b")
  p.add_argument("--batch", type=int, default=8, help="rows per GPU per micro-batch")
  p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--offload", default="auto", choices=("auto", "host", "stream", "device"))
  p.add_argument("--steps", type=int, default=3, help="timed steps")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
  p.add_argument("--timeout", type=int, default=270, help="seconds per run (all its processes)")
  p.add_argument("--smoke", action="store_true", help="2 CPU processes of one device each, a tiny model")
  p.add_argument("--out", default=None)
  p.add_argument("--worker", nargs=2, default=None, metavar=("MESH", "RESULT"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    args.preset, args.batch, args.grad_accum, args.seq_len, args.offload = "tiny", 2, 2, 16, "host"
    args.steps, args.warmup, args.processes = min(args.steps, 2), 2, args.processes or 2
  if args.out is None:
    args.out = os.path.join(os.environ.get("OUT", os.path.join(ROOT, "bench", "results")), "scale_out.json")
  return args


# ----------------------------------------------------------------------------- one run's process


def train_flags(args: argparse.Namespace, mesh: str | None) -> list[str]:
  """``train.gpt``'s flags for this run (``--batch`` there is rows a GPU, as here)."""
  flags = ["--preset", args.preset, "--batch", str(args.batch), "--grad-accum", str(args.grad_accum),
           "--seq-len", str(args.seq_len), "--offload", args.offload, "--no-ckpt", "--quiet"]  # fmt: skip
  flags += SMOKE_MODEL if args.smoke else ["--remat", "--vocab-size", "50304"]
  return flags + (["--mesh", mesh] if mesh else [])


def worker(args: argparse.Namespace, mesh: str, result: str) -> None:
  """One process of a run: train ``args.warmup + args.steps`` steps, timing the gradient step and the update."""
  from train import parallel

  parallel.join_from_environment()
  import jax
  import numpy as np

  import jax_dos
  from models import gpt as gpt_model
  from train import flags as train_flags_lib
  from train import gradients, optimizer

  mesh = None if mesh == "none" else mesh
  targs = train_flags_lib.parse_args(train_flags(args, mesh))
  cfg = gpt_model.get_config(
    targs.preset, **train_flags_lib.model_overrides(targs), vocab_size=targs.vocab_size, dtype=targs.compute_dtype,
    param_dtype=targs.param_dtype, remat="full" if targs.remat == "auto" else targs.remat,  # the plain step's
  )  # fmt: skip
  grid = parallel.make_mesh(targs.mesh) if targs.mesh else None
  shardings = None if grid is None else parallel.param_shardings(grid, gpt_model.abstract_params(cfg))
  layout = None if grid is None else parallel.batch_sharding(grid)
  graphdef, params = gpt_model.init_params(cfg, seed=0, shardings=shardings)
  step_shape = (targs.global_batch * targs.grad_accum, targs.seq_len)
  step_memory = None
  if targs.offload == "auto" and jax.local_devices()[0].memory_stats() is not None:
    step_memory = gradients.gradient_step_memory(
      graphdef, params, step_shape, targs.clip, targs.grad_flush, targs.grad_accum, batch_sharding=layout
    )
  tx, _ = optimizer.make_optimizer(targs, step_memory)
  opt_state = tx.init(params)
  plan = jax_dos.get_plan(tx, params)
  grad_step = gradients.make_grad_step(tx, params, targs.grad_flush, targs.grad_accum)
  print(plan, f"\nstep memory {step_memory}\nmemory before the first step {jax.local_devices()[0].memory_stats()}")

  def batch(index: int):
    def read(rows: slice):
      tokens = np.random.default_rng([0, index]).integers(0, cfg.vocab_size, (step_shape[0], step_shape[1] + 1))
      tokens = tokens[rows].astype(np.int32)
      return tokens[:, :-1], tokens[:, 1:]

    return read(slice(None)) if layout is None else parallel.global_batch(read, layout, step_shape[0])

  times = []
  for i in range(args.warmup + args.steps):
    data = batch(i)
    t0 = time.perf_counter()
    loss, grads, scale, _ = grad_step(graphdef, params, data, targs.clip)
    jax.block_until_ready((loss, grads, scale))
    t1 = time.perf_counter()
    params, opt_state = optimizer.optimizer_step(targs, tx, grads, opt_state, params, scale)
    del grads
    jax.block_until_ready((params, opt_state))
    t2 = time.perf_counter()
    if i >= args.warmup:
      times.append((t1 - t0, t2 - t1, float(loss)))
  mine = np.array([[g, u] for g, u, _ in times], np.float32)
  every = mine[None]
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(jax.process_count(), len(times), 2)
  held = sum(s.data.size for x in jax.tree.leaves(opt_state.master) for s in x.addressable_shards)
  if jax.process_index() == 0:
    n = gpt_model.tree_size(params)
    out = {
      "mesh": mesh,
      "processes": jax.process_count(),
      "gpus": jax.device_count() if mesh else 1,
      "params": n,
      "tokens_per_step": step_shape[0] * step_shape[1],
      "losses": [x for _, _, x in times],
      "grad_s": every[:, :, 0].tolist(),  # [process][step]
      "update_s": every[:, :, 1].tolist(),
      "state_params_per_gpu": held // len(jax.local_devices()),  # (process 0's devices)
      "plan": str(plan),
      "device": jax.local_devices()[0].device_kind,
      "step_memory_gib": None if step_memory is None else step_memory.peak_bytes / 2**30,
    }
    with open(result, "w") as f:
      json.dump(out, f)
  if jax.process_count() > 1:
    jax.distributed.shutdown()


# ----------------------------------------------------------------------------- the driver


def launch(args: argparse.Namespace, mesh: str | None, processes: int, env: dict) -> dict:
  """Runs one configuration as ``processes`` processes of this script; returns process 0's result (or an error)."""
  with tempfile.TemporaryDirectory() as tmp:
    result = os.path.join(tmp, "result.json")
    logs = [open(os.path.join(tmp, f"process{i}.log"), "w+") for i in range(processes)]
    port = _free_port()
    procs = []
    for i in range(processes):
      penv = dict(env)
      if processes > 1:
        penv |= {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
                 "JAX_PROCESS_ID": str(i)}  # fmt: skip
        if not args.smoke:
          penv["JAX_LOCAL_DEVICE_IDS"] = str(i)
      elif not args.smoke:
        penv["CUDA_VISIBLE_DEVICES"] = "0"
      command = [sys.executable, os.path.abspath(__file__), *_passed(args), "--worker", mesh or "none", result]
      procs.append(subprocess.Popen(command, cwd=ROOT, env=penv, stdout=logs[i], stderr=subprocess.STDOUT))
    t = time.perf_counter()
    deadline = time.monotonic() + args.timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if any(p.poll() not in (None, 0) for p in procs):
        break
      time.sleep(0.5)
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
    wall = time.perf_counter() - t
    tails = []
    for log in logs:
      log.seek(0)
      tails.append(log.read()[-3000:])
      log.close()
    if any(p.returncode != 0 for p in procs) or not os.path.exists(result):
      codes = [p.returncode for p in procs]
      return {"mesh": mesh, "processes": processes, "error": f"exit codes {codes} after {wall:.0f} s", "logs": tails}
    with open(result) as f:
      out = json.load(f)
  out["wall_s"] = wall
  return summarize(out)


def summarize(run: dict) -> dict:
  """Per step the slowest process's parts; medians over the timed steps; rates per GPU."""
  grad = [max(col) for col in zip(*run["grad_s"])]
  update = [max(col) for col in zip(*run["update_s"])]
  step = [g + u for g, u in zip(grad, update)]
  s = {"grad_s": statistics.median(grad), "update_s": statistics.median(update), "step_s": statistics.median(step)}
  s["tokens_per_s"] = run["tokens_per_step"] / s["step_s"]
  s["tokens_per_s_per_gpu"] = s["tokens_per_s"] / run["gpus"]
  s["update_share"] = s["update_s"] / s["step_s"]
  s["update_rate_per_gpu"] = run["state_params_per_gpu"] / s["update_s"]  # parameters whose state one GPU updates
  run["summary"] = s
  return run


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _passed(args: argparse.Namespace) -> list[str]:
  """The options the driver was given, for its workers."""
  names = ("preset", "batch", "grad_accum", "seq_len", "offload", "steps", "warmup")
  out = [x for name in names for x in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
  return out + (["--smoke"] if args.smoke else [])


def gpu_count() -> int:
  out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
  return len([line for line in out.stdout.splitlines() if line.startswith("GPU ")]) if out.returncode == 0 else 0


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.worker:
    common.setup_env(gpu_mem_fraction="0.94")
    worker(args, *args.worker)
    return {}
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
  if args.smoke:
    env |= {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1"}
  processes = args.processes or gpu_count()
  if processes < 2:
    raise SystemExit(f"error: scaling out needs 2 or more GPUs (found {processes}); pass --processes or --smoke.")
  meshes = args.mesh or [f"data={processes}"]
  doc = {
    "meta": {
      "host": socket.gethostname(), "python": platform.python_version(), "cores": os.cpu_count(),
      "ram_gib": common.host_ram_bytes() / 2**30, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
      "dram": common.dram_bandwidth(2**22 if args.smoke else 2**28),
    },
    "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out")} | {"meshes": meshes},
    "runs": [],
  }  # fmt: skip
  if not args.smoke and args.offload == "auto":  # the rates every run below plans from, measured once
    code = "import jax_dos; print(jax_dos.calibrate().summary())"
    try:
      cal = subprocess.run([sys.executable, "-c", code], env=env | {"CUDA_VISIBLE_DEVICES": "0"}, cwd=ROOT,
                           capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
      doc["calibration"] = cal.stdout.strip() or cal.stderr[-2000:]
    except subprocess.TimeoutExpired:
      doc["calibration"] = f"timed out after {args.timeout} s (each run calibrates itself)"
  doc["runs"].append(launch(args, None, 1, env))
  for mesh in meshes:
    doc["runs"].append(launch(args, mesh, processes, env))
  base = doc["runs"][0].get("summary")
  for run in doc["runs"][1:]:
    if base and "summary" in run:
      s = run["summary"]
      s["tokens_per_s_per_gpu_vs_one"] = s["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]
      s["update_rate_per_gpu_vs_one"] = s["update_rate_per_gpu"] / base["update_rate_per_gpu"]
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(doc, f, indent=1)
  print(table(doc))
  print(f"wrote {args.out}")
  return doc


def table(doc: dict) -> str:
  head = (
    f"{'run':<14} {'step s':>8} {'grad s':>8} {'update s':>9} {'tok/s/GPU':>10} {'upd Gp/s/GPU':>13} {'vs one':>12}"
  )
  lines = [head]
  for run in doc["runs"]:
    name = f"{run['processes']} x {run.get('mesh') or '1 GPU'}"
    if "summary" not in run:
      lines.append(f"{name:<14} {run.get('error', '?')}")
      continue
    s = run["summary"]
    vs = (
      f"{s['tokens_per_s_per_gpu_vs_one']:.2f} / {s['update_rate_per_gpu_vs_one']:.2f}"
      if "tokens_per_s_per_gpu_vs_one" in s
      else ""
    )
    lines.append(
      f"{name:<14} {s['step_s']:8.3f} {s['grad_s']:8.3f} {s['update_s']:9.3f} {s['tokens_per_s_per_gpu']:10.0f}"
      f" {s['update_rate_per_gpu'] / 1e9:13.3f} {vs:>12}"
    )
  dram = doc["meta"]["dram"]["bandwidth_Bps"] / 1e9
  lines.append(f"host: {doc['meta']['cores']} cores, DRAM {dram:.0f} GB/s (numpy, all cores); vs one: tokens, update")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
