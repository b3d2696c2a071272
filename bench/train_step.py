"""Benchmark of whole training steps: a GPT or Llama with AdamW state offloaded, jax_dos against the baselines.

Each variant runs in its own subprocess (so each starts with empty GPU and
pinned memory), on the same model, batch and data (the embedded corpus). ``--arch``
picks the model as ``python -m train.gpt --arch`` does (``train.flags.model_module``:
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
import dataclasses
import faulthandler
import json
import os
import platform
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

# XLA's pinned pool cap as the user set it, read before `train.flags` imports jax_dos, whose import sets one: a
# variant's process must not inherit the driver's as if the user had set it (it would keep it, uncapped by the plan).
POOL_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
USER_POOL_LIMIT = os.environ.get(POOL_LIMIT_ENV)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402  (sets nothing until setup_env is called)

from train.flags import ARCHS, model_module  # noqa: E402  (imports jax; starts no backend)

VARIANTS = ("peak", "idiom", "host", "auto", "writebehind", "delay", "predict", "ahead", "hostdelay", "none", "overlap",
            "overlapfire", "overlapbatch")  # fmt: skip
OVERLAPPED = ("overlap", "overlapfire", "overlapbatch")
GIB = 2**30
POOL_MARGIN_BYTES = 4 * GIB  # what jax_dos.cap_pinned_pool adds to a need


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
                 help="block rematerialisation policy (jax_dos.remat); auto: overlap variants let the plan choose per"
                      " block from the measured stages and the memory left (train.gpt --remat auto), the others take"
                      " full")  # fmt: skip
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
  presets = model_module(args).PRESETS
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


# ----------------------------------------------------------------------------- one variant (subprocess)


def _memory(jax) -> dict:
  stats = jax.devices()[0].memory_stats() or {}
  total = common.host_ram_bytes()
  return {
    "gpu_peak_bytes": stats.get("peak_bytes_in_use"),
    "gpu_limit_bytes": stats.get("bytes_limit"),
    "host_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "host_used_bytes": total - common.host_ram_available_bytes(),
    "host_total_bytes": total,
  }


def _peak(jax, jnp) -> dict:
  best = {}
  matmul = jax.jit(lambda a, b: a @ b)
  for n in (4096, 8192, 16384):
    a = jnp.ones((n, n), jnp.bfloat16)
    t = common.timed(lambda a=a: matmul(a, a).block_until_ready(), reps=5, warmup=2)["time_s"]
    best[str(n)] = 2 * n**3 / t
  return {"peak_flops": max(best.values()), "by_size": best}


def model_config(args: argparse.Namespace, **fields):
  """``--arch``'s config of ``--preset`` at ``--vocab-size``, its block at least ``--seq-len`` long, with ``fields``."""
  arch = model_module(args)
  block = max(args.seq_len, arch.PRESETS[args.preset]["block_size"])
  return arch.get_config(args.preset, vocab_size=args.vocab_size, block_size=block, **fields)


def _cap_pinned_pool(args: argparse.Namespace) -> None:
  """XLA's pinned pool capped at the variant's most need before jax starts (``jax_dos.cap_pinned_pool``): the pool
  grows by doubling regions up to its cap, so the cap bounds the process's resident set (docs/overlap.md, "Memory")."""
  if args.variant in ("peak", "idiom", "none"):
    return
  import jax_dos

  n = model_module(args).param_count(model_config(args))
  param_bytes = 4 if args.param_dtype == "float32" else 2
  predict = args.variant == "ahead"  # delay_predict="gradient": copies of the moments
  most = jax_dos.host_need_bound(
    n, param_bytes, overlapped=args.variant in OVERLAPPED, moment_copies=predict, moments=args.moments
  )
  if args.host_gb is not None:  # the pool at --host-gb (the margin inside it), the overlapped plan within it
    most = min(most, int(args.host_gb * GIB) - POOL_MARGIN_BYTES)
  jax_dos.cap_pinned_pool(most, certain_bytes=0)  # the plan says what fits (it may keep state resident)


_STARTED = time.perf_counter()


def _mark(what: str) -> None:
  """A variant's phase on stderr, with the seconds since its process started (a timed-out variant's tail says where
  the time went)."""
  print(f"[{time.perf_counter() - _STARTED:7.1f} s] {what}", file=sys.stderr, flush=True)


# Variants of one model in one call share their programs (the gradient step compiled for its memory, the stages):
# XLA's persistent cache compiles each once (not with --smoke, whose CPU tests run side by side).
COMPILE_CACHE = "/tmp/jax-dos-compile-cache"


