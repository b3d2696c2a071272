"""One variant of ``bench/train_step.py`` in the variant's own process: the model, its step, the timing.

``run_in_process(args, path)`` is all that process does (``bench/train_step.py``
starts it with its own flags and ``--variant``, ``--result``): XLA's pinned pool
capped at the variant's most need before jax starts (the offloaded variants),
``--arch``'s model built, the variant's step (``VARIANTS``; the ``OVERLAPPED``
ones on the model's stages) warmed up and timed with its forward/backward alone,
and one JSON object written to ``path`` with ``written_at`` (``time.time()``: the
driver measures the exit from it). Its phases go to stderr as ``[  t s] what``,
the seconds since the process started; a crash, or a hang 10 s before the
timeout, leaves every thread's stack there.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import resource
import statistics
import sys
import time

import common  # sets nothing until setup_env is called

from train.flags import model_module  # imports jax; starts no backend

VARIANTS = ("peak", "idiom", "host", "auto", "writebehind", "delay", "predict", "ahead", "hostdelay", "none", "overlap",
            "overlapfire", "overlapbatch")  # fmt: skip
OVERLAPPED = ("overlap", "overlapfire", "overlapbatch")
GIB = 2**30
POOL_MARGIN_BYTES = 4 * GIB  # what jax_dos.cap_pinned_pool adds to a need


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


def run_in_process(args: argparse.Namespace, path: str) -> None:
  """Runs ``args.variant`` in this process and writes its result to ``path``, with ``written_at`` (``time.time()``)."""
  faulthandler.enable()  # a crash leaves its threads' stacks in the stderr tail the driver keeps
  faulthandler.dump_traceback_later(max(1, args.timeout - 10), exit=True)  # and so does a hang, before the kill
  res = run_variant(args)
  res["written_at"] = time.time()  # the driver measures the exit from here
  with open(path, "w") as f:
    json.dump(res, f)
