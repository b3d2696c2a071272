"""Orbax checkpoints of params and an (offloaded) Adam state, restorable across plans and optimizers.

On-disk form (one Orbax step directory per saved step, written through
``orbax.checkpoint.CheckpointManager``, so saves are atomic: a step is written
in ``<step>.orbax-checkpoint-tmp-*`` and renamed when committed)::

    <dir>/<step>/params/      PyTree: the params, as given
                 opt_state/   PyTree: {"count": int32[], "mu": <params tree>, "nu": <params tree>,
                                       "extra": {"0": leaf, ...}}   (extra only if the state has other leaves)
                 master/      PyTree: fp32 master weights (<params tree>); only for jax_dos states
                 meta/        JSON: the caller's ``meta`` (data position, RNG, config, ...)
                 format/      JSON: {"format": FORMAT, "source": "interleaved" | "optax", "has_master", "num_extra"}
                 jax_dos_manifest.json   size (and CRC-32 of files <= 1 MiB) of every file, written after commit

This *canonical* form is plan-independent: every state leaf mirrors a parameter
leaf, in flatten order, whatever its placement or memory kind. So a checkpoint
restores into any plan, and into either optimizer: from an ``optax.adamw``
checkpoint (no ``master``) the master weights are the saved params read again
as float32 straight into the master's memory kind; into an ``optax.adamw``
state the master is dropped. ``ScaleByScheduleState`` counts are not stored:
they equal the Adam count. Other leaves of a chained state (``optax.chain``)
are stored in flatten order as ``extra``.

Restore places every array directly in its memory kind: the restore arguments
are built from the template's shardings (memory kind included), so Orbax reads
each shard from disk into a buffer of that sharding; ``pinned_host`` state
never passes through accelerator memory.

In-place hazard. Orbax's synchronous part of an async save (``save`` returning)
only starts device-to-host copies and then holds ``np.asarray`` of each shard;
for an array already in host memory (``pinned_host``, or anything on the CPU
backend) that is a zero-copy view of the live buffer (checked: overwriting the
buffer after ``save`` returns changes what is written). jax_dos's eager
``update`` overwrites host state buffers in place, so the next step would race
the writer. ``save`` therefore gives Orbax fresh copies of every host-resident
array (``host_copy="copy"``: ``host_kernels.snapshot``, a copy into ordinary
memory by all cores, finished before ``save`` returns; XLA's own host-to-host
copy ran single-threaded at 1.7 GB/s on the H100 machine). The copy costs host
memory equal to the host state until the write ends; at most one save is in
flight, so at most one copy exists. If that copy does not
fit in half the available host memory, ``host_copy="auto"`` (the default)
instead saves synchronously (``"block"``): slower, but never out of memory.
Accelerator-resident arrays need nothing: Orbax copies them to host before
``save`` returns.

Robustness. A step is *valid* if its commit metadata and every item's metadata
parse and its manifest (if written) matches the files on disk.
:meth:`CheckpointManager.latest_step` returns the newest valid step;
:meth:`CheckpointManager.restore` warns about and skips invalid or unreadable
steps and uses the newest good one. Retention keeps the newest ``max_to_keep``
valid steps and never deletes an invalid one (it is kept for inspection).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import warnings
import zlib
from typing import Any, Literal, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jax_dos import host_kernels, memory
from jax_dos.engine import wait_for_host_updates
from jax_dos.state_convert import from_optax_adamw_state, split_adam, to_optax_adamw_state

__all__ = ["FORMAT", "CheckpointManager", "from_optax_adamw_state", "to_optax_adamw_state"]

FORMAT = "jax_dos.adam/1"
MANIFEST = "jax_dos_manifest.json"
_CRC_MAX_BYTES = 1 << 20
_PYTREE_ITEMS = ("params", "opt_state", "master")
HostCopy = Literal["auto", "copy", "block"]

log = logging.getLogger(__name__)


def _size(nbytes: int) -> str:
  return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def _is_local(path: str) -> bool:
  return "://" not in path


def _file_digest(path: str, size: int) -> Optional[int]:
  if size > _CRC_MAX_BYTES:
    return None
  with open(path, "rb") as f:
    return zlib.crc32(f.read())


def _scan(step_dir: str) -> dict[str, list]:
  out = {}
  for root, _, files in os.walk(step_dir):
    for name in files:
      full = os.path.join(root, name)
      rel = os.path.relpath(full, step_dir)
      if rel == MANIFEST or rel.endswith(".tmp"):
        continue
      size = os.path.getsize(full)
      out[rel] = [size, _file_digest(full, size)]
  return out


def _write_manifest(step_dir: str, step: int) -> None:
  tmp = os.path.join(step_dir, MANIFEST + ".tmp")
  with open(tmp, "w") as f:
    json.dump({"format": FORMAT, "step": step, "files": _scan(step_dir)}, f)
  os.replace(tmp, os.path.join(step_dir, MANIFEST))


def _read_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)


def _aliases_host(x: Any) -> bool:
  """Whether Orbax would keep a zero-copy view of ``x``'s live buffer."""
  if not isinstance(x, jax.Array):
    return False
  if x.sharding.memory_kind in ("pinned_host", "unpinned_host"):
    return True
  return any(d.platform == "cpu" for d in x.sharding.device_set)