def run_variant(args: argparse.Namespace) -> dict:
  if not args.smoke:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILE_CACHE)
  _cap_pinned_pool(args)
  env = common.setup_env(pinned_fraction=0.9, gpu_mem_fraction=args.mem_fraction)
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    env["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
  import jax
  import jax.numpy as jnp
  import optax

  import jax_dos
  from train import data, gradients
  from train.optimizer import decay_mask

  out = {"variant": args.variant, "env": env, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
  if args.variant == "peak":
    return {**out, **_peak(jax, jnp)}

  arch = model_module(args)
  cfg = model_config(
    args,
    dtype="bfloat16" if jax.default_backend() == "gpu" else "float32",
    param_dtype=args.param_dtype,
    remat="full" if args.remat == "auto" else args.remat,
  )
  _mark("jax started")
  graphdef, params = arch.init_params(cfg, seed=0)
  _mark("parameters initialised")
  tokens = data.load_tokens(None)[0]
  rows = args.batch * args.grad_accum
  batches = [jax.device_put(data.get_batch(tokens, rows, args.seq_len, 0, i)) for i in range(2)]
  hyper = dict(b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask)
  lr = 1e-5

  def loss_and_grads(params, batch):  # raw gradients and the factor of a global-norm clip at 1.0 (grad_scale)
    loss, grads = jax.value_and_grad(arch.loss, argnums=1)(graphdef, params, batch)
    return loss, grads, jax_dos.clip_scale(optax.global_norm(grads), args.clip)

  def gradient_function(tx, flush: str):  # train.gpt's gradient step: flushed by `flush`, or accumulated
    grad_step = gradients.make_grad_step(tx, params, flush, args.grad_accum)
    return lambda params, batch: grad_step(graphdef, params, batch, args.clip)[:3]  # (loss, grads, scale)

  apply = jax.jit(optax.apply_updates, donate_argnums=0)
  t0 = time.perf_counter()
  if args.variant in OVERLAPPED:
    return {**out, **run_overlapped(args, jax, jax_dos, arch, gradients, decay_mask, cfg, graphdef, params, batches)}
  if args.variant == "idiom":
    if args.grad_accum > 1:
      raise SystemExit("the idiom runs the whole step in one jit: --grad-accum is not implemented for it")
    tx = jax_dos.interleaved_adam(lr, **hyper, plan="stream", moments=args.moments)
    fb = jax.jit(loss_and_grads)

    def _step(params, state, batch):
      loss, grads, scale = loss_and_grads(params, batch)
      updates, state = tx.update(grads, state, params, grad_scale=scale)
      return optax.apply_updates(params, updates), state, loss

    donate = jax.default_backend() != "cpu"  # jax 0.10's CPU client aborts when donating pinned_host buffers
    step_fn = jax.jit(_step, donate_argnums=(0, 1) if donate else ())
  elif args.variant == "none":
    tx = optax.adamw(lr, **hyper)
    fb = gradient_function(None, "none")
    update = jax.jit(lambda g, s, p, scale: tx.update(jax.tree.map(lambda x: x * scale, g), s, p), donate_argnums=1)

    def step_fn(params, state, batch):
      loss, grads, scale = fb(params, batch)
      updates, state = update(grads, state, params, scale)
      return apply(params, updates), state, loss
  else:
    budgets = {}
    if args.resident_gb is not None:
      budgets["resident_budget_bytes"] = int(args.resident_gb * GIB)
    if args.staging_gb is not None:
      budgets["staging_budget_bytes"] = int(args.staging_gb * GIB)
    plan = "host" if args.variant in ("host", "hostdelay") else "auto"
    if plan == "auto" and len(budgets) < 2 and jax.devices()[0].memory_stats():
      # Budgets from what the compiled gradient step needs (train.gradients.gradient_step_memory: the flush's own
      # program where it does not depend on the plan).
      shape = (rows, args.seq_len)
      need = gradients.gradient_step_memory(graphdef, params, shape, args.clip, args.grad_flush, args.grad_accum)
      budgets["step_memory"] = need
      out["step_memory"] = {"peak_bytes": need.peak_bytes, "live_bytes": need.live_bytes}
    delay = dict(delay=1, delay_warmup=1) if args.variant in ("delay", "predict", "ahead", "hostdelay") else {}
    if args.variant in ("predict", "ahead"):
      delay["delay_predict"] = "moments" if args.variant == "predict" else "gradient"
    if args.variant == "writebehind":
      delay["write_behind"] = True
    planner = jax_dos.auto_planner(**budgets, params_in_place=True, ahead_copies=args.variant == "ahead")
    tx = jax_dos.interleaved_adam(lr, **hyper, plan=plan, planner=planner, moments=args.moments, **delay)
    fb = gradient_function(tx, args.grad_flush)

    def step_fn(params, state, batch):
      loss, grads, scale = fb(params, batch)
      params, state = jax_dos.update_params(tx, grads, state, params, grad_scale=scale)  # no fp32 update tree
      return params, state, loss

  state = tx.init(params)
  if args.variant in ("host", "auto", "writebehind", "delay", "predict", "ahead", "hostdelay"):
    p = jax_dos.get_plan(tx, params)
    out["plan"] = str(p)
    out["plan_predicted_s"] = p.predicted
    out["plan_elements"] = {k: p.elements(k) for k in ("device", "stream", "host")}
  out["init_s"] = time.perf_counter() - t0

  t0 = time.perf_counter()
  losses = []
  for i in range(args.warmup):
    params, state, loss = step_fn(params, state, batches[i % 2])
    losses.append(float(loss))
  jax.block_until_ready(params)
  out["warmup_s"] = time.perf_counter() - t0

  fb_times = []
  for i in range(args.fb_reps + 1):  # the first call may compile (the idiom's fb is a separate program)
    t = time.perf_counter()
    jax.block_until_ready(fb(params, batches[i % 2]))
    fb_times.append(time.perf_counter() - t)
  fb_times = fb_times[1:]

  step_times = []
  t_all = time.perf_counter()
  for i in range(args.steps):
    t = time.perf_counter()
    params, state, loss = step_fn(params, state, batches[i % 2])
    jax.block_until_ready(params)
    step_times.append(time.perf_counter() - t)
    losses.append(float(loss))
  jax_dos.wait_for_host_updates()
  total = time.perf_counter() - t_all

  tokens_per_step = rows * args.seq_len
  step_s = statistics.median(step_times)
  fb_s = statistics.median(fb_times)
  out.update(
    num_params=arch.tree_size(params),
    flops_per_token=arch.flops_per_token(cfg, args.seq_len),
    tokens_per_step=tokens_per_step,
    step_s=step_s,
    step_times_s=step_times,
    steps_total_s=total,
    tokens_per_s=tokens_per_step / step_s,
    fb_s=fb_s,
    fb_times_s=fb_times,
    exposed_update_s=max(0.0, step_s - fb_s),
    exposed_fraction=max(0.0, step_s - fb_s) / step_s,
    losses=losses,
    **_memory(jax),
  )
  return out


def run_overlapped(args, jax, jax_dos, arch, gradients, decay_mask, cfg, graphdef, params, batches) -> dict:
  """The ``overlap`` variants: ``jax_dos.OverlappedStep`` on the model's stages (``arch.staged``), timed step by step.

  Forward/backward alone is the same stage programs with no optimizer, in the
  step's order (``StagedModel.loss_and_grads``, sums in place), so
  the exposed update is what the optimizer adds to the step's own computation.
  """
  clip = 1e-6 if args.variant == "overlapfire" else args.clip
  rows = args.batch * args.grad_accum
  out = {"clip": clip}
  budgets = {}
  if args.resident_gb is not None:
    budgets["resident_budget_bytes"] = int(args.resident_gb * GIB)
  if args.staging_gb is not None:
    budgets["staging_budget_bytes"] = int(args.staging_gb * GIB)
  if len(budgets) < 2 and jax.devices()[0].memory_stats():
    need = gradients.gradient_step_memory(graphdef, params, (rows, args.seq_len), clip, "none", args.grad_accum)
    _mark("the gradient step's memory measured (compiled)")
    budgets["step_memory"] = need
    out["step_memory"] = {"peak_bytes": need.peak_bytes, "live_bytes": need.live_bytes}
  t0 = time.perf_counter()
  planner = jax_dos.auto_planner(**budgets, params_in_place=True)
  tx = jax_dos.interleaved_adam(
    1e-5, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask, planner=planner, moments=args.moments
  )
  staged = arch.staged(cfg)
  groups = staged.split(params)
  del params
  stages = list(staged.stages)
  if args.remat not in ("auto", "full"):  # train.gpt's stages under a fixed --remat: every stage but the head
    stages = [dataclasses.replace(st, remat=args.remat) for st in stages[:-1]] + stages[-1:]
  times = None
  if args.timeline:  # train.gpt --overlap auto's way: place subgroups by the measured stages' timeline
    t1 = time.perf_counter()
    micro = tuple(x[: args.batch] for x in batches[0])
    policies = jax_dos.PLANNED_REMAT_POLICIES if args.remat == "auto" else ()
    times = jax_dos.StagedModel(stages, len(groups)).measure_times(groups, micro, policies)
    _mark("stages measured")
    out["stage_times"] = {"forward_s": times.forward, "backward_s": times.backward,
                          "boundary_bytes": times.boundary_bytes, "measure_s": time.perf_counter() - t1,
                          "remat": {p: dataclasses.asdict(c) for p, c in times.remat.items()}}  # fmt: skip
  step_kw = {"micro_batch_order": "batch" if args.variant == "overlapbatch" else args.overlap_order}
  if args.overlap_run_ahead is not None:
    step_kw["run_ahead_stages"] = args.overlap_run_ahead
  if args.overlap_stream_slots is not None:
    step_kw["stream_slots"] = args.overlap_stream_slots
  if args.overlap_rebalance:
    step_kw["rebalance"] = True
  if args.host_gb is not None:
    step_kw["host_budget_bytes"] = int(args.host_gb * GIB) - POOL_MARGIN_BYTES
  step = jax_dos.OverlappedStep(tx, stages, groups, tx.init(groups), clip_norm=clip, micro_batches=args.grad_accum,
                                stage_times=times, **step_kw)  # fmt: skip
  out["run_ahead_stages"] = step.run_ahead_stages
  out["micro_batch_order"] = step.micro_batch_order
  out["stream_speculation"] = step.stream_speculation
  out["host_budget_bytes"] = step.host_budget_bytes
  out["host_bytes_planned"] = step.host_bytes()
  out["host_resident_estimate_bytes"] = jax_dos.resident_estimate(step.host_bytes())
  del groups
  out["plan"] = str(step.plan)
  out["remat"] = list(step.plan.remat) if step.plan.remat is not None else [st.remat for st in stages]
  out["plan_predicted"] = dict(step.plan.predicted)
  out["plan_elements"] = {k: step.plan.elements(k) for k in ("device", "stream", "host")}
  out["init_s"] = time.perf_counter() - t0
  _mark(f"overlap: planned and initialised in {out['init_s']:.0f} s")

  losses, norms = [], []
  t0 = time.perf_counter()
  for i in range(args.warmup):
    losses.append(float(step(batches[i % 2])))
    norms.append(float(step.grad_norm))
  step.settle()
  out["warmup_s"] = time.perf_counter() - t0
  _mark(f"overlap: {args.warmup} warm-up steps in {out['warmup_s']:.0f} s")

  fb_times = []
  for i in range(args.fb_reps + 1):  # the first call may compile (no running sums in the first micro-batch)
    t = time.perf_counter()
    groups = step.params
    _, sums = step.model.loss_and_grads(groups, batches[i % 2], args.grad_accum, step.micro_batch_order)
    jax.block_until_ready(sums)
    fb_times.append(time.perf_counter() - t)
    del sums
  fb_times = fb_times[1:]

  step_times, timed_losses, timed_norms = [], [], []
  with jax_dos.trace.recording() as spans:
    t_all = time.perf_counter()
    for i in range(args.steps):
      t = time.perf_counter()
      timed_losses.append(step(batches[i % 2]))  # read after the run: a read per step waits behind the copies
      step_times.append(time.perf_counter() - t)
      timed_norms.append(step.grad_norm)
    step.settle()
    jax.block_until_ready(step.params)
    total = time.perf_counter() - t_all
  out["plan_after"] = str(step.plan)  # rebalancing may have moved subgroups
  losses += [float(x) for x in timed_losses]
  norms += [float(x) for x in timed_norms]
  step_s = total / args.steps  # a call returns before its update is done: the steady rate is the whole run's
  fb_s = statistics.median(fb_times)
  out.update(
    num_params=sum(x.size for x in jax.tree.leaves(step.params)),
    flops_per_token=arch.flops_per_token(cfg, args.seq_len),
    tokens_per_step=rows * args.seq_len,
    step_s=step_s,
    step_times_s=step_times,
    steps_total_s=total,
    tokens_per_s=rows * args.seq_len / step_s,
    fb_s=fb_s,
    fb_times_s=fb_times,
    exposed_update_s=max(0.0, step_s - fb_s),
    exposed_fraction=max(0.0, step_s - fb_s) / step_s,
    losses=losses,
    grad_norms=norms,
    trace=[dataclasses.asdict(s) for s in spans],
    **_memory(jax),
  )
  step.close()
  return out


# ----------------------------------------------------------------------------- driver


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
  if args.variant:
    faulthandler.enable()  # a crash leaves its threads' stacks in the stderr tail the driver keeps
    faulthandler.dump_traceback_later(max(1, args.timeout - 10), exit=True)  # and so does a hang, before the kill
    res = run_variant(args)
    res["written_at"] = time.time()  # the driver measures the exit from here
    with open(args.result, "w") as f:
      json.dump(res, f)
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
