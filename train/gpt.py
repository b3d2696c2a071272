"""Train a GPT or a Llama-style model with AdamW whose state lives in host memory (``python -m train.gpt``).

    python -m train.gpt                                   # tiny preset on Python's own sources, a few minutes on a CPU
    python -m train.gpt --arch llama                      # the Llama-style model (models/llama.py), same flags
    python -m train.gpt --preset gpt2-124m --batch 8 --steps 2000 --offload auto --plot
    python -m train.gpt --resume                          # continue from <out>/ckpt

One step, nanoGPT style, with the optimizer update outside ``jit`` so that
``jax_dos.interleaved_adam`` runs its pipelined host/stream/device engine::

    loss, grads, scale = grad_step(graphdef, params, batch, clip)  # jitted: value_and_grad, flush to host
    params, opt_state = jax_dos.update_params(tx, grads, opt_state, params, grad_scale=scale)  # eager AdamW

``jax_dos.update_params`` is ``tx.update`` and ``optax.apply_updates`` in one,
with no float32 update tree: the 4 bytes a parameter it saves go to resident
optimizer state (the planner is told so).

The flags are ``train/flags.py``'s, the optimizer ``train/optimizer.py``'s,
the validation ``train/evaluate.py``'s. The gradient step
(``train/gradients.py``) puts the gradients of host-updated subgroups in
host memory inside its own program
(``jax_dos.gradient_shardings``, ``--grad-flush``), and leaves the global-norm
clip to the optimizer as the factor ``scale``. ``--grad-accum k`` makes a step
of ``k`` micro-batches of ``--batch`` sequences, their gradients summed in
place on the accelerator: a 6.7B model's step then grows without more
activation memory, and the update's cost is shared by more tokens.
``--delay 1`` updates host subgroups one step late (their kernel then runs
during the next step's forward/backward; see ``jax_dos.interleaved_adam``).

``--offload none`` is the baseline: ``optax.adamw`` with float32 parameters and
state on the accelerator (its update jitted, state donated). The other modes
use ``jax_dos.interleaved_adam(plan=<mode>)``: float32 master weights and
moments in host memory, parameters in ``--param-dtype`` (bfloat16 by default)
on the accelerator.

Every device of the job trains, data-parallel, by default (``train/parallel.py``): one process drives all of its
host's GPUs (``--devices K`` for fewer), ``--batch`` rows a device; ``--mesh data=D,fsdp=F`` lays them out
otherwise. Several processes (hosts, SLURM) join through ``jax.distributed`` from the environment, each reading its
rows of every batch; process 0 prints and logs. README.md, "Several GPUs", has the launch commands.

Batches depend only on ``(seed, step)`` (``train/data.py``), so a checkpoint
(parameters, optimizer state, step) resumes bit-exactly: ``N + N`` steps with
``--resume`` end with the same parameters as ``2N`` steps in one go (a resumed run
keeps its checkpoint's learning-rate schedule: give the first ``--decay-steps 2N``).

Outputs in ``--out`` (default ``runs/<preset>``): ``metrics.jsonl`` (one JSON
object per logged step: step, loss, val_loss, lr, tokens_per_s, mfu, time),
``ckpt/`` (Orbax, through ``jax_dos.checkpoint``; steps that fail verification
are moved to ``ckpt/damaged/``, see ``docs/checkpoints.md``) and with ``--plot`` ``loss.png``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_dos
from models import hf
from train import (
  calibration,
  checkpoints,
  device_memory,
  host_memory,
  parallel,
  profiling,
  progress,
  step_log,
  steps,
  stopping,
)
from train import data as data_lib
from train import overlapped as overlapped_lib
from train.evaluate import validation_loss
from train.flags import Flags, TrainConfig, model_config, model_module, model_name, parse_args
from train.gradients import check_split_flush, gradient_step_memory, make_grad_step
from train.job import primary, say, warn
from train.optimizer import make_optimizer
from train.tokenizer import Tokenizer

# Optimizer state offloaded to the host frees GPU memory for activations: take 94% of it, not jax's default 75% (a
# 6.7B model on an 80 GB H100 ran out of memory at 75%). Set by main(), before jax first uses the GPU (which reads it
# then); importing this module changes nothing. A user's value wins.
GPU_MEMORY_FRACTION = "0.94"
# CUDA's stream-ordered allocator for the GPU's memory, not jax's default BFC allocator, whose table of 1/32 of the
# pool (2.3 GiB at 0.94 of an 80 GB H100) stays in host RAM beside the offloaded state. Set by main() likewise.
GPU_ALLOCATOR = "cuda_async"


# ----------------------------------------------------------------------------- training


SLOW_SETUP_S = 5.0  # a setup phase that takes this long says so as it ends (a 6.7B model's take minutes on a GPU)


@contextlib.contextmanager
def _setup_phase(args: TrainConfig, what: str):
  """Says ``setup   <what> (N s)`` when the phase took at least ``SLOW_SETUP_S``: on a GPU, a large model's
  compilations, measurements and allocations come before its first step, and the user sees where the time goes."""
  t = time.perf_counter()
  yield
  elapsed = time.perf_counter() - t
  if elapsed >= SLOW_SETUP_S:
    say(args, f"setup   {what} ({elapsed:.0f} s)")


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
  """Runs training on ``argv``, parsed once (``train.flags.parse_args``, setting what must be set before jax starts a
  backend on the way). Returns a dict of results when given ``argv`` (tests, notebooks); ``None`` from the command line.

  Result keys: ``step`` (final), ``start_step``, ``losses`` and ``val_losses``
  (``{step: loss}`` of this invocation), ``tokens_per_s``, ``mfu`` (or
  ``None``), ``num_params``, ``plan`` (text or ``None``), ``out``, ``params``.
  """
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", GPU_MEMORY_FRACTION)  # parse_args starts jax's backend
  os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", GPU_ALLOCATOR)
  joined = []  # whether this process joined a job of several processes, once before_backend has run

  def before_backend(flags: Flags) -> None:  # from argv's one parse, before jax starts a backend
    overlapped_lib.allow_overlap_on_gpu(flags)  # before jax starts its GPU client
    host_memory.cap_host_memory(flags)  # XLA's pinned pool, from the run's most need
    parallel.select_devices(flags.devices)  # --devices K: this process's first K devices
    calibration.measure_apart(flags)  # before this process starts its GPU client; one process a host measures
    joined.append(parallel.join_from_environment())  # a job of several processes (jax.distributed)

  try:
    results = train(parse_args(argv, before_backend))
  finally:
    if any(joined):
      jax.distributed.shutdown()  # every process leaves the job together: no process logs another's exit as an error
  return results if argv is not None else None


def cli() -> None:
  """Console entry point (exit status 0 on success)."""
  main(None)


@dataclasses.dataclass
class _Built:
  """The training step :func:`_build_step` chose, its learning-rate schedule, the step it starts at, the run's config
  from then on (a resumed run's keeps its checkpoint's schedule), and what to tell the user about it."""

  step: Any
  schedule: Any
  start_step: int
  args: TrainConfig
  notes: list[str]


def _load_data(args: TrainConfig) -> tuple[data_lib.Splits, int, str]:
  """``(splits, vocab_size, description)`` of ``--data``, each problem an error that says what to change; with
  ``--packing rows``, each split a ``data_lib.Packed`` of its rows (the last tenth of them the validation split)."""
  tokenizer = None
  if args.tokenizer is not None:
    try:
      tokenizer = Tokenizer(args.tokenizer)
    except (FileNotFoundError, ValueError) as e:
      raise SystemExit(f"error: --tokenizer: {e}") from None
  rows = None
  try:
    if args.packing == "rows":
      rows, data_vocab, data_desc = data_lib.load_rows(args.data, tokenizer)
      tokens = rows.tokens
    else:
      tokens, data_vocab, data_desc = data_lib.load_tokens(args.data, tokenizer=tokenizer)
  except (FileNotFoundError, ValueError) as e:
    raise SystemExit(f"error: --data: {e}") from None
  by_data = data_vocab if tokenizer is not None else 50304 if data_vocab > 256 else 256
  if args.init_from is not None:
    vocab = model_config(args).vocab_size
    if data_vocab > vocab:
      raise SystemExit(
        f"error: --tokenizer {args.tokenizer}: its vocabulary has {data_vocab:,} tokens, more than the {vocab:,} of"
        f" {args.init_from}'s model; give the checkpoint's own tokenizer."
      )
  else:
    vocab = args.vocab_size or model_module(args).PRESETS[args.preset].get("vocab_size") or by_data
  largest = int(np.max(tokens)) if len(tokens) else 0
  if len(tokens) and np.issubdtype(tokens.dtype, np.signedinteger):  # a prompt's token t is stored as -1 - t
    largest = max(largest, -1 - int(np.min(tokens)))
  if data_vocab > 256 and largest >= vocab:
    raise SystemExit(f"error: {args.data} holds token ids up to {largest}; pass --vocab-size above that.")
  if vocab < 256 and data_vocab == 256:
    raise SystemExit(f"error: byte-level data needs --vocab-size >= 256, got {vocab}.")
  try:
    if rows is not None:
      train_rows, val_rows = data_lib.split_rows(rows)
      splits = data_lib.Splits(data_lib.pack(train_rows, args.seq_len), data_lib.pack(val_rows, args.seq_len))
    else:
      splits = data_lib.split(tokens)
      data_lib.check_splits(splits, args.seq_len)
  except ValueError as e:
    raise SystemExit(f"error: --data: {e}") from None
  return splits, vocab, data_desc


def _data_line(desc: str, splits: data_lib.Splits) -> str:
  """The run's ``data`` line: the source, and what each split holds."""
  if isinstance(splits.train, data_lib.Packed):
    return f"data    {desc}: train {splits.train.describe()} / val {splits.val.describe()}"
  return f"data    {desc}: train {len(splits.train):,} / val {len(splits.val):,} tokens"


