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
from collections.abc import Callable
from typing import Any, NamedTuple

import common  # sets nothing until setup_env is called
import jax  # these three train.flags imports anyway; none starts a backend (run_variant's settings come first)
import jax.numpy as jnp
import optax

import jax_dos
from train.flags import ARCHS

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
  arch = ARCHS[args.arch]
  block = max(args.seq_len, arch.PRESETS[args.preset]["block_size"])
  return arch.get_config(args.preset, vocab_size=args.vocab_size, block_size=block, **fields)


def _cap_pinned_pool(args: argparse.Namespace) -> None:
  """XLA's pinned pool capped at the variant's most need before jax starts (``jax_dos.cap_pinned_pool``): the pool
  grows by doubling regions up to its cap, so the cap bounds the process's resident set (docs/overlap.md, "Memory")."""
  if args.variant in ("peak", "idiom", "none"):
    return
  n = ARCHS[args.arch].param_count(model_config(args))
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


LR = 1e-5  # every variant's AdamW: learning rate and hyperparameters (the decay mask: train.optimizer.decay_mask)
HYPER = dict(b1=0.9, b2=0.95, weight_decay=0.1)
# The variants on jax_dos.interleaved_adam's own step (jax_dos.update_params), whose plan the result records.
PLANNED = ("host", "auto", "writebehind", "delay", "predict", "ahead", "hostdelay")


class _Model(NamedTuple):
  """``--arch``'s model as a variant runs it, but its parameters (which the steps consume): two batches of
  ``--batch`` x ``--grad-accum`` rows."""

  arch: Any  # the --arch module (models/lm.py's interface)
  cfg: Any
  graphdef: Any
  batches: list


@dataclasses.dataclass
class _Timed:
  """What a variant's timing measured, in seconds."""

  warmup_s: float  # the untimed steps (compilation, delay warm-up)
  fb_times: list[float]  # forward/backward alone, the first (compiling) call left out
  step_times: list[float]  # each timed step's call
  total: float  # the timed steps, until their updates are done
  step_s: float  # a step: the median call where a call blocks, else total / steps
  losses: list[float]  # warm-up and timed steps


