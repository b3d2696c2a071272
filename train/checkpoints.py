"""The run's Orbax checkpoints: opened (refusing to mix runs), restored (checked against the run's model), saved
(nothing non-finite), and the run stopped with every checkpoint kept."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jax_dos
from train.flags import TrainConfig
from train.job import barrier, everywhere, primary, say, warn
from train.schedule import resumed_schedule

# The config's fields a resumed run may change (how the model computes, not what it is).
RUN_FIELDS = ("dtype", "param_dtype", "remat")


def open_checkpoints(args: TrainConfig, ckpt_dir: str) -> tuple[jax_dos.CheckpointManager | None, bool]:
  """``(manager, resume)``: the run's checkpoint manager (``None`` with ``--no-ckpt``, but for ``--resume``'s
  restore, after which the run closes it and writes nothing) and whether to restore.

  Refuses to mix a new run into an earlier run's checkpoints unless told how.
  A folder holding no complete checkpoint (a first save was interrupted) is
  taken over by a plain run and by ``--resume``, both starting at step 0.
  """
  if args.no_ckpt and not args.resume:  # writes nothing to ckpt_dir, whatever it holds
    if os.path.isdir(ckpt_dir) and not args.overwrite:
      with jax_dos.CheckpointManager(ckpt_dir) as earlier:
        if earlier.complete_steps():
          warn(f"note: --no-ckpt leaves the checkpoints in {ckpt_dir} alone; this run's metrics.jsonl replaces theirs")
    return None, False
  if args.overwrite and primary():
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    for name in ("metrics.jsonl", "loss.png"):
      if os.path.exists(os.path.join(args.out, name)):
        os.remove(os.path.join(args.out, name))
  barrier("overwrite")  # the other processes look at the folder once process 0 has cleared it
  manager = jax_dos.CheckpointManager(ckpt_dir, save_interval_steps=max(args.ckpt_every, 1), max_to_keep=args.keep,
                                      async_save=args.ckpt_async != "off",
                                      host_copy="copy" if args.ckpt_async == "on" else "auto")  # fmt: skip
  complete = manager.complete_steps()
  leftovers = os.path.isdir(ckpt_dir) and any(name != jax_dos.DAMAGED_DIR for name in os.listdir(ckpt_dir))
  if complete and not args.resume:
    manager.close()
    raise SystemExit(
      f"error: {ckpt_dir} holds checkpoints of an earlier run (newest: step {complete[-1]}). Pass --resume to"
      " continue it, --overwrite to start again, --no-ckpt to train without checkpoints, or another --out."
    )
  if not complete and leftovers:
    with damage_reported():
      manager.latest_step()  # moves the interrupted save's committed steps aside
    warn(f"note: {ckpt_dir} holds no complete checkpoint (a first save was interrupted): starting at step 0.")
    return manager, False
  if args.resume and not complete:
    manager.close()
    raise SystemExit(f"error: --resume: no checkpoint in {ckpt_dir}. Run without --resume to start a new run.")
  return manager, args.resume


@contextlib.contextmanager
def damage_reported():
  """Prints each damaged checkpoint the manager set aside as its one line (no traceback, no source line)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", jax_dos.DamagedCheckpointWarning)
    try:
      yield
    finally:
      for w in caught:
        if issubclass(w.category, jax_dos.DamagedCheckpointWarning):
          warn(f"warning: {w.message}")
        else:
          warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def restore(
  manager: jax_dos.CheckpointManager, cfg: Any, params: Any, opt_state: Any, args: TrainConfig
) -> tuple[Any, Any, int, TrainConfig]:
  """``(params, opt_state, step, args)`` of the newest checkpoint that verifies (damaged newer ones are moved aside,
  one line each); the run's config ``args`` comes back with the resumed run's learning-rate schedule
  (``train.flags.resumed_schedule``: a new config where it differs)."""
  ckpt_dir = manager.directory
  refuse_another_model(manager, cfg, args)
  try:
    with damage_reported():
      params, opt_state, meta = manager.restore(params=params, opt_state=opt_state)
  except FileNotFoundError as e:  # every step failed verification (each moved aside and reported)
    raise SystemExit(
      f"error: --resume: {e}\nRun without --resume to start again in {ckpt_dir}, or pass another --out."
    ) from None
  except jax_dos.TemplateMismatchError as e:  # a different model or optimizer chain
    raise SystemExit(
      f"error: --resume: the checkpoint's model differs from this run's; give the same --preset, --n-layer,"
      f" --n-head, --d-model and --vocab-size as the run that wrote it.\n{e}"
    ) from None
  except ValueError as e:  # what else the checkpoint module refuses (a newer format, ...): its own words
    raise SystemExit(f"error: --resume: {e}\nThe checkpoints in {ckpt_dir} are unchanged.") from None
  saved_arch = meta.get("args", {}).get("arch", "gpt")
  if saved_arch != args.arch:
    raise SystemExit(f"error: --resume: the checkpoint is of --arch {saved_arch}, not {args.arch}.")
  saved = meta.get("config", {})
  fields = [k for k in cfg.to_dict() if k not in RUN_FIELDS]
  diff = {k: (saved.get(k), getattr(cfg, k)) for k in fields if saved.get(k) != getattr(cfg, k)}
  if diff:
    raise SystemExit(f"error: --resume: the checkpoint's model differs from this run's (saved, now): {diff}.")
  if meta.get("seed") != args.seed:
    raise SystemExit(f"error: --resume: the checkpoint was trained with --seed {meta.get('seed')}, not {args.seed}.")
  args, notes = resumed_schedule(args, meta.get("args", {}))
  for note in [*notes, batch_note(args, meta.get("args", {}))]:
    if note:
      say(args, note)
  return params, opt_state, int(meta["step"]), args