def hf_source(args: Flags) -> dict[str, Any]:
  """What each checkpoint's meta keeps of ``--init-from``'s folder, for ``train.export`` to write back: its
  ``config.json`` (``hf_config``: the family, the token ids, the dtype) and ``generation_config.json``
  (``hf_generation_config``, where there is one). Empty without ``--init-from``."""
  if args.init_from is None:
    return {}
  out = {"hf_config": hf.read_config(args.init_from)}
  generation = os.path.join(args.init_from, hf.GENERATION)
  if os.path.exists(generation):
    with open(generation) as f:
      out["hf_generation_config"] = json.load(f)
  return out


def _init_params(args: TrainConfig, cfg: Any, shardings: Any) -> tuple[Any, dict]:
  """``(graphdef, params)``: the model's random initialisation (``--seed``), or ``--init-from``'s weights, each
  tensor read into its sharding (``models.hf``)."""
  arch = model_module(args)
  if args.init_from is None:
    return arch.init_params(cfg, seed=args.seed, shardings=shardings)
  try:
    return arch.graphdef(cfg), hf.load_params(args.init_from, cfg, shardings)
  except hf.CheckpointError as e:
    raise SystemExit(f"error: --init-from: {e}") from None


def _build_step(args, cfg, graphdef, params, first_batch, batch_layout, restore_from) -> _Built:
  """The plain or the overlapped training step, chosen from both plans before any optimizer state exists.

  The plain plan (``jax_dos.get_plan``) and the overlapped one
  (``jax_dos.overlapped_plan``, by the measured stages' timeline with
  ``--offload auto`` on an accelerator) are both made from the parameters'
  shapes; ``train.steps.choose`` takes one, and only that step's state is
  allocated, once, or restored from ``restore_from`` (a checkpoint manager)
  straight into its placements. ``params`` are consumed.
  """
  step_shape = (args.global_batch * args.grad_accum, args.seq_len)  # one step's batch: --grad-accum micro-batches
  step_memory = None
  sized = jax.local_devices()[0].memory_stats() is not None  # not on the CPU backend, where "auto" offloads everything
  in_ram = not sized and jax.local_devices()[0].platform == "cpu"  # the RAM holds it all; the kernel ends an overrun
  if (args.offload == "auto" and None in (args.resident_gb, args.staging_gb) and sized) or in_ram:
    with _setup_phase(args, "the gradient step compiled, for its memory"):
      measured = gradient_step_memory(graphdef, params, step_shape, args.clip, args.grad_flush, args.grad_accum,
                                      batch_sharding=batch_layout, parts=len(first_batch))  # fmt: skip
    if in_ram:
      device_memory.check_ram(args, cfg, getattr(batch_layout, "mesh", None), measured.peak_bytes,
                              step_shape[0] // args.grad_accum)  # fmt: skip
    else:
      step_memory = measured
  notes, (tx, schedule) = [], make_optimizer(args, step_memory)
  if step_memory is not None:
    peak, live = step_memory.peak_bytes / 2**30, step_memory.live_bytes / 2**30
    notes.append(f"memory  the gradient step needs {peak:.1f} GiB at its peak, {live:.1f} GiB through the update (left"
                 f" free); {device_memory.free_when_planned()}")  # fmt: skip
  plain_refused = None if step_memory is None else device_memory.plain_step_refusal(step_memory)  # its GPU memory
  try:
    plain_plan = None if args.offload == "none" else jax_dos.get_plan(tx, params)  # from shapes: no state exists yet
  except MemoryError as e:  # the plain step's state cannot be held here: the overlapped step's may
    plain_plan, plain_refused = None, plain_refused or str(e)
  refusal = overlapped_lib.refusal(args)
  if refusal is None and args.overlap == "auto" and jax.default_backend() != "gpu":
    refusal = "--overlap auto takes the overlapped step on a GPU only (--overlap on takes it here)"
  overlap_plan = times = staged = collectives = norm = None
  if refusal is None and args.overlap != "off":
    staged = model_module(args).staged(cfg, rows=len(first_batch) > 2)  # the model's own modules as stages
    if args.offload == "auto" and sized:
      rows = first_batch[0].shape[0] // args.grad_accum
      part = tuple(x[:rows] for x in first_batch)  # one micro-batch, laid out as the step lays it out
      if batch_layout is not None:
        part = parallel.global_batch(lambda mine: tuple(x[mine] for x in part), batch_layout, rows)
      measured = "the stages measured" + (", each under its remat choices" if args.remat == "auto" else "")
      with _setup_phase(args, measured):
        times = overlapped_lib.stage_times(staged, params, part, args.remat)
      if times.gather_ahead is not None:  # the weights sharded: both ways timed, the faster taken
        own, ahead = times.gather_ahead_s
        how = "gathered one stage ahead" if times.gather_ahead else "gathered by each program itself"
        notes.append(f"gather  the sharded weights {how} in the overlapped step's backward pass (a block's"
                     f" backward program: {1e3 * own:.2f} ms gathering its own, {1e3 * ahead:.2f} ms gathering"
                     f" ahead)")  # fmt: skip
      if args.clip > 0 and restore_from is None:  # what the clip first meets: the plan is made for it
        with _setup_phase(args, "the first batch's gradient norm measured"):
          norm = overlapped_lib.first_norm(staged, params, part, args.remat, lambda line: say(args, line))
      if batch_layout is not None and batch_layout.mesh.devices.size > 1:
        with _setup_phase(args, "the devices' link measured"):
          collectives = jax_dos.mesh_collectives(batch_layout.mesh)
        notes.append(f"link    {collectives.link / 1e9:.0f} GB/s a device (an all-gather's bus bandwidth) over"
                     f" {collectives.ranks} devices, {collectives.ranks_per_host} a host")  # fmt: skip
  fired = steps.fired_share(args.clip, progress.metrics_rows(args.out) if restore_from is not None else None, norm)
  if refusal is None and args.overlap != "off":
    overlap_plan = overlapped_lib.plan(args, tx, staged, params, times, collectives, fired[0])
  plain_collectives_s = 0.0
  if collectives is not None:
    plain_collectives_s = collectives.plain_step_s(model_module(args).tree_size(params), args.grad_accum)
  overlapped, line = steps.choose(args.overlap, plain_plan, overlap_plan, refusal if args.overlap != "off" else None,
                                  fired, plain_collectives_s, plain_refused)  # fmt: skip
  # Every process of a job takes one step: each chose from its own measured plans, so any one's "plain" holds.
  plain_elsewhere = jax_dos.agreed_refusal(None if overlapped else line) is not None
  if overlapped and plain_elsewhere:
    if plain_refused is not None:
      raise SystemExit(f"error: {plain_refused} Another process of the job chose the plain step from its own plans.")
    overlapped, line = False, "step    plain: another process of the job chose the plain step from its own plans"
  notes.append(line)
  if not overlapped and overlap_plan is not None and overlap_plan.placements:  # what the choice turned down
    held = {p: overlap_plan.elements(p) for p in jax_dos.PLACEMENTS}
    total = sum(held.values()) or 1
    shares = ", ".join(f"{p} {100 * n / total:.1f}%" for p, n in held.items() if n)
    notes.append(f"step    the overlapped plan not taken: {shares}")
  if overlapped:
    start_step, opt_state = 0, None
    if restore_from is not None:
      template = overlapped_lib.abstract_state(staged, overlap_plan, params, args.moments)  # into its placements
      params, opt_state, start_step, args = checkpoints.restore(restore_from, cfg, params, template, args)
      schedule.follow(args)
    try:
      with _setup_phase(args, "the overlapped step built: its state allocated in its placements"):
        step = overlapped_lib.OverlappedTraining(args, tx, staged, params, overlap_plan, opt_state, times)
      per = step.host_bytes() / max(1, model_module(args).param_count(cfg))
      host = f"host    the step's pinned host memory: {step.host_bytes() / 2**30:.2f} GiB at most ({per:.1f} B a"
      host += " parameter)"
      if jax.default_backend() == "gpu":  # XLA's pinned pool and its allocators' tables: what the process holds
        host += f"; the process's resident set: about {step.resident_estimate() / 2**30:.1f} GiB"
      return _Built(step, schedule, start_step, args, [*notes, host, str(step.plan)])
    except MemoryError as e:
      if args.overlap == "on":
        raise SystemExit(f"--overlap on: {e}") from None
      if plain_refused is not None:  # neither step's state fits here
        raise SystemExit(f"error: {plain_refused} The overlapped step's does not either: {e}") from None
      notes.append(f"step    plain after all: {str(e).splitlines()[0]}")
  grad_step = make_grad_step(None if args.offload == "none" else tx, params, args.grad_flush, args.grad_accum)
  if step_memory is not None and args.grad_flush == "host":  # the split's own program, now that the plan exists
    batch = (jax.ShapeDtypeStruct(step_shape, jnp.int32, sharding=batch_layout),) * len(first_batch)
    check_split_flush(grad_step.lower(graphdef, params, batch, args.clip).compile(), step_memory)
  with _setup_phase(args, "the optimizer state allocated in the plain step's placements"):
    opt_state, start_step = tx.init(params), 0  # (its checks: a plan the host cannot hold is refused here)
  if restore_from is not None:
    # Restored into the state's shapes and placements, the state itself freed first: the host holds it once.
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), opt_state)
    del opt_state
    params, opt_state, start_step, args = checkpoints.restore(restore_from, cfg, params, template, args)
    schedule.follow(args)
  if plain_plan is not None:
    notes.append(str(plain_plan))
  return _Built(steps.PlainStep(args, tx, graphdef, grad_step, params, opt_state, plain_plan), schedule, start_step,
                args, notes)  # fmt: skip


