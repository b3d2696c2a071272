"""Benchmark of whole training steps: a GPT or Llama with AdamW state offloaded, jax_dos against the baselines.

Each variant runs in its own subprocess (so each starts with empty GPU and
pinned memory), on the same model, batch and data (the embedded corpus). ``--arch``
picks the model as ``python -m train.gpt --arch`` does (``train.flags.ARCHS``:
``models/gpt.py`` or ``models/llama.py``); every variant runs either, and MFU
counts the model's own ``flops_per_token``:

  ``peak``   bf16 matmul FLOP/s of this GPU (the MFU denominator, measured in the same run);
  ``idiom``  (1) the JAX idiom: AdamW state in ``pinned_host``, the whole step (forward/backward, clip,
             update, apply) in one jit that moves the state to the GPU and back (MaxText's
             ``optimizer_memory_host_offload``; here ``interleaved_adam(plan="stream")`` traced), donated;
  ``host``   (2) jax_dos, every subgroup on the host kernel (ZeRO-Offload's way), gradient flush;
  ``auto``   (3) jax_dos with the performance model's plan, gradient flush;
  ``writebehind`` as (3) with ``write_behind=True`` (optax's numbers; host state written during the next step);
  ``delay``  (4) as (3) with ``delay=1`` (host subgroups one step late, their kernel overlapping the next step);
  ``hostdelay`` as (2) with ``delay=1``; ``predict`` as (4) with ``delay_predict="moments"``;
  ``ahead``  as (4) with ``delay_predict="gradient"`` (undelayed AdamW's weights, stepped on the GPU);
  ``none``   ``optax.adamw`` with everything on the GPU (only where it fits);
  ``overlap`` ``jax_dos.OverlappedStep``: the model as stages (embeddings, blocks, head), the update running under
             the backward pass and the next forward, the clip speculated not to fire (``--clip``);
  ``overlapfire`` as ``overlap`` with a clip that fires every step (norm 1e-6): the speculation always redone;
  ``overlapbatch`` as ``overlap`` with the micro-batches one after another (``micro_batch_order="batch"``; the
             others take ``--overlap-order``, ``"stage"`` by default).

With ``--grad-accum k`` a step is ``k`` micro-batches of ``--batch`` rows, their
gradients summed on the GPU (``train.gpt``'s gradient step; no flush), for
every variant but the idiom.

Per variant: step time (median over timed steps), tokens/s, MFU against the
measured peak and against the nominal one, forward+backward time (the
variant's gradient function alone; for (2)-(4) it includes the gradient flush),
exposed update = step - forward/backward, peak GPU memory, host memory. The
plan (with its predicted update time) is recorded for jax_dos variants.

Variants of one model in one call compile their shared programs once: each
runs with XLA's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``,
default ``/tmp/jax-dos-compile-cache``; recorded in each result's ``env``).

This file is the driver: the flags, one subprocess per variant with its
``--timeout``, the JSON and the table. A variant's process runs
``bench/train_step_variant.py`` (the model, the variant's step, the timing).

Usage (GPU machine)::

    python bench/train_step.py --preset gpt-6.7b --batch 16 --variants peak,idiom,host --out $OUT/a.json
    python bench/train_step.py --preset gpt-6.7b --batch 8 --grad-accum 2 --variants peak,host,auto,ahead
    python bench/train_step.py --preset gpt-1.3b --param-dtype float32 --variants none,auto --out $OUT/fit.json
    python bench/train_step.py --preset gpt-6.7b --batch 8 --grad-accum 2 --variants overlap --remat auto  # per block
    python bench/train_step.py --arch llama --preset llama-7b --batch 8 --grad-accum 2 --variants peak,auto,overlap
    python bench/train_step.py --smoke          # a tiny model on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time

# XLA's pinned pool cap as the user set it, read before the imports below bring in jax_dos, whose import sets one: a
# variant's process must not inherit the driver's as if the user had set it (it would keep it, uncapped by the plan).
POOL_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
USER_POOL_LIMIT = os.environ.get(POOL_LIMIT_ENV)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from train_step_variant import GIB, OVERLAPPED, VARIANTS, run_in_process  # noqa: E402  (a variant's process)

from train.flags import ARCHS  # noqa: E402  (imports jax; starts no backend)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--arch", default="gpt", choices=tuple(ARCHS), help="the model, as train.gpt's --arch")
  p.add_argument("--preset", default=None, help="a preset of --arch's model (default gpt-6.7b, llama-7b)")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--grad-accum", type=int, default=1,
                 help="micro-batches of --batch rows per step (train.gpt's --grad-accum; no gradient flush;"
                      " not for the idiom)")  # fmt: skip
  p.add_argument("--vocab-size", type=int, default=None, help="default: the preset's (llama-7b: 32000), else 50304")
  p.add_argument("--param-dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--remat", default="full", choices=("auto", "full", "minimal", "none", "offload"),
                 help="block rematerialisation policy (jax_dos.staged.remat); auto: overlap variants let the plan"
                      " choose per block from the measured stages and the memory left (train.gpt --remat auto), the"
                      " others take full")  # fmt: skip
  p.add_argument("--grad-flush", default=None, choices=("host", "all", "none"),  # GRADIENT_FLUSHES, none
                 help="jax_dos variants: gradients the backward pass writes to host memory (gradient_shardings'"
                      " flush; none: all stay on the GPU); default host, none with --grad-accum")  # fmt: skip
  p.add_argument("--variants", default="peak,idiom,host,auto,delay", help="comma list of " + ", ".join(VARIANTS))
  p.add_argument("--steps", type=int, default=4, help="timed steps")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation, delay warm-up)")
  p.add_argument("--fb-reps", type=int, default=3, help="timed forward/backward-only calls")
  p.add_argument(
    "--timeline",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="overlap variants: plan by the measured stages' timeline (train.gpt --overlap auto's way)",
  )
  p.add_argument(
    "--overlap-stream-slots",
    type=int,
    default=None,
    help="overlap variants: most streamed subgroups in flight (default: OverlappedStep's)",
  )
  p.add_argument(
    "--overlap-run-ahead",
    type=int,
    default=None,
    help="overlap variants: stage programs the training thread may run ahead (default: OverlappedStep's)",
  )
  p.add_argument(
    "--overlap-order",
    default="stage",
    choices=("stage", "batch"),
    help="overlap variants: micro_batch_order (stage: every micro-batch through a stage before the next; batch: one"
    " micro-batch after another)",
  )
  p.add_argument(
    "--overlap-rebalance",
    action="store_true",
    help="overlap variants: move subgroups between host and stream by each step's measured ends (warm up longer)",
  )
  p.add_argument(
    "--overlap-pinned",
    default="auto",
    choices=("auto", "arena", "pool"),
    help="overlap variants: where the offloaded state lives (OverlappedStep(pinned_memory=...)): pinned memory the step"
    " maps itself, or XLA's pinned pool",
  )
  p.add_argument("--clip", type=float, default=1.0, help="global-norm clip of every variant (overlapfire: 1e-6)")
  p.add_argument("--moments", default="float32", choices=("float32", "bfloat16", "int8"),
                 help="how the jax_dos variants store mu and nu (interleaved_adam(moments=...))")  # fmt: skip
  p.add_argument("--host-gb", type=float, default=None,
                 help="pinned host memory a variant may take, in GiB: XLA's pool capped there (never below its own"
                      " 64), the overlap variants' host budget 4 GiB below it (default: the plan's bound)")  # fmt: skip
  p.add_argument("--resident-gb", type=float, default=None, help="resident budget (default: the planner's)")
  p.add_argument("--staging-gb", type=float, default=None, help="staging budget (default: the planner's)")
  p.add_argument("--mem-fraction", default="0.94", help="XLA_PYTHON_CLIENT_MEM_FRACTION")
  p.add_argument("--timeout", type=int, default=480, help="seconds per variant")
  p.add_argument("--out", default=None, help="JSON file (default bench/results/train_step.json)")
  p.add_argument("--smoke", action="store_true", help="tiny model, CPU is fine")
  p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # internal: run one variant in this process
  p.add_argument("--result", default=None, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.smoke:
    args.preset, args.batch, args.seq_len, args.vocab_size = "tiny", 4, 64, 256
    args.steps, args.warmup, args.fb_reps = 2, 2, 1
  presets = ARCHS[args.arch].PRESETS
  args.preset = args.preset or {"gpt": "gpt-6.7b", "llama": "llama-7b"}[args.arch]
  if args.preset not in presets:
    p.error(f"--preset {args.preset} is not a preset of --arch {args.arch}; choose one of {', '.join(presets)}.")
  args.vocab_size = args.vocab_size or presets[args.preset].get("vocab_size", 50304)
  if args.grad_accum < 1:
    p.error(f"--grad-accum must be >= 1, got {args.grad_accum}.")
  if args.grad_flush is None:
    args.grad_flush = "host" if args.grad_accum == 1 else "none"
  elif args.grad_accum > 1 and args.grad_flush != "none":
    p.error("--grad-accum sums the gradients on the accelerator: there is nothing to flush; drop --grad-flush.")
  for v in args.variants.split(","):
    if v not in VARIANTS:
      p.error(f"unknown variant {v!r}; choose from {VARIANTS}.")
  return args


def _child(args: argparse.Namespace, variant: str, result: str) -> dict:
  cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--variant", variant, "--result", result]
  t = time.perf_counter()
  with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: a variant stopped at its timeout still tells where
    try:
      env = {k: v for k, v in os.environ.items() if k != POOL_LIMIT_ENV or USER_POOL_LIMIT is not None}
      proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
      err.seek(0)
      return {"variant": variant, "error": f"timed out after {args.timeout} s", "stderr_tail": err.read()[-3000:]}
    err.seek(0)
    proc.stderr = err.read()
  tail = (proc.stderr or "")[-12000:]  # a crash: every thread's Python stack, then the native one
  if proc.returncode != 0 and os.path.exists(result):  # it measured, then crashed (faulthandler's trace in the tail)
    with open(result) as f:
      res = json.load(f)
    return res | {"exit_after_result": proc.returncode, "stderr_tail": tail, "wall_s": time.perf_counter() - t}
  if proc.returncode != 0 or not os.path.exists(result):
    oom = "RESOURCE_EXHAUSTED" in tail or "out of memory" in tail.lower()
    return {"variant": variant, "error": "out of memory" if oom else f"exit {proc.returncode}", "stderr_tail": tail}
  with open(result) as f:
    res = json.load(f)
  res["wall_s"] = time.perf_counter() - t
  res["exit_after_result_s"] = time.time() - res.pop("written_at")
  res["phases"] = [[float(m[1]), m[2]] for m in re.finditer(r"^\[ *([0-9.]+) s\] (.*)$", proc.stderr, re.M)]
  return res


def summarize(results: list[dict]) -> list[str]:
  peak = next((r["peak_flops"] for r in results if r.get("variant") == "peak" and "peak_flops" in r), None)
  by = {r["variant"]: r for r in results}
  head = f"{'variant':12} {'tok/s':>9} {'step s':>7} {'f/b s':>7} {'exposed':>8} {'MFU':>6} {'f/b MFU':>7}"
  lines = [head + f" {'GPU GiB':>8}  vs idiom   vs host   vs auto"]
  for r in results:
    v = r["variant"]
    if v == "peak":
      lines.append(f"{'peak':12} {r.get('peak_flops', 0) / 1e12:.0f} TFLOP/s bf16 (measured)")
      continue
    if "error" in r:
      lines.append(f"{v:12} {r['error']}")
      continue
    mfu = r["flops_per_token"] * r["tokens_per_s"] / peak if peak else None
    r["mfu_measured_peak"] = mfu

    def ratio(base: str, r=r) -> str:
      if "tokens_per_s" not in by.get(base, {}):
        return f"{'-':>9}"
      return f"{r['tokens_per_s'] / by[base]['tokens_per_s']:8.2f}x"

    fb_mfu = r["flops_per_token"] * r["tokens_per_step"] / r["fb_s"] / peak if peak and r.get("fb_s") else None
    r["fb_mfu_measured_peak"] = fb_mfu
    lines.append(
      f"{v:12} {r['tokens_per_s']:9.0f} {r['step_s']:7.3f} {r['fb_s']:7.3f} {100 * r['exposed_fraction']:7.1f}%"
      f" {'' if mfu is None else f'{100 * mfu:5.1f}%':>6} {'' if fb_mfu is None else f'{100 * fb_mfu:5.1f}%':>7}"
      f" {(r['gpu_peak_bytes'] or 0) / GIB:8.1f} {ratio('idiom')} {ratio('host')} {ratio('auto')}"
    )
    if r.get("exit_after_result"):
      lines.append(f"{v:12} then exited with {r['exit_after_result']} (its stderr_tail is in the JSON)")
  return lines


def main(argv=None) -> None:
  args = parse_args(argv)
  if args.variant:  # a variant's own process, started by _child
    run_in_process(args, args.result)
    return
  out_path = args.out or os.path.join(HERE, "results", "train_step.json")
  os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
  calibration = None
  if {"auto", "writebehind", "delay", "predict", "ahead", *OVERLAPPED} & set(args.variants.split(",")):
    # The planner's calibration in a process of its own (then cached for the variants): measured inside a variant,
    # beside a 6.7B model, its 20-30 s of allocations could fragment the accelerator memory the step needs.
    code = "import jax_dos; print(jax_dos.calibrate().summary())"
    calibration = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
    print(f"calibration: {calibration}", flush=True)
  results = []
  for v in args.variants.split(","):
    res = _child(args, v, f"{out_path}.{v}.tmp")
    if os.path.exists(f"{out_path}.{v}.tmp"):
      os.remove(f"{out_path}.{v}.tmp")
    results.append(res)
    keys = ("variant", "error", "tokens_per_s", "step_s", "fb_s", "plan", "stderr_tail")
    print(json.dumps({k: res.get(k) for k in keys}), flush=True)
    lines = summarize(results)
    doc = {
      "config": {k: v for k, v in vars(args).items() if k not in ("variant", "result")},
      "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
      "host": socket.gethostname(),
      "python": platform.python_version(),
      "calibration": calibration,
      "results": results,
      "table": lines,
    }
    with open(out_path, "w") as f:  # after every variant: a run cut short keeps what it measured
      json.dump(doc, f, indent=1)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