# The flags that choose the model: a resumed run must give the values its checkpoint's run gave.
MODEL_FLAGS = ("arch", "init_from", "preset", "n_layer", "n_head", "d_model", "vocab_size")


def refuse_another_model(manager: jax_dos.CheckpointManager, cfg: Any, args: TrainConfig) -> None:
  """A ``SystemExit`` naming each model flag (:data:`MODEL_FLAGS`) whose value differs from the checkpoint's run
  (``--arch gpt, not llama``), or the model config's fields where no flag does; read from the newest complete
  step's meta, before anything of the state is (the restore's own tree check would only say that the trees
  differ)."""
  try:
    meta = manager.meta()
  except FileNotFoundError:
    return  # the restore says why
  saved_args = meta.get("args", {})
  saved_args.setdefault("arch", "gpt")
  flags = [f"--{k.replace('_', '-')} {saved_args.get(k)}, not {getattr(args, k)}" for k in MODEL_FLAGS
           if k in saved_args and saved_args[k] != getattr(args, k)]  # fmt: skip
  if flags:
    raise SystemExit(f"error: --resume: the checkpoint's run was trained with {'; '.join(flags)}: give its flags"
                     " to resume it, or another --out for a new run.")  # fmt: skip
  saved = meta.get("config", {})
  fields = [k for k in cfg.to_dict() if k not in RUN_FIELDS]
  diff = {k: (saved.get(k), getattr(cfg, k)) for k in fields if saved.get(k) != getattr(cfg, k)}
  if diff:
    raise SystemExit(f"error: --resume: the checkpoint's model differs from this run's (saved, now): {diff}.")