def _finish(args, log, record, val_losses, step_no, start_step, rate, num_params, plan, params) -> dict[str, Any]:
  """The run's last lines (plot, clip summary, final losses) and :func:`main`'s results."""
  if args.plot and primary():
    png = os.path.join(args.out, "loss.png")
    progress.plot_losses(progress.read_metrics(log.path), png, title=f"{model_name(args)}, offload {args.offload}")
    say(args, f"wrote {png}")
  clip_line = record.summary()
  if clip_line:
    say(args, clip_line)
  losses = record.losses
  final = losses[max(losses)] if losses else None
  if final is not None:
    say(args, f"done: step {step_no}, train loss {final:.4f}, val loss {val_losses.get(step_no, math.nan):.4f}")
  return {
    "step": step_no,
    "start_step": start_step,
    "losses": losses,
    "val_losses": val_losses,
    "grad_norms": record.grad_norms,
    "clip_fired": record.fired,
    "tokens_per_s": rate.tokens_per_s,
    "mfu": rate.mfu,
    "num_params": num_params,
    "plan": None if plan is None else str(plan),
    "out": args.out,
    "params": params,
  }


def plain_remat(remat: str) -> str:
  """The plain step's block policy for ``--remat``: ``auto`` is ``full`` on an accelerator that reports its memory
  (its activations may not fit) and ``none`` elsewhere (the CPU: nothing to save); the overlapped step's plan
  chooses its own per block (``train.overlapped.stage_times``)."""
  if remat != "auto":
    return remat
  return "full" if jax.local_devices()[0].memory_stats() is not None else "none"