def _key_str(key: tuple) -> str:
  return "/".join(str(k) for k in key) or "<root>"


def _array_keys(tree: Any) -> dict[tuple, tuple]:
  """Flat {path: shape} of the array leaves of a template or an Orbax metadata tree."""
  flat = ocp.tree.to_flat_dict(tree)
  return {k: tuple(v.shape) for k, v in flat.items() if hasattr(v, "shape") and hasattr(v, "dtype")}


def _check_tree(what: str, step: int, template: Any, on_disk: Any) -> None:
  want = _array_keys(ocp.tree.serialize_tree(template, keep_empty_nodes=True))
  have = _array_keys(on_disk)
  missing = sorted(_key_str(k) for k in want.keys() - have.keys())
  unexpected = sorted(_key_str(k) for k in have.keys() - want.keys())
  shapes = sorted(
    f"{_key_str(k)}: checkpoint {have[k]}, template {want[k]}" for k in want.keys() & have.keys() if want[k] != have[k]
  )
  if missing or unexpected or shapes:
    lines = [f"checkpoint step {step}: the {what} do not match the template you passed to restore."]
    if missing:
      lines.append(f"  in the template but not in the checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    if unexpected:
      lines.append(
        f"  in the checkpoint but not in the template: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}"
      )
    if shapes:
      lines.append(f"  shape mismatches: {shapes[:10]}{' ...' if len(shapes) > 10 else ''}")
    lines.append("Build the template from the same model configuration the checkpoint was saved with.")
    raise TemplateMismatchError("\n".join(lines))


class TemplateMismatchError(ValueError):
  """The restore template's tree does not match the checkpoint's."""


def _is_empty(x: Any) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype") and 0 in tuple(x.shape)


# Orbax refuses zero-size arrays. Each is saved as a one-element stand-in; its real shape comes from the template.
def _stand_in_empties(tree: Any) -> Any:
  return jax.tree.map(lambda x: np.zeros((1,), x.dtype) if _is_empty(x) else x, tree)


def _disk_template(template: Any) -> Any:
  """The template as it is on disk: zero-size leaves as their one-element stand-ins."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((1,), x.dtype) if _is_empty(x) else x, template)


def _restore_item(template: Any) -> ocp.args.PyTreeRestore:
  """Restores ``template``'s tree in its shardings and memory kinds (stand-ins of empty leaves as numpy)."""
  args = ocp.checkpoint_utils.construct_restore_args(template)
  args = jax.tree.map(lambda t, a: ocp.RestoreArgs(restore_type=np.ndarray) if _is_empty(t) else a, template, args)
  return ocp.args.PyTreeRestore(_disk_template(template), restore_args=args)


def _fill_empties(restored: Any, template: Any) -> Any:
  """Replaces the stand-ins with zero-size arrays shaped, typed and placed like the template's."""

  def fill(x, t):
    if not _is_empty(t):
      return x
    empty = np.zeros(t.shape, t.dtype)
    sharding = getattr(t, "sharding", None)
    return jax.device_put(empty, sharding) if sharding is not None else empty

  return jax.tree.map(fill, restored, template)


class _KeepNewestValid:
  """Orbax preservation policy: keep the newest ``n`` valid steps and every invalid one."""

  def __init__(self, n: Optional[int], owner: CheckpointManager):
    self.n, self.owner = n, owner

  def should_preserve(self, checkpoints, *, context=None) -> list[bool]:
    del context
    keep = [True] * len(checkpoints)
    if self.n is None:
      return keep
    valid_seen = 0
    for i in sorted(range(len(checkpoints)), key=lambda j: checkpoints[j].step, reverse=True):
      if self.owner.counts_as_valid(checkpoints[i].step):
        valid_seen += 1
        keep[i] = valid_seen <= self.n
    return keep


class CheckpointManager:
  """Saves and restores ``(params, opt_state, meta)`` with Orbax; see the module docstring.

  Args:
    directory: where the step directories go (created if missing).
    save_interval_steps: ``save`` writes only every this many steps (unless ``force``).
    max_to_keep: how many valid steps to keep (``None``: all).
    async_save: write in a background thread (``save`` returns once the data
      is safely copied; see the in-place hazard in the module docstring).
    host_copy: ``"copy"``, ``"block"`` or ``"auto"``: how an async save guards
      host-resident arrays against in-place updates (module docstring).
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    save_interval_steps: int = 1000,
    max_to_keep: Optional[int] = 3,
    async_save: bool = True,
    host_copy: HostCopy = "auto",
  ):
    if host_copy not in ("auto", "copy", "block"):
      raise ValueError(f"host_copy must be 'auto', 'copy' or 'block', got {host_copy!r}.")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}.")
    self.directory = os.path.abspath(os.fspath(directory)) if _is_local(os.fspath(directory)) else os.fspath(directory)
    self.async_save, self.host_copy = async_save, host_copy
    self._lock = threading.Lock()
    self._pending: set[int] = set()
    self._warned: set[tuple[int, str]] = set()
    options = ocp.CheckpointManagerOptions(
      save_interval_steps=save_interval_steps,
      preservation_policy=_KeepNewestValid(max_to_keep, self),
      enable_async_checkpointing=async_save,
      async_options=ocp.AsyncOptions(post_finalization_callback=self._write_pending_manifests) if async_save else None,
      create=False,  # made by the first save, so restore from a mistyped path fails clearly
    )
    handlers = {name: ocp.PyTreeCheckpointHandler() for name in _PYTREE_ITEMS}
    handlers |= {"meta": ocp.JsonCheckpointHandler(), "format": ocp.JsonCheckpointHandler()}
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  # ---------------------------------------------------------------- save

  def save(self, step: int, *, params: Any, opt_state: Any, meta: Optional[dict] = None, force: bool = False) -> bool:
    """Saves ``params``, ``opt_state`` (any state with one Adam state) and ``meta`` at ``step``.

    Returns whether a checkpoint was started (``False`` between save intervals).
    When it returns, ``params`` and ``opt_state`` may be updated in place.
    """
    meta = {} if meta is None else meta
    try:
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise TypeError(f"meta must be JSON-serializable (dicts, lists, str, numbers, bool, None): {e}") from e
    if not force and not self._mgr.should_save(step):
      return False
    wait_for_host_updates()  # a delayed host update may still be writing the state
    parts = split_adam(opt_state)
    canon = {"count": parts.count, "mu": parts.mu, "nu": parts.nu}
    if parts.extra:
      canon["extra"] = {str(i): x for i, x in enumerate(parts.extra)}
    trees = {"params": params, "opt_state": canon}
    if parts.master is not None:
      trees["master"] = parts.master
    trees = _stand_in_empties(trees)
    fmt = {
      "format": FORMAT,
      "source": parts.kind,
      "has_master": parts.master is not None,
      "num_extra": len(parts.extra),
    }

    self._mgr.wait_until_finished()  # one save in flight: bounds the memory of host copies
    self.check_space(trees)  # (creates a local directory)
    self._write_pending_manifests()
    mode = self._guard_mode(trees)
    if mode == "copy":
      jax.block_until_ready(trees)  # what is copied must be computed; the copy finishes before save returns
      trees = jax.tree.map(lambda x: host_kernels.snapshot(x) if _aliases_host(x) else x, trees)
    args = {name: ocp.args.PyTreeSave(tree) for name, tree in trees.items()}
    args |= {"meta": ocp.args.JsonSave(meta), "format": ocp.args.JsonSave(fmt)}
    with self._lock:
      self._pending.add(step)
    saved = self._mgr.save(step, args=ocp.args.Composite(**args), force=force)
    if not saved:
      with self._lock:
        self._pending.discard(step)
    elif mode == "block" or not self.async_save:
      self._mgr.wait_until_finished()
      self._write_pending_manifests()
    return saved

  def check_space(self, *trees: Any) -> None:
    """Raises ``OSError`` if the checkpoint directory's disk cannot hold one checkpoint of ``trees``.

    Called by :meth:`save` before anything is written (so a full disk never
    leaves a half-written step behind), and usable before training starts,
    with ``params`` and the optimizer state, to fail early. Remote paths are
    not checked.
    """
    if not _is_local(self.directory):
      return
    need = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(trees))
    os.makedirs(self.directory, exist_ok=True)
    free = shutil.disk_usage(self.directory).free
    if need > free:
      raise OSError(
        f"a checkpoint needs {_size(need)} but {self.directory} has {_size(free)} free. Point the"
        " manager at a larger disk (or free space there); earlier checkpoints are untouched."
      )

  def _guard_mode(self, trees: Any) -> str:
    if not self.async_save:
      return "none"
    host_bytes = sum(x.nbytes for x in jax.tree.leaves(trees) if _aliases_host(x))
    if host_bytes == 0:
      return "none"
    if self.host_copy != "auto":
      return self.host_copy
    if host_bytes <= memory.host_memory_available() // 2:
      return "copy"
    log.warning("checkpoint: %.2f GiB of host state is too much to copy; saving synchronously.", host_bytes / 2**30)
    return "block"

  def _write_pending_manifests(self) -> None:
    """Writes the manifest of every committed step saved by this manager (primary process only)."""
    with self._lock:
      pending = sorted(self._pending)
      for step in pending:
        step_dir = self._step_dir(step)
        if not os.path.isdir(step_dir):
          continue  # not committed (yet)
        self._pending.discard(step)
        if jax.process_index() == 0 and _is_local(self.directory):
          _write_manifest(step_dir, step)

  def wait_until_finished(self) -> None:
    """Blocks until the save in flight (if any) is committed."""
    self._mgr.wait_until_finished()
    self._write_pending_manifests()

  def close(self) -> None:
    self.wait_until_finished()
    self._mgr.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---------------------------------------------------------------- validity

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def counts_as_valid(self, step: int) -> bool:
    """Whether retention counts ``step`` among the valid steps: not committed yet (being written), or valid."""
    return not os.path.isdir(self._step_dir(step)) or self._problem(step) is None

  def _problem(self, step: int) -> Optional[str]:
    """Why ``step`` is not a valid checkpoint, or ``None`` if it is."""
    step_dir = self._step_dir(step)
    if not _is_local(self.directory):
      return None
    try:
      if not os.path.isdir(step_dir):
        return "its directory does not exist"
      _read_json(os.path.join(step_dir, "_CHECKPOINT_METADATA"))
      fmt = _read_json(os.path.join(step_dir, "format", "metadata"))
      if not isinstance(fmt, dict) or fmt.get("format") != FORMAT:
        return f"its format record is {fmt!r}, not {FORMAT!r} (not written by jax_dos.checkpoint?)"
      items = ["params", "opt_state"] + (["master"] if fmt.get("has_master") else [])
      for item in items:
        _read_json(os.path.join(step_dir, item, "_METADATA"))
      _read_json(os.path.join(step_dir, "meta", "metadata"))
      manifest_path = os.path.join(step_dir, MANIFEST)
      if os.path.exists(manifest_path):
        files = _read_json(manifest_path)["files"]
        for rel, (size, crc) in files.items():
          full = os.path.join(step_dir, rel)
          if not os.path.exists(full):
            return f"file {rel} is missing"
          if os.path.getsize(full) != size:
            return f"file {rel} has {os.path.getsize(full)} bytes, {size} were written"
          if crc is not None and _file_digest(full, size) != crc:
            return f"file {rel} is corrupt (checksum mismatch)"
    except FileNotFoundError as e:
      return f"{os.path.relpath(e.filename, step_dir) if e.filename else 'a file'} is missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
      return f"its metadata is unreadable ({type(e).__name__}: {e})"
    return None

  def _warn(self, step: int, reason: str) -> None:
    if (step, reason) not in self._warned:
      self._warned.add((step, reason))
      warnings.warn(
        f"checkpoint step {step} in {self.directory} is unusable: {reason}. Skipping it (it is kept on disk).",
        stacklevel=3,
      )

  def all_steps(self) -> list[int]:
    """Every committed step on disk (valid or not), ascending."""
    if not os.path.isdir(self.directory):
      return []
    return sorted(self._mgr.all_steps(read=True))

  def latest_step(self) -> Optional[int]:
    """The newest valid step, or ``None`` if there is none."""
    for step in reversed(self.all_steps()):
      reason = self._problem(step)
      if reason is None:
        return step
      self._warn(step, reason)
    return None

  # ---------------------------------------------------------------- restore

  def restore(self, step: Optional[int] = None, *, params: Any, opt_state: Any) -> tuple[Any, Any, dict]:
    """Restores ``(params, opt_state, meta)`` shaped, sharded and placed like the templates.

    Args:
      step: the step to restore; ``None`` means the newest step that can be
        read (invalid or unreadable newer steps are skipped with a warning).
      params: template (concrete arrays or ``jax.ShapeDtypeStruct`` s with
        shardings) for the params.
      opt_state: template of the optimizer state: an ``optax.adamw``-style
        state or a jax_dos :class:`InterleavedAdamState`, possibly inside an
        ``optax.chain`` tuple. The checkpoint may hold either kind.

    Returns:
      ``(params, opt_state, meta)`` with every array in its template's sharding
      and memory kind.
    """
    if _is_local(self.directory) and not os.path.isdir(self.directory):
      raise FileNotFoundError(
        f"checkpoint directory {self.directory} does not exist; check the path, or start from scratch."
      )
    steps = self.all_steps()
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; committed steps: {steps}.")
      reason = self._problem(step)
      if reason is not None:
        raise ValueError(f"checkpoint step {step} in {self.directory} is unusable: {reason}. Restore another step.")
      return self._restore_step(step, params, opt_state)
    if not steps:
      raise FileNotFoundError(f"no checkpoints in {self.directory}.")
    reasons = []
    for s in reversed(steps):
      reason = self._problem(s)
      if reason is None:
        try:
          return self._restore_step(s, params, opt_state)
        except TemplateMismatchError:
          raise
        except Exception as e:  # an unreadable checkpoint: use an older one
          reason = f"reading it failed ({type(e).__name__}: {str(e)[:500]})"
      self._warn(s, reason)
      reasons.append(f"step {s}: {reason}")
    raise ValueError(f"no usable checkpoint in {self.directory}:\n  " + "\n  ".join(reasons))

  def _restore_step(self, step: int, params_t: Any, opt_t: Any) -> tuple[Any, Any, dict]:
    fmt = self._mgr.restore(step, args=ocp.args.Composite(format=ocp.args.JsonRestore()))["format"]
    parts = split_adam(opt_t)
    if fmt["num_extra"] != len(parts.extra):
      raise TemplateMismatchError(
        f"checkpoint step {step} has {fmt['num_extra']} optimizer-state leaves besides Adam's, the template has"
        f" {len(parts.extra)}; restore into an optimizer built like the one that was saved (same optax.chain)."
      )
    canon_t = {"count": parts.count, "mu": parts.mu, "nu": parts.nu}
    if parts.extra:
      canon_t["extra"] = {str(i): x for i, x in enumerate(parts.extra)}
    metadata = self._mgr.item_metadata(step)
    tree_of = lambda m: getattr(m, "tree", m)  # noqa: E731
    _check_tree("params", step, _disk_template(params_t), tree_of(metadata["params"]))
    _check_tree("optimizer state (count, mu, nu)", step, _disk_template(canon_t), tree_of(metadata["opt_state"]))

    want_master = parts.kind == "interleaved"
    items = {
      "params": _restore_item(params_t),
      "opt_state": _restore_item(canon_t),
      "meta": ocp.args.JsonRestore(),
    }
    if want_master and fmt["has_master"]:
      _check_tree("master weights", step, _disk_template(parts.master), tree_of(metadata["master"]))
      items["master"] = _restore_item(parts.master)
    out = self._mgr.restore(step, args=ocp.args.Composite(**items))
    master = _fill_empties(out["master"], parts.master) if "master" in items else None
    if want_master and not fmt["has_master"]:
      # An optax checkpoint: master = float32(saved params), read straight into the master's memory kind.
      _check_tree("params (as master weights)", step, _disk_template(parts.master), tree_of(metadata["params"]))
      master = self._mgr.restore(step, args=ocp.args.Composite(params=_restore_item(parts.master)))["params"]
      master = _fill_empties(master, parts.master)
    c = _fill_empties(out["opt_state"], canon_t)
    extra = [c["extra"][str(i)] for i in range(len(parts.extra))] if parts.extra else []
    params = _fill_empties(out["params"], params_t)
    return params, parts.rebuild(c["count"], master, c["mu"], c["nu"], extra), out["meta"]