def batch_note(args: TrainConfig, saved_args: dict[str, Any]) -> str | None:
  """The line a resumed run prints where its steps take another number of rows than the run it resumes (another
  device count with the same ``--batch``, say), with the flags that keep them; ``None`` where they agree (or the
  checkpoint does not say). Not an error: a run may change its batch on purpose."""
  try:
    saved_rows = int(saved_args["global_batch"]) * int(saved_args.get("grad_accum", 1))
    saved_devices = int(saved_args["global_batch"]) // int(saved_args["batch"])
  except (KeyError, TypeError, ValueError, ZeroDivisionError):
    return None
  devices, rows = args.global_batch // args.batch, args.global_batch * args.grad_accum
  if saved_rows == rows:
    return None
  keep = f"--batch and --grad-accum whose product with this run's {devices} device(s) is {saved_rows}"
  if saved_rows % (devices * args.grad_accum) == 0:
    keep = f"--batch {saved_rows // (devices * args.grad_accum)}"
  return (
    f"resume: the resumed run took {saved_rows} rows a step ({saved_args['batch']} a device x {saved_devices}"
    f" device(s) x {saved_args.get('grad_accum', 1)} micro-batch(es)), this one takes {rows} ({args.batch} x"
    f" {devices} x {args.grad_accum}): its steps read other batches. Give {keep} to keep them."
  )


@jax.jit
def all_finite(tree: Any) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def host_finite(tree: Any) -> bool:
  """Whether every element of host-resident arrays is finite (numpy over zero-copy views, in 64 Mi pieces)."""
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      flat = np.asarray(shard.data).reshape(-1)
      if not all(np.isfinite(flat[i : i + 2**26]).all() for i in range(0, flat.size, 2**26)):
        return False
  return True


DIVERGED = "continue from it with --resume, with a lower --lr or more --warmup"


def stop_non_finite(
  args: TrainConfig, manager: jax_dos.CheckpointManager | None, what: str, advice: str = DIVERGED
) -> None:
  """Ends the run with an error naming the step: nothing of this state is saved, every checkpoint is kept (a save in
  flight finishes first, with its manifest). ``advice``: how to continue from the newest checkpoint."""
  where = "no checkpoint is written (--no-ckpt)"
  if manager is not None:
    try:
      manager.close()  # the last good save finishes and keeps its manifest
    except Exception as e:  # noqa: BLE001 (that save failed: the ones before it are intact)
      warn(f"warning: the save in flight failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    steps = manager.complete_steps()
    where = f"the newest checkpoint is step {steps[-1]} in {manager.directory} ({advice})" if steps else (
      "no checkpoint was written yet")  # fmt: skip
  raise SystemExit(f"error: training stopped: {what}. Nothing of this state was saved; {where}.")


def save(
  args: TrainConfig, manager: jax_dos.CheckpointManager, step: Any, step_no: int, meta: dict[str, Any], bar: Any
) -> tuple[float, bool] | None:
  """Saves the settled parameters and state; nothing non-finite is saved (the run stops, every checkpoint kept).

  Returns ``(seconds the training waited for the save, whether it is still being written beside the next steps)``;
  ``None`` where the disk has no room for it, said in one line: the run trains on, every checkpoint kept."""
  step.settle()
  params, opt_state = step.params, step.opt_state  # the next step consumes them: save returns once they are copied
  # With --delay 1 the parameters lag the host's last update: check its masters too.
  finite = bool(all_finite(params)) and (not args.delay or everywhere(host_finite(opt_state.master)))
  if not finite:
    bar.close()
    stop_non_finite(args, manager, f"the parameters after step {step_no}'s update are not finite (inf or nan)")
  nbytes = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves((params, opt_state)))
  if nbytes >= 2**30:  # a save that takes a while says so first (a synchronous one holds the run, Ctrl-C included)
    say(args, f"checkpoint step {step_no}: saving {nbytes / 1e9:.1f} GB to {manager.directory}")
  t0 = time.perf_counter()
  try:
    manager.save(step_no, params=params, opt_state=opt_state, meta=meta, force=True)
  except OSError as e:  # the disk's room, checked before anything is written: this save is skipped
    warn(f"checkpoint step {step_no} not saved: {e}")
    return None
  took = time.perf_counter() - t0
  if took >= 1.0:  # the time the training waited for the save (all of it where the save is synchronous)
    say(args, f"checkpoint step {step_no}: training waited {took:.1f} s for its save")
  return took, manager.writing()