def _say_written(args: TrainConfig, written: dict[str, float] | None, clock: stopping.SaveClock) -> None:
  """The line on a save written beside the training once it is on disk: what it cost the steps beside it, and when
  the next save by time comes."""
  if written is None:
    return
  base, per = written["base"], written["per_step"]
  share = f" ({100 * per / base:.0f} % of a step's {1e3 * base:.1f} ms)" if base > 0 else ""
  gap = clock.gap_s
  when = "" if gap is None else f"{gap:.0f} s" if gap < 120 else f"{gap / 60:.1f} min"
  nxt = f"; the next by time {when} after its start" if when else ""
  say(args, f"checkpoint written beside {written['steps']} steps in {written['seconds']:.1f} s: each step"
            f" {1e3 * per:.1f} ms slower{share}, {written['cost']:.2f} s of training in all{nxt}")  # fmt: skip


def _close_quietly(step: Any, timeout_s: float = 60.0) -> None:
  """Settles and closes ``step`` after a failure, its errors dropped (they were reported), in at most
  ``timeout_s``: no worker thread of it is left running native code while Python exits."""
  import threading

  def close() -> None:
    try:
      step.close()
    except BaseException:  # noqa: BLE001
      pass

  closer = threading.Thread(target=close, name="train.gpt-close", daemon=True)
  closer.start()
  closer.join(timeout_s)