def _prepare_process(args: argparse.Namespace) -> dict[str, str]:
  """The process's settings, before jax's backend starts: XLA's persistent compilation cache (not with ``--smoke``),
  the pinned pool capped (``_cap_pinned_pool``), XLA's memory limits (``common.setup_env``). Returns the settings for
  the result's ``env``."""
  if not args.smoke:  # jax read the variable when this module imported it: the setting itself takes it now
    jax.config.update("jax_compilation_cache_dir", os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILE_CACHE))
  _cap_pinned_pool(args)
  env = common.setup_env(pinned_fraction=0.9, gpu_mem_fraction=args.mem_fraction)
  if "JAX_COMPILATION_CACHE_DIR" in os.environ:
    env["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
  return env


def _build_model(args: argparse.Namespace) -> tuple[_Model, Any]:
  """``--arch``'s model at ``--param-dtype`` (bf16 compute on the GPU) with two batches of the embedded corpus on the
  device, and its parameters."""
  from train import data

  arch = ARCHS[args.arch]
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
  return _Model(arch, cfg, graphdef, batches), params


def _adamw_hyper() -> dict:
  """``HYPER`` with train.gpt's weight-decay mask."""
  from train.optimizer import decay_mask

  return dict(HYPER, mask=decay_mask)


def _budgets(args: argparse.Namespace) -> dict[str, int]:
  """The planner's budgets ``--resident-gb`` and ``--staging-gb`` give, in bytes."""
  budgets = {}
  if args.resident_gb is not None:
    budgets["resident_budget_bytes"] = int(args.resident_gb * GIB)
  if args.staging_gb is not None:
    budgets["staging_budget_bytes"] = int(args.staging_gb * GIB)
  return budgets


def _step_memory(args: argparse.Namespace, model: _Model, params, clip: float, flush: str) -> jax_dos.StepMemory:
  """What the compiled gradient step needs (``train.gradients.gradient_step_memory``) on a step's rows."""
  from train import gradients

  shape = (args.batch * args.grad_accum, args.seq_len)
  return gradients.gradient_step_memory(model.graphdef, params, shape, clip, flush, args.grad_accum)


def _gradient_function(args: argparse.Namespace, model: _Model, tx, params, flush: str) -> Callable:
  """train.gpt's gradient step, flushed by ``flush`` or accumulated: ``(params, batch) -> (loss, grads, scale)``."""
  from train import gradients

  grad_step = gradients.make_grad_step(tx, params, flush, args.grad_accum)
  return lambda params, batch: grad_step(model.graphdef, params, batch, args.clip)[:3]


def _idiom_step(args: argparse.Namespace, model: _Model) -> tuple[Any, Callable, Callable]:
  """The JAX idiom: the whole step in one jit, the state streamed from ``pinned_host`` (``plan="stream"``, traced).
  Returns ``(tx, fb, step_fn)``: the optimizer, forward/backward alone, ``(params, state, batch) -> (params, state,
  loss)``."""
  if args.grad_accum > 1:
    raise SystemExit("the idiom runs the whole step in one jit: --grad-accum is not implemented for it")
  tx = jax_dos.interleaved_adam(LR, **_adamw_hyper(), plan="stream", moments=args.moments)

  def loss_and_grads(params, batch):  # raw gradients and the factor of a global-norm clip at 1.0 (grad_scale)
    loss, grads = jax.value_and_grad(model.arch.loss, argnums=1)(model.graphdef, params, batch)
    return loss, grads, jax_dos.clip_scale(optax.global_norm(grads), args.clip)

  def step(params, state, batch):
    loss, grads, scale = loss_and_grads(params, batch)
    updates, state = tx.update(grads, state, params, grad_scale=scale)
    return optax.apply_updates(params, updates), state, loss

  donate = jax.default_backend() != "cpu"  # jax 0.10's CPU client aborts when donating pinned_host buffers
  return tx, jax.jit(loss_and_grads), jax.jit(step, donate_argnums=(0, 1) if donate else ())


def _optax_step(args: argparse.Namespace, model: _Model, params) -> tuple[Any, Callable, Callable]:
  """``optax.adamw`` with everything on the GPU, after train.gpt's gradient step. Returns ``(tx, fb, step_fn)`` as
  ``_idiom_step``."""
  tx = optax.adamw(LR, **_adamw_hyper())
  fb = _gradient_function(args, model, None, params, "none")
  update = jax.jit(lambda g, s, p, scale: tx.update(jax.tree.map(lambda x: x * scale, g), s, p), donate_argnums=1)
  apply = jax.jit(optax.apply_updates, donate_argnums=0)

  def step_fn(params, state, batch):
    loss, grads, scale = fb(params, batch)
    updates, state = update(grads, state, params, scale)
    return apply(params, updates), state, loss

  return tx, fb, step_fn


def _planned_step(args: argparse.Namespace, model: _Model, params, out: dict) -> tuple[Any, Callable, Callable]:
  """The ``PLANNED`` variants: ``jax_dos.interleaved_adam`` on every subgroup's host kernel (``host``,
  ``hostdelay``) or the planner's plan, with the variant's delay, after train.gpt's gradient step (``--grad-flush``).
  Budgets come from ``--resident-gb``, ``--staging-gb`` and, for the planner, what the compiled gradient step needs
  (recorded in ``out["step_memory"]``). Returns ``(tx, fb, step_fn)`` as ``_idiom_step``."""
  budgets = _budgets(args)
  plan = "host" if args.variant in ("host", "hostdelay") else "auto"
  if plan == "auto" and len(budgets) < 2 and jax.devices()[0].memory_stats():
    # Budgets from what the compiled gradient step needs (train.gradients.gradient_step_memory: the flush's own
    # program where it does not depend on the plan).
    need = _step_memory(args, model, params, args.clip, args.grad_flush)
    budgets["step_memory"] = need
    out["step_memory"] = {"peak_bytes": need.peak_bytes, "live_bytes": need.live_bytes}
  delay = dict(delay=1, delay_warmup=1) if args.variant in ("delay", "predict", "ahead", "hostdelay") else {}
  if args.variant in ("predict", "ahead"):
    delay["delay_predict"] = "moments" if args.variant == "predict" else "gradient"
  if args.variant == "writebehind":
    delay["write_behind"] = True
  planner = jax_dos.auto_planner(**budgets, params_in_place=True, ahead_copies=args.variant == "ahead")
  tx = jax_dos.interleaved_adam(LR, **_adamw_hyper(), plan=plan, planner=planner, moments=args.moments, **delay)
  fb = _gradient_function(args, model, tx, params, args.grad_flush)

  def step_fn(params, state, batch):
    loss, grads, scale = fb(params, batch)
    params, state = jax_dos.update_params(tx, grads, state, params, grad_scale=scale)  # no fp32 update tree
    return params, state, loss

  return tx, fb, step_fn


def _fb_times(args: argparse.Namespace, forward_backward: Callable, batches: list) -> list[float]:
  """``--fb-reps`` timed calls of ``forward_backward(batch)`` (it returns what to wait for), after an untimed one: the
  first call may compile (the idiom's fb is a program of its own; the overlapped step's first micro-batch has no
  running sums)."""
  times = []
  for i in range(args.fb_reps + 1):
    t = time.perf_counter()
    jax.block_until_ready(forward_backward(batches[i % 2]))
    times.append(time.perf_counter() - t)
  return times[1:]


def _time_steps(args: argparse.Namespace, step_fn: Callable, fb: Callable, params, state, batches: list):
  """``--warmup`` untimed steps, forward/backward alone, ``--steps`` timed steps (each waited for; the host's updates
  at the end). Returns the ``_Timed`` and the last parameters."""
  t0 = time.perf_counter()
  losses = []
  for i in range(args.warmup):
    params, state, loss = step_fn(params, state, batches[i % 2])
    losses.append(float(loss))
  jax.block_until_ready(params)
  warmup_s = time.perf_counter() - t0

  fb_times = _fb_times(args, lambda batch: fb(params, batch), batches)

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
  return _Timed(warmup_s, fb_times, step_times, total, statistics.median(step_times), losses), params


def _speed_fields(args: argparse.Namespace, model: _Model, num_params: int, timed: _Timed) -> dict:
  """The result's speed fields: the driver's MFU is ``flops_per_token * tokens_per_s`` over the peak, the exposed
  update what a step takes beyond forward/backward alone."""
  tokens_per_step = args.batch * args.grad_accum * args.seq_len
  fb_s = statistics.median(timed.fb_times)
  return dict(
    num_params=num_params,
    flops_per_token=model.arch.flops_per_token(model.cfg, args.seq_len),
    tokens_per_step=tokens_per_step,
    step_s=timed.step_s,
    step_times_s=timed.step_times,
    steps_total_s=timed.total,
    tokens_per_s=tokens_per_step / timed.step_s,
    fb_s=fb_s,
    fb_times_s=timed.fb_times,
    exposed_update_s=max(0.0, timed.step_s - fb_s),
    exposed_fraction=max(0.0, timed.step_s - fb_s) / timed.step_s,
    losses=timed.losses,
  )


def run_variant(args: argparse.Namespace) -> dict:
  """``args.variant`` in this process: its settings before jax starts, the model, the variant's step, its timing.
  Returns the result's fields (the ``OVERLAPPED`` variants: ``run_overlapped``'s)."""
  env = _prepare_process(args)
  out = {"variant": args.variant, "env": env, "device": str(jax.devices()[0].device_kind), "jax": jax.__version__}
  if args.variant == "peak":
    return {**out, **_peak(jax, jnp)}
  model, params = _build_model(args)
  t0 = time.perf_counter()
  if args.variant in OVERLAPPED:
    return {**out, **run_overlapped(args, model, params)}
  if args.variant == "idiom":
    tx, fb, step_fn = _idiom_step(args, model)
  elif args.variant == "none":
    tx, fb, step_fn = _optax_step(args, model, params)
  else:
    tx, fb, step_fn = _planned_step(args, model, params, out)
  state = tx.init(params)
  if args.variant in PLANNED:
    p = jax_dos.get_plan(tx, params)
    out["plan"] = str(p)
    out["plan_predicted_s"] = p.predicted
    out["plan_elements"] = {k: p.elements(k) for k in ("device", "stream", "host")}
  out["init_s"] = time.perf_counter() - t0

  timed, params = _time_steps(args, step_fn, fb, params, state, model.batches)
  out["warmup_s"] = timed.warmup_s
  out.update(**_speed_fields(args, model, model.arch.tree_size(params), timed), **_memory(jax))
  return out


def _measure_stages(args: argparse.Namespace, stages: list, groups: list, batches: list) -> tuple[Any, dict]:
  """The stages' timeline measured on one micro-batch (train.gpt ``--overlap auto``'s way; with ``--remat auto``
  under each planned policy). Returns the times and the result's ``stage_times``."""
  t1 = time.perf_counter()
  micro = tuple(x[: args.batch] for x in batches[0])
  policies = jax_dos.PLANNED_REMAT_POLICIES if args.remat == "auto" else ()
  times = jax_dos.StagedModel(stages, len(groups)).measure_times(groups, micro, policies)
  _mark("stages measured")
  return times, {"forward_s": times.forward, "backward_s": times.backward,
                 "boundary_bytes": times.boundary_bytes, "measure_s": time.perf_counter() - t1,
                 "remat": {p: dataclasses.asdict(c) for p, c in times.remat.items()}}  # fmt: skip


def _overlapped_step(
  args: argparse.Namespace, model: _Model, params, tx, clip: float, out: dict
) -> jax_dos.OverlappedStep:
  """``jax_dos.OverlappedStep`` on the model's stages (``arch.staged``) with the ``--overlap-*`` flags and the host
  budget ``--host-gb`` gives, placed by the measured timeline with ``--timeline`` (``out["stage_times"]``)."""
  staged = model.arch.staged(model.cfg)
  groups = staged.split(params)
  stages = list(staged.stages)
  if args.remat not in ("auto", "full"):  # train.gpt's stages under a fixed --remat: every stage but the head
    stages = [dataclasses.replace(st, remat=args.remat) for st in stages[:-1]] + stages[-1:]
  times = None
  if args.timeline:  # train.gpt --overlap auto's way: place subgroups by the measured stages' timeline
    times, out["stage_times"] = _measure_stages(args, stages, groups, model.batches)
  step_kw = {"micro_batch_order": "batch" if args.variant == "overlapbatch" else args.overlap_order}
  if args.overlap_run_ahead is not None:
    step_kw["run_ahead_stages"] = args.overlap_run_ahead
  if args.overlap_stream_slots is not None:
    step_kw["stream_slots"] = args.overlap_stream_slots
  if args.overlap_rebalance:
    step_kw["rebalance"] = True
  if args.host_gb is not None:
    step_kw["host_budget_bytes"] = int(args.host_gb * GIB) - POOL_MARGIN_BYTES
  step_kw["pinned_memory"] = args.overlap_pinned
  # No tx.init: the step allocates a fresh state once, in its own placements (the plain plan's would be moved).
  return jax_dos.OverlappedStep(tx, stages, groups, None, clip_norm=clip, micro_batches=args.grad_accum,
                                stage_times=times, **step_kw)  # fmt: skip


def _overlap_plan_fields(step: jax_dos.OverlappedStep) -> dict:
  """The result's fields of the overlapped step's plan: its run-ahead, order, host memory, placement and remat."""
  return {
    "run_ahead_stages": step.run_ahead_stages,
    "micro_batch_order": step.micro_batch_order,
    "stream_speculation": step.stream_speculation,
    "host_budget_bytes": step.host_budget_bytes,
    "host_bytes_planned": step.host_bytes(),
    "host_resident_estimate_bytes": step.resident_estimate(),
    "pinned_memory": "arena" if step.arena is not None else "pool",
    "arena_mapped_bytes": step.arena.mapped_bytes if step.arena is not None else 0,
    "plan": str(step.plan),
    "remat": list(step.plan.remat) if step.plan.remat is not None else [st.remat for st in step.model.stages],
    "plan_predicted": dict(step.plan.predicted),
    "plan_elements": {k: step.plan.elements(k) for k in ("device", "stream", "host")},
  }


def _time_overlapped(
  args: argparse.Namespace, step: jax_dos.OverlappedStep, batches: list
) -> tuple[_Timed, list, list]:
  """``--warmup`` untimed steps, forward/backward alone (the same stage programs with no optimizer, in the step's
  order), ``--steps`` timed steps traced (``jax_dos.trace``). A call returns before its update is done, so a step is
  the whole run's time over ``--steps``. Returns the ``_Timed``, every step's gradient norm and the trace's spans."""
  losses, norms = [], []
  t0 = time.perf_counter()
  for i in range(args.warmup):
    losses.append(float(step(batches[i % 2])))
    norms.append(float(step.grad_norm))
  step.settle()
  warmup_s = time.perf_counter() - t0
  _mark(f"overlap: {args.warmup} warm-up steps in {warmup_s:.0f} s")

  def forward_backward(batch):
    return step.model.loss_and_grads(step.params, batch, args.grad_accum, step.micro_batch_order)[1]  # the sums

  fb_times = _fb_times(args, forward_backward, batches)

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
  losses += [float(x) for x in timed_losses]
  norms += [float(x) for x in timed_norms]
  return _Timed(warmup_s, fb_times, step_times, total, total / args.steps, losses), norms, spans


def run_overlapped(args: argparse.Namespace, model: _Model, params) -> dict:
  """The ``overlap`` variants: ``jax_dos.OverlappedStep`` on the model's stages (``arch.staged``), timed step by step.

  Forward/backward alone is the same stage programs with no optimizer, in the
  step's order (``StagedModel.loss_and_grads``, sums in place), so
  the exposed update is what the optimizer adds to the step's own computation.
  """
  clip = 1e-6 if args.variant == "overlapfire" else args.clip
  out = {"clip": clip}
  budgets = _budgets(args)
  if len(budgets) < 2 and jax.devices()[0].memory_stats():
    need = _step_memory(args, model, params, clip, "none")
    _mark("the gradient step's memory measured (compiled)")
    budgets["step_memory"] = need
    out["step_memory"] = {"peak_bytes": need.peak_bytes, "live_bytes": need.live_bytes}
  t0 = time.perf_counter()
  planner = jax_dos.auto_planner(**budgets, params_in_place=True)
  tx = jax_dos.interleaved_adam(LR, **_adamw_hyper(), planner=planner, moments=args.moments)
  step = _overlapped_step(args, model, params, tx, clip, out)
  out.update(_overlap_plan_fields(step))
  out["init_s"] = time.perf_counter() - t0
  _mark(f"overlap: planned and initialised in {out['init_s']:.0f} s")

  timed, norms, spans = _time_overlapped(args, step, model.batches)
  out["warmup_s"] = timed.warmup_s
  out["plan_after"] = str(step.plan)  # rebalancing may have moved subgroups
  if step.arena is not None:  # what the step's own pinned memory mapped and held at most, after the timed steps
    out["arena_mapped_bytes_end"], out["arena_peak_bytes"] = step.arena.mapped_bytes, step.arena.peak_bytes
  num_params = sum(x.size for x in jax.tree.leaves(step.params))
  out.update(
    **_speed_fields(args, model, num_params, timed),
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
