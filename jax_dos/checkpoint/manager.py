"""Orbax checkpoints of params and an (offloaded) Adam state, restorable across plans and optimizers.

On-disk form (one Orbax step directory per saved step, written through
``orbax.checkpoint.CheckpointManager``, so saves are atomic: a step is written
in ``<step>.orbax-checkpoint-tmp`` and renamed when committed)::

    <dir>/<step>/params/      PyTree: the params, as given
                 opt_state/   PyTree: {"count": int32[], "mu": <params tree>, "nu": <params tree>,
                                       "extra": {"0": leaf, ...}}   (extra only if the state has other leaves)
                 master/      PyTree: fp32 master weights (<params tree>); only for jax_dos states
                 meta/        JSON: the caller's ``meta`` (data position, RNG, config, ...)
                 format/      JSON: {"format": FORMAT, "source": "interleaved" | "optax", "has_master", "num_extra",
                                     "moments": {"format", "block", "version"}}   (moments.py)
                 jax_dos_manifest.json   size and CRC-32 checksums of every file, written last
    <dir>/damaged/<step>-<why>/   steps that failed verification, moved out of Orbax's sight

Every state leaf mirrors a parameter leaf, whatever its placement (``canonical.py``): a checkpoint restores into
any plan, and into either optimizer.

Restore reads a verified step straight into the templates' shardings and memory kinds (``reading.py``): ``pinned_host``
state never passes through accelerator memory.

Host state is guarded while Orbax writes it (``host_copy.py``): copied, or saved synchronously. Orbax's own copy of
every shard into pinned memory first (its default on a GPU) is off: a second pinned copy of the host state
(``docs/checkpoints.md``, "Saving on a GPU").

Integrity (``integrity.py``): once Orbax has committed a step, a thread writes its manifest (every file's size and
CRC-32 checksums, read back from disk); :meth:`CheckpointManager.latest_step` and :meth:`CheckpointManager.restore`
verify a step before Orbax reads any of it, move one that fails to ``<dir>/damaged/<step>-<why>`` with one warning
(:class:`DamagedCheckpointWarning`) and take the newest that verifies. Retention keeps the newest ``max_to_keep``
intact steps and deletes older ones only once a newer step's manifest is written.

Several processes (``jax.distributed``): every process makes the same calls in the same order on a directory all of
them see; each writes the shards it addresses; process 0 alone writes the manifest, verifies and moves damaged steps
aside, and the others take its verdict (one broadcast); ``wait_until_finished`` ends at a barrier. A checkpoint
restores into any process count and mesh, and into another moment format (``moments.py``: converted a group of
leaves at a time, each process placing its own shards). ``docs/checkpoints.md`` gives the reasons and the tests of
each.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import warnings
from typing import Any, Optional

import jax

from jax_dos.checkpoint import canonical, integrity, reading, transfers
from jax_dos.checkpoint import host_copy as host_guard
from jax_dos.checkpoint.optax_state import from_optax_adamw_state, to_optax_adamw_state
from jax_dos.checkpoint.processes import barrier, from_primary
from jax_dos.checkpoint.template import TemplateMismatchError, ocp
from jax_dos.optimizer.engine import wait_for_host_updates

__all__ = [
  "FORMAT",
  "CheckpointManager",
  "DamagedCheckpointWarning",
  "TemplateMismatchError",
  "from_optax_adamw_state",
  "to_optax_adamw_state",
]

FORMAT = canonical.FORMAT
MANIFEST = integrity.MANIFEST
_PYTREE_ITEMS = ("params", "opt_state", "master")
OTHER_PROCESS = "other-process"  # the kind of damage another process found (process 0 says what it was)
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # Orbax's name for a step being written
DELETING_SUFFIX = ".deleting"  # a step retention is deleting: .<step>.deleting

log = logging.getLogger(__name__)


def _is_local(path: str) -> bool:
  return "://" not in path


class DamagedCheckpointWarning(UserWarning):
  """A checkpoint step failed verification and was moved aside (or skipped); the message is one line."""


class CheckpointManager:
  """Saves and restores ``(params, opt_state, meta)`` with Orbax; see the module docstring.

  Args:
    directory: where the step directories go (created if missing).
    save_interval_steps: ``save`` writes only every this many steps (unless ``force``).
    max_to_keep: how many intact steps to keep (``None``: all); damaged ones are never deleted.
    async_save: write in a background thread (``save`` returns once the data
      is safely copied; see the in-place hazard in the module docstring).
    host_copy: ``"copy"``, ``"block"`` or ``"auto"``: how an async save guards
      host-resident arrays against in-place updates (module docstring).
    move_damaged: move a step that fails verification to
      ``<directory>/damaged/``. Pass ``False`` in a process that only reads a
      directory another process is writing (a step being committed there has
      no manifest yet): such steps are then only skipped.
    save_batch_bytes: a save waited for (``async_save=False``, or ``"block"``) copies
      arrays to host memory this many bytes at a time (``checkpoint/transfers.py``);
      ``host_copy="auto"`` saves asynchronously only a state whose save adds at most
      this much (``checkpoint/host_copy.py``): every save adds about this much at most.
  """

  def __init__(
    self,
    directory: str | os.PathLike,
    *,
    save_interval_steps: int = 1000,
    max_to_keep: Optional[int] = 3,
    async_save: bool = True,
    host_copy: host_guard.HostCopy = "auto",
    move_damaged: bool = True,
    save_batch_bytes: int = transfers.DEFAULT_BATCH_BYTES,
  ):
    if host_copy not in ("auto", "copy", "block"):
      raise ValueError(f"host_copy must be 'auto', 'copy' or 'block', got {host_copy!r}.")
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}.")
    self.directory = os.path.abspath(os.fspath(directory)) if _is_local(os.fspath(directory)) else os.fspath(directory)
    self.async_save, self.host_copy, self.max_to_keep = async_save, host_copy, max_to_keep
    self.move_damaged = move_damaged
    self._lock = threading.Lock()
    self._pending: set[int] = set()  # saved by this manager, manifest not written yet
    self._verified: set[int] = set()  # verified (or written) by this manager
    self._finisher: Optional[threading.Thread] = None
    self._finisher_error: Optional[BaseException] = None
    self._unsynced = False  # a save finished here that the other processes have not been synchronised with
    options = ocp.CheckpointManagerOptions(
      save_interval_steps=save_interval_steps,
      max_to_keep=None,  # retention is ours: it counts intact steps only (see _apply_retention)
      enable_async_checkpointing=async_save,
      create=False,  # made by the first save, so restore from a mistyped path fails clearly
    )
    self._batch_bytes, self._warned = save_batch_bytes, False
    self._transfer_order = transfers.TransferOrder()  # how the next save copies to host memory (transfers.py)
    handlers = {name: transfers.pytree_handler(self._transfer_order, save_batch_bytes) for name in _PYTREE_ITEMS}
    handlers |= {"meta": ocp.JsonCheckpointHandler(), "format": ocp.JsonCheckpointHandler()}
    self._mgr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  # ---------------------------------------------------------------- save

  def save(self, step: int, *, params: Any, opt_state: Any, meta: Optional[dict] = None, force: bool = False) -> bool:
    """Saves ``params``, ``opt_state`` (any state with one Adam state) and ``meta`` at ``step``.

    Returns whether a checkpoint was started (``False`` between save intervals).
    When it returns, ``params`` and ``opt_state`` may be updated in place.
    The step is complete once its manifest is written, right after Orbax
    commits it (:meth:`wait_until_finished` waits for both). A step already on
    disk at ``step`` is refused if it verifies and moved aside if not.
    """
    meta = {} if meta is None else meta
    try:
      json.dumps(meta)
    except (TypeError, ValueError) as e:
      raise TypeError(f"meta must be JSON-serializable (dicts, lists, str, numbers, bool, None): {e}") from e
    if not force and not self._mgr.should_save(step):
      return False
    wait_for_host_updates()  # a delayed host update may still be writing the state
    trees, fmt = canonical.to_disk(params, opt_state)

    self.wait_until_finished()  # one save in flight: bounds the memory of host copies; applies retention
    self.check_space(trees)  # (creates a local directory)
    self._clear_step(step)
    mode = host_guard.guard_mode(trees, self.async_save, self.host_copy, self._batch_bytes, warn=not self._warned)
    self._warned |= mode == "block"
    trees = host_guard.guarded(trees, mode)
    self._transfer_order.start(batched=mode == "block" or not self.async_save)  # waited for: copies in batches
    args = {name: ocp.args.PyTreeSave(tree) for name, tree in trees.items()}
    args |= {"meta": ocp.args.JsonSave(meta), "format": ocp.args.JsonSave(fmt)}
    with self._lock:
      self._pending.add(step)
    saved = False
    try:
      saved = self._mgr.save(step, args=ocp.args.Composite(**args), force=force)
    finally:
      if not saved:
        with self._lock:
          self._pending.discard(step)
    self._unsynced |= saved
    if saved and (mode == "block" or not self.async_save):
      self.wait_until_finished()
    elif saved:  # the manifest is written as soon as Orbax commits, not at the next call
      self._finisher = threading.Thread(target=self._finish_in_background, name="jax_dos_manifest")
      self._finisher.start()
    return saved

  def _clear_step(self, step: int) -> None:
    """Makes room for a save at ``step``: an earlier save's leftovers there are removed or moved aside."""
    if not _is_local(self.directory):
      return
    tmp = self._step_dir(step) + TMP_SUFFIX  # an interrupted write (Orbax would remove it, with a warning)
    if os.path.isdir(tmp) and jax.process_index() == 0:
      shutil.rmtree(tmp)
    if os.path.isdir(self._step_dir(step)):
      damage = self._verify(step)
      if damage is None:
        raise ValueError(
          f"checkpoint step {step} already exists in {self.directory} and verifies; save at a later step, or"
          " delete it first."
        )
      self._set_aside(step, damage)
      if os.path.isdir(self._step_dir(step)):
        raise ValueError(f"checkpoint step {step} in {self.directory} is damaged ({damage}); delete it to save there.")

  def writing(self) -> bool:
    """Whether a save returned and is still being written (Orbax's commit or its manifest), without waiting; a
    :meth:`wait_until_finished` then ends it (and raises its error, if it failed). Process-local: no collective."""
    finisher = self._finisher
    return finisher is not None and finisher.is_alive()

  def _finish_in_background(self) -> None:
    try:
      self._mgr.wait_until_finished()  # Orbax's own finalize thread: the step is renamed into place when it ends
      self._write_pending_manifests()
    except BaseException as e:  # noqa: BLE001 (raised again in the caller's thread)
      self._finisher_error = e

  def save_added_bytes(self, params: Any, opt_state: Any) -> int:
    """The most a :meth:`save` of ``params`` and ``opt_state`` adds to this process's host memory (bytes): an
    asynchronous save's copies (``host_copy.async_added_bytes``) where it would save asynchronously, else one batch
    of Orbax's copies (``save_batch_bytes``, or the largest array where that is larger). No collective, no copy."""
    trees, _ = canonical.to_disk(params, opt_state)
    added = host_guard.async_added_bytes(*host_guard.held_bytes(trees))
    if host_guard.saves_asynchronously(self.async_save, self.host_copy, added, self._batch_bytes):
      return added  # (where ``"auto"`` blocks for want of available memory instead, a batch is less than this)
    sizes = [host_guard.process_bytes(x) for x in jax.tree.leaves(trees)]
    return min(sum(sizes), max(self._batch_bytes, max(sizes, default=0)))

  def check_space(self, *trees: Any) -> None:
    """Raises ``OSError`` if the checkpoint directory's disk cannot hold one checkpoint of ``trees``.

    Called by :meth:`save` before anything is written (so a full disk never
    leaves a half-written step behind), and usable before training starts,
    with ``params`` and the optimizer state, to fail early. Remote paths are
    not checked.
    """
    if _is_local(self.directory):
      integrity.check_space(self.directory, sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves(trees)))

  def _write_pending_manifests(self) -> None:
    """Writes the manifest of every committed step saved by this manager (process 0 only; the others mark them)."""
    with self._lock:
      pending = sorted(self._pending)
    for step in pending:
      step_dir = self._step_dir(step)
      if _is_local(self.directory) and not os.path.isdir(step_dir):
        continue  # not committed (yet)
      if jax.process_index() == 0 and _is_local(self.directory):
        integrity.write_manifest(step_dir, step)  # (the lock is not held: checksums take a while)
      with self._lock:
        self._pending.discard(step)
        self._verified.add(step)

  def wait_until_finished(self) -> None:
    """Blocks until the save in flight (if any) is committed and its manifest written; then applies retention."""
    finisher, self._finisher = self._finisher, None
    if finisher is not None:
      finisher.join()
    error, self._finisher_error = self._finisher_error, None
    self._mgr.wait_until_finished()  # raises a failed save's error
    if error is not None:
      raise error
    self._write_pending_manifests()
    self._apply_retention()
    if self._unsynced:  # every process waits for process 0's manifests and retention
      barrier("jax_dos_checkpoint_finished")
      self._unsynced = False
      self._write_pending_manifests()  # the other processes: their steps are committed, with manifests, by now

  def _apply_retention(self) -> None:
    """Deletes intact steps older than the newest ``max_to_keep`` intact ones.

    Runs when no save is in flight. Intact: a manifest whose files all have
    their sizes (contents are not read). Incomplete or damaged steps are never
    deleted here, and neither is the newest verified one.
    """
    if self.max_to_keep is None or not _is_local(self.directory) or jax.process_index() != 0:
      return
    if not os.path.isdir(self.directory):
      return
    intact = sorted(self._intact_steps(), reverse=True)
    newest_verified = max(self._verified & set(intact), default=None)
    doomed = [s for s in intact[self.max_to_keep :] if s != newest_verified]
    for step in doomed:
      # Renamed first, out of Orbax's listing, so that an interrupted deletion leaves no half step behind; not
      # Orbax's delete, which waits at a barrier for every process.
      gone = os.path.join(self.directory, f".{step}{DELETING_SUFFIX}")
      os.rename(self._step_dir(step), gone)
      shutil.rmtree(gone)
      self._verified.discard(step)
    for name in os.listdir(self.directory):  # what an interrupted deletion left
      if name.startswith(".") and name.endswith(DELETING_SUFFIX):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    if doomed:
      self._mgr.reload()

  def close(self) -> None:
    self.wait_until_finished()
    self._mgr.close()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---------------------------------------------------------------- verification

  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _verify(self, step: int) -> Optional[integrity.Damage]:
    """Why ``step`` fails verification (every file's size and checksums: reads the whole step), or ``None``.

    With several processes, process 0 verifies and the others take its verdict (a collective: every process calls).
    """
    if not _is_local(self.directory):
      return None
    damage = integrity.verify(self._step_dir(step)) if jax.process_index() == 0 else None
    if from_primary(damage is not None) and damage is None:
      damage = integrity.Damage(OTHER_PROCESS, "process 0 found it damaged (its warning or error says how)")
    if damage is None:
      self._verified.add(step)
    return damage

  def _set_aside(self, step: int, damage: integrity.Damage, *, warn: bool = True) -> str:
    """:meth:`_set_aside_here`, then every process waits until the step is moved (a collective)."""
    line = self._set_aside_here(step, damage, warn=warn)
    barrier("jax_dos_checkpoint_set_aside")
    return line

  def _set_aside_here(self, step: int, damage: integrity.Damage, *, warn: bool = True) -> str:
    """Moves a damaged step to ``<directory>/damaged/`` (if ``move_damaged``: process 0 moves it); returns one line
    on it, and warns it in process 0."""
    self._verified.discard(step)
    where = "left in place"
    if self.move_damaged and jax.process_index() == 0:
      target = integrity.quarantine(self.directory, step, damage)
      self._mgr.reload()
      where = f"moved to {target}"
    elif self.move_damaged:
      where = "moved aside by process 0"
    line = f"checkpoint step {step} in {self.directory} failed verification: {damage}; {where}."
    if warn and jax.process_index() == 0:
      warnings.warn(line, DamagedCheckpointWarning, stacklevel=4)
    return line

  def all_steps(self) -> list[int]:
    """Every committed step on disk (complete, verified or not), ascending."""
    if _is_local(self.directory) and not os.path.isdir(self.directory):
      return []
    self._mgr.reload()
    return sorted(self._mgr.all_steps())

  def complete_steps(self) -> list[int]:
    """Committed steps whose save finished: they have a manifest (their files are not checked here), ascending."""
    return [
      s for s in self._finished_steps() if not _is_local(self.directory) or integrity.has_manifest(self._step_dir(s))
    ]

  def _intact_steps(self) -> list[int]:
    """Complete steps whose files all exist with their sizes (no contents read), ascending."""
    return [s for s in self.complete_steps() if integrity.verify(self._step_dir(s), content=False) is None]

  def latest_step(self) -> Optional[int]:
    """The newest step that verifies, or ``None``; newer ones that fail are set aside (see ``move_damaged``).

    Reads every file of the steps it checks; :meth:`restore` with ``step=None`` does the same search. With several
    processes, process 0 searches and the others take its answer.
    """
    found = self._search_latest() if jax.process_index() == 0 else -1
    found = from_primary(-1 if found is None else found)  # sent once process 0 has moved what it found damaged
    if found >= 0:
      self._verified.add(found)
    return None if found < 0 else found

  def _search_latest(self) -> Optional[int]:
    """:meth:`latest_step` in this process alone (no collective)."""
    for step in reversed(self._finished_steps()):
      damage = integrity.verify(self._step_dir(step)) if _is_local(self.directory) else None
      if damage is None:
        self._verified.add(step)
        return step
      self._set_aside_here(step, damage)
    return None

  def _finished_steps(self) -> list[int]:
    with self._lock:
      pending = set(self._pending)
    return [s for s in self.all_steps() if s not in pending]

  # ---------------------------------------------------------------- restore

  def restore(self, step: Optional[int] = None, *, params: Any, opt_state: Any) -> tuple[Any, Any, dict]:
    """Restores ``(params, opt_state, meta)`` shaped, sharded and placed like the templates.

    Every file of the step is verified first (size and checksums); nothing
    of a step that fails is read.

    Args:
      step: the step to restore; ``None`` means the newest step that verifies
        (newer ones that fail are set aside, each reported in a
        :class:`DamagedCheckpointWarning`).
      params: template (concrete arrays or ``jax.ShapeDtypeStruct`` s with
        shardings) for the params.
      opt_state: template of the optimizer state: an ``optax.adamw``-style
        state or a jax_dos :class:`InterleavedAdamState`, possibly inside an
        ``optax.chain`` tuple. The checkpoint may hold either kind.

    Returns:
      ``(params, opt_state, meta)`` with every array in its template's sharding
      and memory kind.

    Raises:
      FileNotFoundError: no such directory, no checkpoint in it, no step ``step``, or (``step=None``) no step
        that verifies.
      ValueError: ``step`` fails verification.
      TemplateMismatchError: the templates' trees differ from the checkpoint's (a ``ValueError``).
    """
    return reading.read_step(self._mgr, self._verified_step(step), params, opt_state)

  def restore_params(self, step: Optional[int] = None, *, params: Any) -> tuple[Any, dict]:
    """``(params, meta)`` of a step, without its optimizer state (to export or evaluate a run's weights): the step
    and the template ``params`` as :meth:`restore` takes them, with the same verification and errors."""
    return reading.read_params(self._mgr, self._verified_step(step), params)

  def restore_master(self, step: Optional[int] = None, *, params: Any) -> Optional[tuple[Any, dict]]:
    """``(master, meta)`` of a step: the float32 master weights of a jax_dos optimizer state, placed like the
    template ``params`` (its shapes and shardings; float32 whatever its dtype), without the moments; ``None`` where
    the step holds no master (an ``optax.adamw`` run's params are its float32 weights). Verification and errors as
    :meth:`restore_params`'."""
    return reading.read_master(self._mgr, self._verified_step(step), params)

  def meta(self, step: Optional[int] = None) -> dict:
    """The ``meta`` dict saved with a step (default the newest complete one), read without verifying the step (a
    small file; what a template is made from): :meth:`restore_params` or :meth:`restore` then verifies what it
    reads. ``FileNotFoundError`` where there is no such step."""
    steps = self.complete_steps()
    if not steps or (step is not None and step not in steps):
      raise FileNotFoundError(f"no complete checkpoint{'' if step is None else f' for step {step}'} in"
                              f" {self.directory}; complete steps: {steps}.")  # fmt: skip
    chosen = steps[-1] if step is None else step
    return self._mgr.restore(chosen, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

  def _verified_step(self, step: Optional[int]) -> int:
    """``step`` once its files verify, or (``None``) the newest step that verifies; ``FileNotFoundError`` or
    ``ValueError`` as :meth:`restore` says."""
    if _is_local(self.directory) and not os.path.isdir(self.directory):
      raise FileNotFoundError(
        f"checkpoint directory {self.directory} does not exist; check the path, or start from scratch."
      )
    self.wait_until_finished()
    steps = self._finished_steps()
    if step is not None:
      if step not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; committed steps: {steps}.")
      damage = self._verify(step)
      if damage is not None:
        raise ValueError(self._set_aside(step, damage, warn=False))
      return step
    if not steps:
      raise FileNotFoundError(f"no checkpoints in {self.directory}.")
    found = self.latest_step()  # verifies
    if found is None:
      raise FileNotFoundError(
        f"no checkpoint in {self.directory} verifies (steps {steps}; see the warnings above"
        + (f", and {os.path.join(self.directory, integrity.DAMAGED_DIR)}" if self.move_damaged else "")
        + ")."
      )
    return found