def _failure_text(error: BaseException) -> str:
  """One line naming a failure: the innermost error of its chain (a worker's, under the step's own), its type,
  message and where it was raised."""
  chain = [error]
  while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
    chain.append(chain[-1].__cause__ or chain[-1].__context__)
  root = chain[-1]
  first = lambda e: (str(e).strip().splitlines() or [""])[0][:300]  # noqa: E731
  text = f"{type(root).__name__}: {first(root)}" if first(root) else type(root).__name__
  frames = traceback.extract_tb(root.__traceback__)
  if frames:
    text += f" (in {frames[-1].name}, {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
  if root is not error and first(error):
    text += f"; {first(error)}"
  return text


def _failed(args: TrainConfig, manager, step: Any, step_no: int, error: BaseException) -> None:
  """Ends the run after step ``step_no`` failed (a worker thread's error, the accelerator out of memory): one line
  naming it, the step's threads settled, a save in flight finished, every checkpoint kept (``SystemExit``)."""
  _close_quietly(step)
  checkpoints.stop_non_finite(args, manager, f"step {step_no} failed: {_failure_text(error)}",
                              advice="--resume continues from it")  # fmt: skip


def _stop(args: TrainConfig, manager, step: Any, step_no: int, signum: int, no_room: str | None,
          t_save: float | None) -> None:  # fmt: skip
  """Ends the run stopped by ``signum`` at step ``step_no``, its save (begun at ``t_save``) on disk: the step's
  threads settled and one line, exit status ``128 + signum`` (``SystemExit``)."""
  name = stopping.signal_name(signum)
  step.close()
  if manager is not None:
    manager.wait_until_finished()
    manager.close()
  if t_save is not None and manager is not None and step_no in manager.complete_steps():
    where = os.path.join(args.out, "ckpt", str(step_no))
    warn(f"stopped by {name} at step {step_no}: saved {where} in {time.perf_counter() - t_save:.1f} s; --resume"
         " continues")  # fmt: skip
  else:
    why = "--no-ckpt" if no_room is None else "no room on the disk"
    warn(f"stopped by {name} at step {step_no}: nothing saved ({why})")
  raise SystemExit(128 + signum)


def train(args: TrainConfig) -> dict[str, Any]:
  """The training run ``args`` describes (:func:`parse_args`'s); returns :func:`main`'s results. SIGINT, SIGTERM and
  SIGUSR1 stop it at a step boundary, saved (``train.stopping``)."""
  signals = stopping.Signals(jax.process_index(), jax.process_count()).install()
  try:
    return _train(args, signals)
  finally:
    signals.uninstall()


def _train(args: TrainConfig, signals: stopping.Signals) -> dict[str, Any]:
  ckpt_dir = os.path.abspath(os.path.join(args.out, "ckpt"))
  progress.show_library_notes(info=not args.quiet and primary())  # jax_dos's notes (calibration) as plain lines
  splits, vocab, data_desc = _load_data(args)  # its errors first: a wrong --data path is reported whatever --out holds
  # Before anything slow: a mistake here should fail at once.
  manager, resume = checkpoints.open_checkpoints(args, ckpt_dir)

  # --- model, then the step: both steps' plans from shapes, one chosen, its optimizer state allocated once
  arch = model_module(args)
  cfg = model_config(args, vocab_size=vocab, dtype=args.compute_dtype, param_dtype=args.param_dtype,
                     remat=plain_remat(args.remat))  # fmt: skip
  calibration.measure_here(args)
  mesh = parallel.make_mesh(args.mesh) if args.mesh is not None else None
  shardings = None if mesh is None else parallel.param_shardings(mesh, arch.abstract_params(cfg))
  batch_layout = None if mesh is None else parallel.batch_sharding(mesh)
  device_memory.check(args, cfg, mesh, lambda line: say(args, line))  # what no plan can hold ends here, unallocated
  with _setup_phase(args, "the parameters initialised" if args.init_from is None else "the checkpoint read"):
    graphdef, params = _init_params(args, cfg, shardings)
  num_params = arch.tree_size(params)
  first = data_lib.get_batch(splits.train, args.global_batch * args.grad_accum, args.seq_len, args.seed, 0)
  built = _build_step(args, cfg, graphdef, params, first, batch_layout, manager if resume else None)
  step, schedule, start_step, args = built.step, built.schedule, built.start_step, built.args  # args: as resumed
  del params, first
  if manager is not None and args.no_ckpt:  # --resume --no-ckpt: restored, nothing more is written
    manager.close()
    manager = None
  saving, no_room = manager is not None, None  # whether this run writes checkpoints; why not, where no disk room
  if manager is not None:
    try:
      manager.check_space(step.params, step.opt_state)  # said now, not at the first save
    except OSError as e:
      saving, no_room = False, str(e)
  signals.saves = saving

  # --- output and logging
  os.makedirs(args.out, exist_ok=True)
  log = progress.MetricsLog(
    os.path.join(args.out, "metrics.jsonl"), resume_step=start_step if resume else None, enabled=primary()
  )
  tokens_per_step = args.global_batch * args.grad_accum * args.seq_len
  flops_tok = arch.flops_per_token(cfg, args.seq_len)
  peak = args.peak_flops or progress.detect_peak_flops(args.compute_dtype, jax.local_devices()[0])
  peak = peak and peak * (1 if mesh is None else mesh.size)  # MFU of the job: every chip's peak

  def get_batch(tokens: np.ndarray, batch_rows: int, index: int, stream: int = data_lib.TRAIN_STREAM) -> tuple:
    """Batch ``index``: numpy on one device, or global arrays on the mesh of which this process reads its rows."""
    read = lambda part: data_lib.get_batch(tokens, batch_rows, args.seq_len, args.seed, index, stream, part)  # noqa: E731
    return read(slice(None)) if batch_layout is None else parallel.global_batch(read, batch_layout, batch_rows)

  val_batches = [get_batch(splits.val, args.global_batch, i, data_lib.VAL_STREAM) for i in range(args.eval_batches)]

  def evaluate() -> float:
    step.settle()  # no optimizer thread launches while the evaluation's programs first run
    return validation_loss(graphdef, step.params, val_batches)

  source = hf_source(args)

  def meta(at: int) -> dict[str, Any]:
    data_pos = {"sampler": "default_rng([seed, 0, step])", "next_batch": at, "seed": args.seed, "source": data_desc,
                "packing": args.packing}  # fmt: skip
    return {"step": at, "seed": args.seed, "data": data_pos, "config": cfg.to_dict(), "args": dataclasses.asdict(args),
            **source}  # fmt: skip

  say(args, f"model   {args.arch} {model_name(args)}: {num_params:,} params, {flops_tok / 1e6:.1f} MFLOP/token, {cfg}")
  say(args, _data_line(data_desc, splits))
  say(args, parallel.mesh_line(args.mesh, args.mesh_given, args.batch, args.grad_accum, args.seq_len))
  shape = (f"warm-up {args.warmup}, cosine to {args.decay_steps}" if args.warmup < args.decay_steps else
           f"warm-up {args.warmup}, longer than the run: {schedule(args.steps - 1):.3g} at its last step")  # fmt: skip
  say(args, f"optim   AdamW lr {args.lr:g} -> {args.min_lr:g} ({shape}),"
       f" wd {args.weight_decay}, clip {args.clip}, offload {args.offload}"
       + (f", {args.grad_accum} micro-batches a step" if args.grad_accum > 1 else "")
       + (f", delay 1 after {args.delay_warmup} steps" if args.delay else "")
       + (f" (weights predicted from the {args.delay_predict})" if args.delay_predict else ""))  # fmt: skip
  for line in built.notes:
    say(args, line)
  if saving:
    added = manager.save_added_bytes(step.params, step.opt_state)
    every = [f"every {args.ckpt_every} steps"] if args.ckpt_every > 0 else []
    if args.ckpt_every_minutes > 0:
      share = f"{stopping.SAVE_SHARE:.0%}"
      every.append(f"every {args.ckpt_every_minutes:g} min (a save at most {share} of the run's time)")
    every = ", ".join(every) + ", " if every else ""
    say(args, f"ckpt    {every}at the end and on a stop to {ckpt_dir}, the newest {args.keep} kept: a save adds up to"
              f" {added / 2**30:.2f} GiB of host memory")  # fmt: skip
  elif no_room is not None:
    warn(f"ckpt    off: {no_room} This run trains on without checkpoints (none by time or steps, at the end or on"
         " a stop); pass --no-ckpt to train without checkpoints on purpose.")  # fmt: skip
  if start_step:
    say(args, f"resumed from step {start_step} ({ckpt_dir})")
  if start_step >= args.steps:
    say(args, f"already at step {start_step} >= --steps {args.steps}: nothing to do.")

  # --- the loop
  val_losses: dict[int, float] = {}
  if start_step == 0 and args.eval_every > 0 and start_step < args.steps:
    val_losses[0] = evaluate()
    log.write({"step": 0, "val_loss": val_losses[0], "time": 0.0})

  bar = progress.make_bar(args.steps, start_step, disable=args.quiet or not primary())  # plain lines off a terminal
  eta = progress.Eta(args.steps)
  rate = step_log.Rate(tokens_per_step, flops_tok, peak)
  record = step_log.StepLog(args.clip)
  t_start = time.perf_counter()
  step_no = start_step
  profile = profiling.Profile(args.profile, os.path.join(args.out, "profile"), step, lambda line: say(args, line))
  clock = stopping.SaveClock(args.ckpt_every_minutes if saving else 0.0, t_start)
  stopped, _ = stopping.agree(signals.requested, False)  # a signal during the setup: no step to save
  if stopped and start_step < args.steps:
    bar.close()
    step.close()
    warn(f"stopped by {stopping.signal_name(stopped)} before the first step: nothing new to save")
    raise SystemExit(128 + stopped)
  for it in range(start_step, args.steps):
    t_step = time.perf_counter()
    profile.before(it + 1)
    try:
      loss = step(get_batch(splits.train, args.global_batch * args.grad_accum, it))
    except Exception as e:  # a worker's error, re-raised here, or the accelerator's (out of memory): one line
      bar.close()
      _failed(args, manager if saving else None, step, it + 1, e)
    step_no = it + 1
    now = time.perf_counter()
    rate.returned(step_no, now)
    profile.after(step_no)
    record.add(step_no, loss, step.grad_norm)
    if it == start_step:  # the first step compiles: start the clocks after it
      step.settle()
      host_memory.release_freed_heap()  # what compiling left in the C heap
      rate.start(step_no)
      eta.start(step_no, rate.t_mark)
    else:
      clock.step_took(now - t_step)
    last = step_no == args.steps
    stopped, by_time = stopping.agree(signals.requested, clock.due(now))  # every process at the same step
    if saving and not manager.writing():  # a save written beside the steps has finished: what it cost them
      _say_written(args, clock.written(now), clock)
    stopping_here = bool(stopped) and not last
    do_eval = last or (args.eval_every > 0 and step_no % args.eval_every == 0 and not stopping_here)
    do_ckpt = saving and (last or stopping_here or by_time or (args.ckpt_every > 0 and step_no % args.ckpt_every == 0))
    if not (do_eval or do_ckpt or stopping_here or step_no % args.log_every == 0):
      continue
    rows = record.flush()  # one sync per interval
    bad = next(((r["step"], r["loss"]) for r in rows if not math.isfinite(r["loss"])), None)
    if bad is not None:
      bar.close()
      checkpoints.stop_non_finite(args, manager, f"the training loss of step {bad[0]} is {bad[1]}")
    now = time.perf_counter()
    rate.mark(step_no, now)
    row = {**rows[-1], "lr": float(schedule(step_no - 1)), "tokens_per_s": rate.tokens_per_s, "mfu": rate.mfu}
    if do_eval:
      val_losses[step_no] = row["val_loss"] = evaluate()
    row["time"] = log.time_offset + now - t_start
    for r in rows[:-1]:
      log.write(r)
    log.write(row)
    bar.set_postfix(progress.bar_fields(row, eta.text(step_no, now), val_losses), refresh=False)
    bar.update(step_no - bar.n)
    if do_eval and not args.quiet and primary():
      bar.write(f"step {step_no}: train loss {row['loss']:.4f}, val loss {val_losses[step_no]:.4f}", file=sys.stderr)
    if do_ckpt:
      t_save = time.perf_counter()
      saved = checkpoints.save(args, manager, step, step_no, meta(step_no), bar)
      if saved is not None and not (last or stopping_here):
        clock.saved(t_save, *saved)
    if stopping_here:
      bar.close()
      _stop(args, manager if saving else None, step, step_no, stopped, no_room, t_save if do_ckpt else None)
    if do_eval or do_ckpt:
      rate.restart()  # tokens/s measures training only
  bar.close()
  profile.after(None)
  params = step.params
  step.close()
  if manager is not None:
    manager.wait_until_finished()
    manager.close()
  return _finish(args, log, record, val_losses, step_no, start_step, rate, num_params, step.plan, params)


if __name__ == "__main__":
  cli()
